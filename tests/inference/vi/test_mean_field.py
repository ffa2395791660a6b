"""MeanFieldGuide: sites sampled in place, closed-form KL, temperature, STL, interfaces."""

import json
import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import SVI, Predictive, Trace_ELBO, TraceMeanField_ELBO
from torch.distributions import kl_divergence

import pyro_bdl as bdl
from pyro_bdl.inference import MeanFieldGuide, VariationalNormal

PRIOR_LOC, PRIOR_SCALE = 0.2, 0.7
F64 = {"dtype": torch.float64}


def _prior_only():
    """A model with one (4, 3) weight and no data: the ELBO is minus the (tempered) KL."""

    def model():
        prior = dist.Normal(torch.tensor(PRIOR_LOC, **F64), PRIOR_SCALE).expand([4, 3])
        pyro.sample("w", prior.to_event(2))

    return model


def _lifted_linear():
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 2).double()
    net = bdl.lift(layer, bdl.priors.IIDNormal(PRIOR_SCALE))
    return layer, lambda: net(torch.zeros(1, 3, **F64))


def _set(guide, name, loc, scale):
    locs, scale_params = guide.variational_parameters()
    with torch.no_grad():
        locs[name].copy_(loc)
        scale_params[name].copy_(torch.log(torch.as_tensor(scale, **F64)))


def test_each_latent_site_is_sampled_at_the_site_itself():
    layer, model = _lifted_linear()
    guide = MeanFieldGuide(model)
    guide_trace = poutine.trace(guide).get_trace()
    samples = {n: s for n, s in guide_trace.nodes.items() if s["type"] == "sample"}
    assert set(samples) == {"weight", "bias"}
    for site in samples.values():
        assert isinstance(site["fn"].base_dist, VariationalNormal)
        assert not site["infer"].get("is_auxiliary")
    assert samples["weight"]["fn"].event_shape == layer.weight.shape


@pytest.mark.parametrize("parametrization", ["exp", "softplus", "square"])
def test_means_start_at_the_module_weights_and_scales_at_init_scale(parametrization):
    layer, model = _lifted_linear()
    guide = MeanFieldGuide(model, init_scale=0.02, scale_parametrization=parametrization)
    guide()
    parameters = guide.approximation_parameters()
    torch.testing.assert_close(parameters["weight.loc"], layer.weight.detach())
    torch.testing.assert_close(parameters["bias.loc"], layer.bias.detach())
    for name in ("weight", "bias"):
        scale = parameters[f"{name}.scale"]
        torch.testing.assert_close(scale, torch.full_like(scale, 0.02))


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_trace_mean_field_elbo_uses_the_closed_form_kl(temperature):
    model = _prior_only()
    guide = MeanFieldGuide(model, init_scale=0.3, temperature=temperature)
    guide()
    elbo = TraceMeanField_ELBO()
    losses = [elbo.loss(model, guide) for _ in range(3)]
    q = torch.distributions.Normal(guide.median()["w"], 0.3)
    prior = torch.distributions.Normal(torch.tensor(PRIOR_LOC, **F64), PRIOR_SCALE)
    expected = (kl_divergence(q, prior) + (1 - temperature) * q.entropy()).sum().item()
    assert losses == [pytest.approx(expected, rel=1e-12)] * 3


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_trace_elbo_estimates_the_same_objective(temperature):
    model = _prior_only()
    guide = MeanFieldGuide(model, init_scale=0.3, temperature=temperature)
    guide()
    exact = TraceMeanField_ELBO().loss(model, guide)
    num_particles = 4000
    pyro.set_rng_seed(0)
    estimate = Trace_ELBO(
        num_particles=num_particles, vectorize_particles=True, max_plate_nesting=0
    ).loss(model, guide)
    # The per-particle loss is sum_j [T log q(w_j) - log p(w_j)]; its standard deviation,
    # estimated from draws, bounds the Monte Carlo error of the mean (5 sigma).
    q = guide.get_posterior("w")
    draws = q.sample((num_particles,))
    prior = dist.Normal(torch.tensor(PRIOR_LOC, **F64), PRIOR_SCALE).expand([4, 3]).to_event(2)
    per_particle = q.log_prob(draws) - prior.log_prob(draws)
    tolerance = 5 * per_particle.std().item() / math.sqrt(num_particles)
    assert abs(estimate - exact) < tolerance


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_tempered_objective_is_minimised_by_the_tempered_target(temperature):
    # With no data the target p^(1/T) of a N(mu, sigma^2) prior is N(mu, T sigma^2), and the
    # closed-form objective is deterministic, so optimisation converges to it exactly.
    model = _prior_only()
    guide = MeanFieldGuide(model, init_scale=0.1, temperature=temperature)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.05}), TraceMeanField_ELBO())
    for _ in range(600):
        svi.step()
    parameters = guide.approximation_parameters()
    torch.testing.assert_close(
        parameters["w.scale"],
        torch.full((4, 3), PRIOR_SCALE * temperature**0.5, **F64),
        atol=1e-3,
        rtol=0,
    )
    torch.testing.assert_close(
        parameters["w.loc"], torch.full((4, 3), PRIOR_LOC, **F64), atol=1e-3, rtol=0
    )


