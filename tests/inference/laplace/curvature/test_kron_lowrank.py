"""Low-rank K-FAC: equal to K-FAC at full rank, O(k (d_in + d_out)) memory, Woodbury algebra."""

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import pyro_bdl as bdl
from pyro_bdl.inference import Kron, KronLowRank, LaplaceGuide
from pyro_bdl.inference.laplace.jacobians import DenseGradient
from pyro_bdl.inference.laplace.predictive import linearize


def fit(helpers, network, curvature, x, y, batch_size=16):
    net = bdl.lift(network, prior=bdl.priors.IIDNormal(0.5))
    guide = LaplaceGuide(helpers.classifier(net), curvature=curvature)
    loader = DataLoader(TensorDataset(x, y), batch_size=batch_size)
    return guide.fit(loader, len(x), map=False, progress=False)


def test_at_full_rank_it_equals_kron(helpers):
    network = helpers.mlp(bias=False)
    x, y = helpers.classification_data()
    kron = fit(helpers, network, "kron", x, y)
    lowrank = fit(helpers, network, KronLowRank(rank=8), x, y)  # 8 = the widest factor
    assert torch.allclose(lowrank.log_marginal_likelihood(), kron.log_marginal_likelihood())
    for name, variance in kron.variance().items():
        assert torch.allclose(lowrank.variance()[name], variance, atol=1e-12)
    _, expected = kron.output_distribution((x, y), len(x))
    _, covariance = lowrank.output_distribution((x, y), len(x))
    assert torch.allclose(covariance, expected, atol=1e-12)


def test_incremental_svd_is_exact_when_the_data_have_rank_k(helpers):
    # Inputs in a 4-dimensional subspace of R^30: the input factor has rank 4, which
    # the rank-4 factor must recover exactly over several batches.
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(50, 4, generator=generator) @ torch.randn(4, 30, generator=generator)
    y = torch.randint(0, 3, (50,), generator=generator)
    torch.manual_seed(0)
    network = torch.nn.Sequential(torch.nn.Linear(30, 3, bias=False))
    kron = fit(helpers, network, "kron", x, y, batch_size=7)
    lowrank = fit(helpers, network, KronLowRank(rank=4), x, y, batch_size=7)
    (block,) = lowrank.laplace_fit.blocks
    assert block.input_vectors.shape == (30, 4) and block.complement == 3 * 26
    assert torch.allclose(lowrank.log_marginal_likelihood(), kron.log_marginal_likelihood())
    assert torch.allclose(lowrank.variance()["0.weight"], kron.variance()["0.weight"])


def test_memory_is_k_times_the_layer_widths(helpers):
    rank = 4
    sketch = 2 * rank + 8  # columns of the Nystrom sketch of a factor wider than k
    torch.manual_seed(0)
    network = torch.nn.Sequential(
        torch.nn.Linear(40, 30, bias=False), torch.nn.Tanh(), torch.nn.Linear(30, 3, bias=False)
    )
    x, y = torch.randn(64, 40), torch.randint(0, 3, (64,))
    lowrank = fit(helpers, network, KronLowRank(rank=rank), x, y)
    kron = fit(helpers, network, Kron(), x, y)
    shapes = {"0.weight": (30, 40), "2.weight": (3, 30)}
    for site, (d_out, d_in) in shapes.items():
        # a factor wider than k: sketch and test matrix, 2 s d; a narrower one: d x d <= k d
        assert lowrank.curvature.memory()[site] <= 2 * sketch * (d_in + d_out)
        assert kron.curvature.memory()[site] == d_in**2 + d_out**2
    assert lowrank.curvature.memory()["0.weight"] == 2 * sketch * (40 + 30)
    # what the fit keeps: k eigenpairs per wide factor
    block = lowrank.laplace_fit.blocks[0]
    assert block.input_vectors.shape == (40, rank) and block.output_vectors.shape == (30, rank)


def test_truncated_factors_give_the_same_covariance_factored_or_dense(helpers):
    network = helpers.mlp(bias=False, hidden=12)
    x, y = helpers.classification_data()
    guide = fit(helpers, network, KronLowRank(rank=3), x, y)
    assert all(block.complement > 0 for block in guide.laplace_fit.blocks)
    _, grads, _ = linearize(guide.laplace_fit, ((x[:7], y[:7]), 7), {})
    delta = guide.prior_precision
    for block in guide.laplace_fit.blocks:
        dense = {name: DenseGradient(grad.per_example()) for name, grad in grads.items()}
        assert torch.allclose(
            block.output_covariance(grads, delta), block.output_covariance(dense, delta)
        )


def test_rank_must_be_a_positive_int():
    with pytest.raises(ValueError, match="rank must be an int >= 1"):
        KronLowRank(rank=0)
