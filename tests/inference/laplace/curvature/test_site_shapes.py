"""Every curvature on 0-d and 1-d latent sites, against the exact answer.

The models are one linear-Gaussian regression written four ways: a scalar bias, a
vector weight used by ``@``, by ``F.linear`` as a 1-d weight, and the usual ``(1, d)``
``F.linear`` weight with a ``(1,)`` bias. With a Gaussian likelihood the GGN is the exact
Hessian, ``H = X^T X / sigma^2`` over the features ``[x, 1]``, so each curvature has a
closed form: the whole precision (``full``), its per-site blocks (K-FAC is exact for a
one-output linear layer with constant output gradients ``1 / sigma``), its diagonal, or
the diagonal empirical Fisher at the mode.
"""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
import torch.nn.functional as F
from pyro.infer import Predictive

import pyro_bdl as bdl
from pyro_bdl.data import TensorLoader
from pyro_bdl.inference import LaplaceGuide

NUM_DATA, DIM, SIGMA, PRIOR_SCALE = 40, 3, 0.5, 0.7


def _prior(*shape):
    return dist.Normal(0.0, PRIOR_SCALE).expand(shape).to_event(len(shape))


def matmul_and_scalar_bias(x):
    w = pyro.sample("w", _prior(DIM))
    b = pyro.sample("b", dist.Normal(0.0, PRIOR_SCALE))
    return x @ w + b


def linear_with_vector_weight(x):
    w = pyro.sample("w", _prior(DIM))
    b = pyro.sample("b", dist.Normal(0.0, PRIOR_SCALE))
    return F.linear(x, w) + b


def linear_layer(x):
    w = pyro.sample("w", _prior(1, DIM))
    b = pyro.sample("b", _prior(1))
    return F.linear(x, w, b).squeeze(-1)


NETWORKS = [matmul_and_scalar_bias, linear_with_vector_weight, linear_layer]
CURVATURES = ["full", "diag_ggn", "diag_ef", "kron", "kron_lowrank"]


def _model(network):
    def model(batch, num_data):
        x, y = batch
        f = network(x)
        bdl.observe("y", dist.Normal(f, SIGMA), y, num_data)
        return f.unsqueeze(-1)  # (B, 1): one output for the linearised predictive

    return model


@pytest.fixture
def data():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(NUM_DATA, DIM, generator=generator)
    y = (
        x @ torch.tensor([1.0, -2.0, 0.5])
        + 0.3
        + SIGMA * torch.randn(NUM_DATA, generator=generator)
    )
    features = torch.cat([x, torch.ones(NUM_DATA, 1)], 1)
    precision = features.T @ features / SIGMA**2 + torch.eye(DIM + 1) / PRIOR_SCALE**2
    mean = torch.linalg.solve(precision, features.T @ y / SIGMA**2)
    return x, y, features, precision, mean


def _expected_precision(curvature, network, features, y, mean, precision):
    """The precision each curvature promises, over the flattened [w, b]."""
    if curvature == "full":
        return precision
    if curvature == "diag_ef":
        scores = (y - features @ mean) / SIGMA**2
        return torch.diag((scores[:, None] * features).square().sum(0) + PRIOR_SCALE**-2)
    if curvature.startswith("kron") and network is linear_layer:
        blocks = precision.clone()  # K-FAC: w's block is exact, the bias is diagonal
        blocks[:DIM, DIM:] = blocks[DIM:, :DIM] = 0
        return blocks
    return torch.diag(precision.diagonal())  # the diagonal GGN (K-FAC's dense sites too)


def _flat(values, network):
    return torch.cat([values["w"].reshape(-1), values["b"].reshape(-1)])


def _site_values(flat, network):
    w_shape = (1, DIM) if network is linear_layer else (DIM,)
    b_shape = (1,) if network is linear_layer else ()
    return {"w": flat[:DIM].reshape(w_shape), "b": flat[DIM:].reshape(b_shape)}


