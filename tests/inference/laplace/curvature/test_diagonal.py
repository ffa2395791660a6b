"""Diagonal GGN and diagonal empirical Fisher against laplace-torch and exact posteriors."""

import copy

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import pyro_bdl as bdl
from pyro_bdl.inference import LaplaceGuide


@pytest.mark.parametrize(
    "curvature, backend", [("diag_ggn", "BackPackGGN"), ("diag_ef", "BackPackEF")]
)
def test_matches_laplace_torch_on_an_mlp(curvature, backend, helpers, laplace_torch):
    network = helpers.mlp(bias=True)
    x, y = helpers.classification_data()
    prior_precision = 3.0
    reference = laplace_torch.DiagLaplace(
        copy.deepcopy(network),
        "classification",
        prior_precision=prior_precision,
        backend=getattr(laplace_torch.curvature, backend),
    )
    reference.fit(DataLoader(TensorDataset(x, y), batch_size=len(x)))

    net = bdl.lift(network, prior=bdl.priors.IIDNormal(prior_precision**-0.5))
    guide = LaplaceGuide(helpers.classifier(net), curvature=curvature)
    # Our minibatches of 16 (the last one short) must sum to laplace-torch's full batch.
    guide.fit(DataLoader(TensorDataset(x, y), batch_size=16), len(x), map=False, progress=False)

    ours = torch.cat([block.curvature.flatten() for block in guide.laplace_fit.blocks])
    assert torch.allclose(ours, reference.H, rtol=1e-4, atol=1e-10)
    assert torch.allclose(
        guide.log_marginal_likelihood(), reference.log_marginal_likelihood(), rtol=1e-4
    )
    mean, covariance = guide.output_distribution((x, y), len(x))
    f_mean, f_covariance = reference._glm_predictive_distribution(x)
    assert torch.allclose(mean, f_mean, atol=1e-10)
    assert torch.allclose(covariance, f_covariance, rtol=1e-4, atol=1e-10)


def test_diagonal_ggn_is_the_exact_diagonal_precision(linear_gaussian, helpers):
    problem = linear_gaussian
    guide = LaplaceGuide(problem.model, curvature="diag_ggn")
    guide.fit(problem.loader(), problem.num_data, map={"w": problem.mean}, progress=False)
    (block,) = guide.laplace_fit.blocks
    precision = helpers.dense_precision(block, guide.prior_precision)
    assert torch.allclose(precision, torch.diag(problem.precision.diagonal()), atol=1e-10)
    assert torch.allclose(guide.variance()["w"], 1 / problem.precision.diagonal(), atol=1e-12)
