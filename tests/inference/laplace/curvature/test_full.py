"""The dense Laplace approximation: exact on a conjugate model, block algebra, size guard."""

import pytest
import torch

from pyro_bdl.inference import Full, LaplaceGuide
from pyro_bdl.inference.laplace.curvature import FullBlock
from pyro_bdl.inference.laplace.jacobians import DenseGradient


def test_equals_the_exact_posterior_of_a_linear_gaussian_model(linear_gaussian):
    problem = linear_gaussian
    guide = LaplaceGuide(problem.model, curvature="full")
    # L-BFGS whitened by the exact covariance solves this quadratic in one step.
    guide.fit(problem.loader(), problem.num_data, num_steps=0, progress=False)
    assert torch.allclose(guide.median()["w"], problem.mean, atol=1e-6)
    # Row i of the draws of the unit vectors is R e_i for the root R R^T = Sigma.
    rows = guide.laplace_fit.blocks[0].sample({"w": torch.eye(problem.dim)}, guide.prior_precision)[
        "w"
    ]
    assert torch.allclose(rows.T @ rows, problem.covariance, atol=1e-6)
    assert torch.allclose(guide.variance()["w"], problem.covariance.diagonal(), atol=1e-6)


def test_block_algebra_equals_the_dense_precision(helpers):
    generator = torch.Generator().manual_seed(0)
    root = torch.randn(7, 7, generator=generator)
    block = FullBlock({"a": torch.Size([2, 2]), "b": torch.Size([3])}, root @ root.T)
    delta = {"a": torch.tensor(0.5), "b": torch.tensor([1.0, 2.0, 3.0])}
    precision = root @ root.T + torch.diag(torch.tensor([0.5] * 4 + [1.0, 2.0, 3.0]))
    assert torch.allclose(helpers.dense_precision(block, delta), precision)
    assert torch.allclose(block.log_det(delta), torch.logdet(precision))
    covariance = torch.linalg.inv(precision)
    variance = block.variance(delta)
    assert torch.allclose(
        torch.cat([variance["a"].flatten(), variance["b"]]), covariance.diagonal()
    )
    basis = torch.eye(7)
    draws = block.sample({"a": basis[:, :4].reshape(7, 2, 2), "b": basis[:, 4:]}, delta)
    root_covariance = torch.cat([draws["a"].reshape(7, 4), draws["b"]], 1)
    assert torch.allclose(root_covariance.T @ root_covariance, covariance)
    jac = torch.randn(3, 5, 7, generator=generator)
    grads = {"a": DenseGradient(jac[..., :4].reshape(3, 5, 2, 2)), "b": DenseGradient(jac[..., 4:])}
    expected = torch.einsum("cbp,pq,dbq->bcd", jac, covariance, jac)
    assert torch.allclose(block.output_covariance(grads, delta), expected)
    restricted = block.restrict("b")
    assert torch.allclose(helpers.dense_precision(restricted, delta), precision[4:, 4:])


def test_refuses_a_model_too_large_for_a_dense_matrix(linear_gaussian):
    problem = linear_gaussian
    guide = LaplaceGuide(problem.model, curvature=Full(max_params=2))
    with pytest.raises(ValueError, match="max_params=2"):
        guide.fit(problem.loader(), problem.num_data, map=False, progress=False)