def test_sticking_the_landing_gradient_vanishes_at_the_exact_posterior():
    # Conjugate: theta ~ N(0, 1), y_i ~ N(theta, 0.5^2). At q = p(theta | y) the integrand
    # log p(y, theta) - log q(theta) is constant in theta, so the STL gradient is exactly 0
    # for every draw, while the ordinary estimator's score term is not.
    y = torch.tensor([0.3, 1.1, 0.7, -0.2, 0.9], **F64)

    def model():
        theta = pyro.sample("theta", dist.Normal(torch.zeros(1, **F64), 1.0).to_event(1))
        with pyro.plate("data", len(y)):
            pyro.sample("y", dist.Normal(theta, 0.5), obs=y)

    precision = 1.0 + len(y) / 0.25
    posterior_loc, posterior_scale = (y.sum() / 0.25) / precision, precision**-0.5
    largest = {}
    for stl in (True, False):
        guide = MeanFieldGuide(model, stick_the_landing=stl)
        guide()
        _set(guide, "theta", posterior_loc, posterior_scale)
        ((loc, raw),) = guide.flat_parameters()  # the one site's mean and raw scale
        grads = []
        for seed in range(5):
            pyro.set_rng_seed(seed)
            loss = Trace_ELBO().differentiable_loss(model, guide)
            grads += torch.autograd.grad(loss, [loc, raw])
        largest[stl] = max(g.abs().max().item() for g in grads)
    assert largest[True] < 1e-10
    assert largest[False] > 1e-3


def test_median_quantiles_predictive_and_arviz_interface():
    layer, model = _lifted_linear()
    guide = MeanFieldGuide(model, init_scale=0.1, temperature=0.5, stick_the_landing=True)
    draws = Predictive(model, guide=guide, num_samples=7)()
    assert draws["weight"].shape[0] == 7 and draws["weight"].shape[-2:] == layer.weight.shape
    torch.testing.assert_close(guide.median()["weight"], layer.weight.detach())
    quantiles = guide.quantiles([0.1587, 0.5, 0.8413])["weight"]
    assert quantiles.shape == (3, *layer.weight.shape)
    torch.testing.assert_close(
        quantiles[2] - quantiles[1], torch.full_like(quantiles[1], 0.1), atol=1e-4, rtol=0
    )
    assert set(guide.approximation_parameters()) == {
        "weight.loc",
        "weight.scale",
        "bias.loc",
        "bias.scale",
    }
    hyperparameters = json.loads(json.dumps(guide.hyperparameters()))
    assert hyperparameters == {
        "init_scale": 0.1,
        "scale_parametrization": "exp",
        "temperature": 0.5,
        "stick_the_landing": True,
    }


def test_unsupported_sites_and_arguments_are_errors_naming_the_fix():
    def discrete_site():
        pyro.sample("k", dist.Categorical(torch.ones(3)))

    with pytest.raises(ValueError, match="discrete sample site 'k'"):  # Pyro's own message
        MeanFieldGuide(discrete_site)()

    def local_site():
        with pyro.plate("n", 3):
            pyro.sample("z", dist.Normal(0.0, 1.0))

    with pytest.raises(ValueError, match="scale_parametrization"):
        MeanFieldGuide(local_site, scale_parametrization="log")
    with pytest.raises(ValueError, match="init_scale"):
        MeanFieldGuide(local_site, init_scale=0.0)
    with pytest.raises(ValueError, match="temperature"):
        MeanFieldGuide(local_site, temperature=-1.0)
    with pytest.raises(RuntimeError, match="call it once"):
        MeanFieldGuide(local_site).approximation_parameters()


def test_stddevs_are_every_sites_scale_in_one_vector():
    layer, model = _lifted_linear()
    guide = MeanFieldGuide(model, init_scale=0.02)
    guide()
    _, raw = guide.variational_parameters()
    with torch.no_grad():
        raw["bias"].add_(1.0)  # the exp parametrisation: the bias's sd becomes 0.02 e
    parameters = guide.approximation_parameters()
    bias = parameters["bias.scale"]
    torch.testing.assert_close(bias, torch.full_like(bias, 0.02 * math.e))
    expected = torch.cat([parameters[f"{name}.scale"].flatten() for name in guide.site_names])
    torch.testing.assert_close(guide.stddevs(), expected)
    assert guide.stddevs().numel() == layer.weight.numel() + layer.bias.numel()


def test_get_posterior_by_site_name_refuses_what_is_not_one_site():
    guide = MeanFieldGuide(_prior_only(), init_scale=0.3)
    guide()
    assert guide.get_posterior().event_shape == (12,)  # the flat vector of w's 4 x 3
    with pytest.raises(KeyError, match="'v' is not a latent site of the model \\['w'\\]"):
        guide.get_posterior("v")
    with pytest.raises(TypeError, match="a site's name comes alone"):
        guide.get_posterior("w", 1)
