"""Links of the linearised predictive, and the predictive over DataLoaders."""

import math

import numpy as np
import pytest
import torch

import pyro_bdl as bdl
from pyro_bdl.data import TensorLoader
from pyro_bdl.inference import LaplaceGuide
from pyro_bdl.inference.laplace.predictive import laplace_bridge, mc_probabilities, probit


def test_mc_averages_the_softmax_of_the_logit_gaussian():
    # Two classes: p(class 0) = E[sigmoid(f0 - f1)], f0 - f1 ~ N(m, v), by quadrature.
    mean = torch.tensor([[1.0, -0.5]])
    root = torch.tensor([[[1.2, 0.0], [0.7, 0.5]]])
    covariance = root @ root.mT
    m = (mean[0, 0] - mean[0, 1]).item()
    v = (covariance[0, 0, 0] + covariance[0, 1, 1] - 2 * covariance[0, 0, 1]).item()
    nodes, weights = np.polynomial.hermite_e.hermegauss(80)
    exact = float(
        np.sum(weights / (1 + np.exp(-(m + math.sqrt(v) * nodes)))) / math.sqrt(2 * math.pi)
    )
    draws = mc_probabilities(mean, covariance, 40000, torch.Generator().manual_seed(0))
    assert draws.shape == (40000, 1, 2)
    # standard error of a mean of 40000 values in [0, 1]: < 0.0025
    assert abs(draws[:, 0, 0].mean().item() - exact) < 0.01


def test_probit_scales_each_logit_by_its_variance():
    mean = torch.tensor([[2.0, 0.0, -1.0]])
    covariance = torch.diag_embed(torch.tensor([[4.0, 1.0, 0.0]]))
    scale = 1 / torch.sqrt(1 + math.pi / 8 * torch.tensor([4.0, 1.0, 0.0]))
    assert torch.allclose(probit(mean, covariance), torch.softmax(mean * scale, -1))


def test_bridge_inverts_the_dirichlet_to_gaussian_map():
    # Hobbhahn et al.: a Dirichlet(alpha) corresponds to logits with mean
    # log alpha - mean(log alpha) and variance (1 - 2/C) / alpha + sum(1/alpha) / C^2;
    # eq. 20 maps that Gaussian back to alpha, whose mean is alpha / sum(alpha).
    alpha = torch.tensor([[0.5, 2.0, 7.0, 1.3], [3.0, 3.0, 0.2, 9.0]])
    num_classes = 4
    mean = alpha.log() - alpha.log().mean(-1, keepdim=True)
    variance = (1 - 2 / num_classes) / alpha + (1 / alpha).sum(-1, keepdim=True) / num_classes**2
    probs = laplace_bridge(mean, torch.diag_embed(variance))
    assert torch.allclose(probs, alpha / alpha.sum(-1, keepdim=True))


@pytest.fixture
def guide_and_data(helpers):
    network = helpers.mlp(bias=True)
    x, y = helpers.classification_data()
    net = bdl.lift(network, prior=bdl.priors.IIDNormal(1.0))
    guide = LaplaceGuide(helpers.classifier(net), curvature="kron")
    guide.fit(TensorLoader((x, y), batch_size=16), 60, map=False, progress=False)
    return guide, x, y


def test_per_draw_probabilities_and_loaders(guide_and_data):
    guide, x, y = guide_and_data
    loader = TensorLoader((x, y), batch_size=16)
    draws = guide.predictive(
        loader, 60, num_samples=30, return_samples=True, generator=torch.Generator().manual_seed(3)
    )
    assert draws.shape == (30, 60, 3)
    mean = guide.predictive(loader, 60, num_samples=30, generator=torch.Generator().manual_seed(3))
    assert torch.allclose(draws.mean(0), mean)
    whole = guide.predictive((x, y), 60, link="probit")
    assert torch.allclose(guide.predictive(loader, 60, link="probit"), whole)
    bridge = guide.predictive((x, y), 60, link="bridge")
    assert torch.allclose(bridge.sum(-1), torch.ones(60))


def test_predictive_arguments_are_checked(guide_and_data):
    guide, x, y = guide_and_data
    with pytest.raises(ValueError, match="link must be one of"):
        guide.predictive((x, y), 60, link="logit")
    with pytest.raises(ValueError, match="needs link='mc'"):
        guide.predictive((x, y), 60, link="probit", return_samples=True)


def test_mc_through_the_logit_contrasts_equals_mc_through_all_logits(guide_and_data):
    guide, x, y = guide_and_data
    generator = torch.Generator().manual_seed(1)
    contrasts = guide.predictive((x, y), 60, num_samples=20000, generator=generator)
    mean, covariance = guide.output_distribution((x, y), 60)
    full = mc_probabilities(mean, covariance, 20000, generator).mean(0)
    # two independent means of 20000 probabilities each: standard error < 0.005
    assert torch.allclose(contrasts, full, atol=0.02)
