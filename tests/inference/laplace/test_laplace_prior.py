"""The fitted posterior as the next episode's prior."""

import pyro
import pyro.distributions as dist
import pytest
import torch

import pyro_bdl as bdl
from pyro_bdl.data import TensorLoader
from pyro_bdl.inference import BlockNormal, LaplaceGuide, fit_map


def linear_model(net, sigma):
    def model(batch, num_data):
        x, y = batch
        mean = net(x).squeeze(-1)
        bdl.observe("y", dist.Normal(mean, sigma), y, num_data)
        return mean

    return model


def test_round_trip_gives_the_exact_two_batch_posterior_mean(linear_gaussian):
    first = linear_gaussian
    second = first.__class__(num_data=30, seed=1)
    sigma, alpha = first.sigma, first.alpha
    torch.manual_seed(0)
    net = bdl.lift(
        torch.nn.Linear(first.dim, 1, bias=False), prior=bdl.priors.IIDNormal(alpha**-0.5)
    )
    model = linear_model(net, sigma)
    guide = LaplaceGuide(model, curvature="full")
    guide.fit(first.loader(), first.num_data, map={"weight": first.mean[None]}, progress=False)
    net.prior = guide.as_prior()
    assert isinstance(net.prior_distribution("weight"), BlockNormal)
    # Episode 2: MAP under the episode-1 posterior, by full-batch gradient descent on a
    # quadratic of condition number 1.9 (eigenvalues 214 - 401): at lr 1 / largest and
    # momentum 0.5 every direction's error falls by sqrt(0.5) = 0.71 a step (complex
    # heavy-ball roots), so 200 steps reach round-off (2,000 were run before).
    x = torch.cat([first.x, second.x])
    y = torch.cat([first.y, second.y])
    precision = x.T @ x / sigma**2 + alpha * torch.eye(first.dim)
    exact = torch.linalg.solve(precision, x.T @ y / sigma**2)
    largest = torch.linalg.eigvalsh(precision)[-1].item()
    loader = TensorLoader((second.x, second.y), batch_size=second.num_data)
    optimizer = pyro.optim.SGD({"lr": 1.0 / largest, "momentum": 0.5})
    fitted = fit_map(
        model, loader, second.num_data, num_steps=200, optimizer=optimizer, progress=False
    )
    assert torch.allclose(fitted["weight"][0], exact, atol=1e-6)


@pytest.mark.parametrize("curvature", ["kron", "full"])
def test_block_prior_has_the_gaussian_density(helpers, curvature):
    network = helpers.mlp(bias=False)
    x, y = helpers.classification_data()
    net = bdl.lift(network, prior=bdl.priors.IIDNormal(1.0))
    guide = LaplaceGuide(helpers.classifier(net), curvature=curvature, temperature=0.5)
    guide.fit(TensorLoader((x, y), batch_size=20), 60, map=False, progress=False)
    prior = guide.as_prior()
    param = network[2].weight
    distribution = prior.distribution("2.weight", param)
    assert distribution.event_shape == param.shape and distribution.batch_shape == ()
    block = guide.laplace_fit.blocks[0 if curvature == "full" else 1].restrict("2.weight")
    precision = helpers.dense_precision(block, guide.prior_precision) / 0.5
    gaussian = dist.MultivariateNormal(param.detach().flatten(), precision_matrix=precision)
    value = torch.randn(4, *param.shape)
    assert torch.allclose(distribution.log_prob(value), gaussian.log_prob(value.flatten(1)))
    # The draws have the covariance T P^-1: each second-moment entry within 5 of its
    # standard errors sqrt((S_ii S_jj + S_ij^2) / n) (a wrong sqrt(T) is off by 40 %).
    num_draws = 20000
    torch.manual_seed(0)
    draws = distribution.rsample((num_draws,))
    assert draws.shape == (num_draws, *param.shape)
    centred = (draws - param.detach()).flatten(1)
    covariance = torch.linalg.inv(precision)
    var = covariance.diagonal()
    error = ((var[:, None] * var[None, :] + covariance**2) / num_draws).sqrt()
    assert torch.all((centred.T @ centred / num_draws - covariance).abs() <= 5 * error)


def test_a_diagonal_posterior_is_a_normal_prior_for_the_next_laplace(helpers):
    network = helpers.mlp()
    x, y = helpers.classification_data()
    net = bdl.lift(network, prior=bdl.priors.IIDNormal(1.0))
    model = helpers.classifier(net)
    loader = TensorLoader((x, y), batch_size=20)
    first = LaplaceGuide(model, curvature="diag_ef").fit(loader, 60, map=False, progress=False)
    net.prior = first.as_prior()
    second = LaplaceGuide(model, curvature="diag_ef").fit(loader, 60, map=False, progress=False)
    # Same data twice: the precision adds the curvature again to the first posterior's.
    for name, variance in first.variance().items():
        curvature = 1 / variance - 1.0
        assert torch.allclose(1 / second.variance()[name], 1 / variance + curvature)
    with pytest.raises(KeyError, match="prefix="):
        first.as_prior(prefix="other.").distribution("0.weight", network[0].weight)