@pytest.mark.parametrize("network", NETWORKS, ids=lambda n: n.__name__)
@pytest.mark.parametrize("curvature", CURVATURES)
def test_curvature_on_scalar_and_vector_sites(data, curvature, network):
    x, y, features, precision, mean = data
    model = _model(network)
    loader = TensorLoader((x, y), batch_size=10)
    guide = LaplaceGuide(model, curvature=curvature)
    guide.fit(loader, NUM_DATA, map=_site_values(mean, network), progress=False)
    expected = _expected_precision(curvature, network, features, y, mean, precision)
    covariance = torch.linalg.inv(expected)

    variance = guide.variance()
    assert variance["b"].shape == (() if network is not linear_layer else (1,))
    assert torch.allclose(_flat(variance, network), covariance.diagonal())

    # Draws: their offsets from the mean are R z with R R^T = P^{-1}.
    draws = guide.sample_posterior(4000, torch.Generator().manual_seed(1))
    offsets = torch.stack(
        [_flat({k: v[s] for k, v in draws.items()}, network) for s in range(4000)]
    )
    offsets = offsets - mean
    empirical = offsets.T @ offsets / len(offsets)
    sd = covariance.diagonal().sqrt()
    # Second-moment entries have standard error <= sqrt(2) s_i s_j / sqrt(n); allow 5.
    assert torch.all((empirical - covariance).abs() <= 5 * math.sqrt(2 / 4000) * sd[:, None] * sd)

    # The guide's trace carries the Gaussian log density of its draw.
    trace = pyro.poutine.trace(guide).get_trace((x, y), NUM_DATA)
    value = _flat({k: trace.nodes[k]["value"] for k in ("w", "b")}, network)
    gaussian = dist.MultivariateNormal(mean, precision_matrix=expected)
    assert torch.allclose(trace.log_prob_sum(), gaussian.log_prob(value))

    # Evidence: log p(y | mean) + log p(mean) + d/2 log 2 pi - 1/2 log det P.
    log_likelihood = dist.Normal(features @ mean, SIGMA).log_prob(y).sum()
    log_prior = dist.Normal(0.0, PRIOR_SCALE).log_prob(mean).sum()
    evidence = (
        log_likelihood
        + log_prior
        + (DIM + 1) / 2 * math.log(2 * math.pi)
        - torch.logdet(expected) / 2
    )
    assert torch.allclose(guide.log_marginal_likelihood(), evidence)

    # The linearised predictive's variance is x^T P^{-1} x per example.
    f_mean, f_covariance = guide.output_distribution((x[:5], None), NUM_DATA)
    assert torch.allclose(f_mean.squeeze(-1), features[:5] @ mean)
    expected_variance = torch.einsum("bi,ij,bj->b", features[:5], covariance, features[:5])
    assert torch.allclose(f_covariance.reshape(5), expected_variance)

    # Predictive draws keep every site's shape.
    predicted = Predictive(model, guide=guide, num_samples=3)((x[:5], None), NUM_DATA)
    assert predicted["b"].shape[0] == 3 and predicted["y"].shape == (3, 5)


def test_the_exact_posterior_of_a_scalar_site_in_full(data):
    """Issue 10 item 4: a 0-d site with curvature='full' crashed in flatten(2)."""
    x, y, features, precision, mean = data
    model = _model(matmul_and_scalar_bias)
    guide = LaplaceGuide(model, curvature="full")
    guide.fit(
        TensorLoader((x, y), batch_size=10),
        NUM_DATA,
        map=_site_values(mean, matmul_and_scalar_bias),
        progress=False,
    )
    assert torch.allclose(guide.variance()["b"], torch.linalg.inv(precision)[DIM, DIM])
    assert torch.allclose(guide.log_marginal_likelihood(), _exact_evidence(x, y, features))


def _exact_evidence(x, y, features):
    covariance = SIGMA**2 * torch.eye(NUM_DATA) + PRIOR_SCALE**2 * features @ features.T
    return dist.MultivariateNormal(torch.zeros(NUM_DATA), covariance).log_prob(y)
