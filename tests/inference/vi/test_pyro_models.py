"""MeanFieldGuide and IVONGuide on models ported from Pyro's examples, against AutoNormal.

Pyro's ``AutoNormal`` is the reference: the same Normal on every site's unconstrained
value, the same ``Delta`` with the log-Jacobian at the site. At equal parameters the two
guides give every draw the same log density (checked exactly on every ported model), so
their ELBOs are one function and its optimum is theirs; stochastic optimisation of both
lands on it within its noise (checked on a constrained and an annealed model). A model
whose posterior is Gaussian in the unconstrained space gives closed forms for the
optimum of both guides.
"""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Predictive, Trace_ELBO, TraceMeanField_ELBO
from pyro.infer.autoguide import AutoDiagonalNormal, AutoNormal, init_to_mean, init_to_sample
from pyro_models import MODELS

from pyro_bdl.inference import IVONSVI, IVONGuide, MeanFieldGuide, fit_ivon
from pyro_bdl.inference.minibatch import Minibatches

F64 = {"dtype": torch.float64}

# Models that observe their data without a plate: IVON needs N from the caller.
NUM_DATA = {"coin": 10, "scale": 1, "annealed_scale": 1}


pytestmark = pytest.mark.usefixtures("float64")


@pytest.fixture(autouse=True)
def _unplated_batch_latents():
    # Pyro's eight schools example samples a batch of 8 outside any plate, which the
    # shape check of Pyro's ELBOs refuses; the example ran before that check existed.
    with pyro.validation_enabled(False):
        yield


def _data(name):
    model, args, kwargs = MODELS[name].make()
    return model, Minibatches(args, kwargs)


@pytest.mark.parametrize("name", list(MODELS))
def test_the_guide_density_is_autonormals_at_equal_parameters(name):
    model, batches = _data(name)
    args, kwargs = batches.next()
    pyro.set_rng_seed(0)
    reference = AutoNormal(model)
    reference(*args, **kwargs)
    with torch.no_grad():  # a non-trivial point: move every parameter
        for parameter in reference.parameters():
            parameter.add_(0.3 * torch.randn_like(parameter))
    ours = MeanFieldGuide(model)
    ours(*args, **kwargs)
    locs, raw_scales = ours.variational_parameters()
    with torch.no_grad():
        for site in ours.site_names:
            loc, scale = reference._get_loc_and_scale(site)
            locs[site].copy_(loc)
            raw_scales[site].copy_(scale.log())  # the "exp" parametrisation
    values = {site: torch.randn_like(locs[site]) for site in ours.site_names}
    # AutoNormal samples every site's z at "<site>_unconstrained"; ours real, unscaled
    # sites at the site itself.
    conditioned = {f"{site}_unconstrained": z for site, z in values.items()}
    trace = pyro.poutine.trace(pyro.poutine.condition(reference, conditioned))
    expected = trace.get_trace(*args, **kwargs).log_prob_sum()
    ours_data = {
        (
            site
            if site in ours.site_names and site not in ours._auxiliary
            else f"{site}_unconstrained"
        ): z
        for site, z in values.items()
    }
    trace = pyro.poutine.trace(pyro.poutine.condition(ours, ours_data))
    torch.testing.assert_close(trace.get_trace(*args, **kwargs).log_prob_sum(), expected)
    medians = reference.median()
    for site, value in ours.median().items():
        torch.testing.assert_close(value, medians[site])


def _optimise(model, guide, args, elbo, steps=400, lr=0.05):
    """Adam with the learning rate decaying tenfold, the last fifth's iterates averaged:
    the median and one-sigma quantile of every site."""
    optimizer = pyro.optim.ClippedAdam({"lr": lr, "lrd": 0.01 ** (1 / steps)})
    svi = SVI(model, guide, optimizer, elbo)
    total, kept = None, 0
    for step in range(steps):
        svi.step(*args)
        if step >= steps * 4 // 5:
            point = {k: v.detach().clone() for k, v in guide.quantiles([0.5, 0.8413]).items()}
            total = point if total is None else {k: total[k] + v for k, v in point.items()}
            kept += 1
    return {k: v / kept for k, v in total.items()}


@pytest.mark.parametrize("name", ["coin", "annealed_scale"])
def test_the_optimum_is_autonormals(name):
    # Both guides start at the prior mean and run the same optimiser with 8 particles (a
    # Beta site through logit, a site annealed by poutine.scale). Over seeds 0-4 the two
    # guides' averages differ by up to 0.15 posterior standard deviations (the Monte Carlo
    # error of each, and Adam's own offset from the optimum, which both share): 0.25 sd.
    model, args, _ = MODELS[name].make()
    elbo = Trace_ELBO(num_particles=8, vectorize_particles=True, max_plate_nesting=0)
    pyro.set_rng_seed(0)
    expected = _optimise(model, AutoNormal(model, init_loc_fn=init_to_mean), args, elbo)
    pyro.set_rng_seed(1)
    ours = MeanFieldGuide(model, init_loc_fn=init_to_mean, init_scale=0.1)
    elbo = TraceMeanField_ELBO(num_particles=8, vectorize_particles=True, max_plate_nesting=0)
    found = _optimise(model, ours, args, elbo)
    for site, value in expected.items():
        sd = float(value[1] - value[0])
        torch.testing.assert_close(found[site], value, atol=0.25 * sd, rtol=0)


@pytest.mark.parametrize("guide_class", [MeanFieldGuide, IVONGuide])
def test_get_posterior_takes_the_models_arguments_and_packs_as_pyro(guide_class):
    # The flat vector of every site's unconstrained value, laid out as Pyro's
    # AutoContinuous guides lay it out (read back by AutoDiagonalNormal's own unpacking),
    # each site's part that site's Gaussian; a site's name alone still gives that site's.
    model, args, kwargs = MODELS["regression"].make(full_batch=True)
    pyro.set_rng_seed(0)
    ours = guide_class(model, init_loc_fn=init_to_sample)
    posterior = ours.get_posterior(*args, **kwargs)
    reference = AutoDiagonalNormal(model)
    reference(*args, **kwargs)
    assert posterior.event_shape == reference.get_posterior().event_shape
    z = posterior.sample((3,))
    log_density = 0.0
    for site, value in reference._unpack_latent(z):
        one = ours.get_posterior(site["name"])
        assert ours.get_posterior(name=site["name"]).event_shape == one.event_shape
        assert one.event_shape == value.shape[1:]
        log_density = log_density + one.log_prob(value)
    torch.testing.assert_close(posterior.log_prob(z), log_density)
    parts = dict((site["name"], value) for site, value in reference._unpack_latent(posterior.mean))
    for name, value in ours.median().items():
        transform = torch.distributions.biject_to(
            reference.prototype_trace.nodes[name]["fn"].support
        )
        torch.testing.assert_close(transform(parts[name]), value)


def _log_normal_model(replicas=1):
    """x ~ LogNormal(0.5, 0.8) and y_i ~ Normal(log x, 0.6): Gaussian in z = log x, with the
    posterior N(m, s^2) in closed form; ``replicas`` independent copies as a batch."""
    y = torch.tensor([0.9, 1.4, 0.3, 1.1, 0.8], **F64)

    def model():
        with pyro.plate("replicas", replicas, dim=-1):
            x = pyro.sample("x", dist.LogNormal(torch.tensor(0.5, **F64), 0.8))
            with pyro.plate("data", len(y), dim=-2):
                pyro.sample("y", dist.Normal(x.log(), 0.6), obs=y[:, None].expand(-1, replicas))

    precision = 1 / 0.8**2 + len(y) / 0.6**2
    mean = (0.5 / 0.8**2 + y.sum() / 0.6**2) / precision
    return model, float(mean), precision**-0.5


def _elbo_gradient(model, guide, elbo_class, num_particles=200_000):
    pyro.set_rng_seed(0)
    elbo = elbo_class(num_particles=num_particles, vectorize_particles=True, max_plate_nesting=2)
    loss = elbo.differentiable_loss(model, guide)
    return torch.autograd.grad(loss, list(guide.parameters()))


def test_the_mean_field_optimum_of_a_constrained_site_is_the_closed_form():
    # The optimum of a Normal over z = log x is the posterior of z itself. There the
    # gradient of the ELBO vanishes, under TraceMeanField_ELBO too (our Delta has no KL,
    # so the site is scored by Monte Carlo with its Jacobian); Pyro's AutoNormal under
    # TraceMeanField_ELBO is not at its optimum there, its Delta's KL dropping the
    # Jacobian log|dx/dz| = z, whose gradient in the mean is 1. Tolerance: 5 Monte Carlo
    # standard errors of the mean's gradient, precision * sd / sqrt(particles) < 0.002.
    model, mean, sd = _log_normal_model()
    ours = MeanFieldGuide(model)
    ours()
    locs, raw_scales = ours.variational_parameters()
    with torch.no_grad():
        locs["x"].fill_(mean)
        raw_scales["x"].fill_(math.log(sd))
    for elbo_class in (Trace_ELBO, TraceMeanField_ELBO):
        loc_grad, scale_grad = _elbo_gradient(model, ours, elbo_class)
        assert float(loc_grad.abs().max()) < 0.01 and float(scale_grad.abs().max()) < 0.01
    reference = AutoNormal(model)
    reference()
    with torch.no_grad():
        reference.locs.x.fill_(mean)
        reference.scales.x_unconstrained.fill_(math.log(math.expm1(sd)))  # softplus
    loc_grad, _ = _elbo_gradient(model, reference, Trace_ELBO)
    assert float(loc_grad.abs().max()) < 0.01
    loc_grad, _ = _elbo_gradient(model, reference, TraceMeanField_ELBO)
    torch.testing.assert_close(loc_grad, torch.ones_like(loc_grad), atol=0.01, rtol=0)


def test_the_first_reproducer_of_the_issue_a_scalar_latent():
    def model(y):
        mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0), 1.0))
        with pyro.plate("data", len(y)):
            pyro.sample("obs", dist.Normal(mu, 1.0), obs=y)

    y = torch.randn(20, generator=torch.Generator().manual_seed(0))
    guide = MeanFieldGuide(model)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.01}), TraceMeanField_ELBO())
    assert math.isfinite(svi.step(y))
    assert guide.median()["mu"].shape == ()


@pytest.mark.parametrize("name", list(MODELS))
def test_mean_field_and_ivon_run_on_every_model(name):
    model, batches = _data(name)
    pyro.set_rng_seed(0)
    guide = MeanFieldGuide(model)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.01}), TraceMeanField_ELBO())
    for _ in range(20):
        args, kwargs = batches.next()
        assert math.isfinite(svi.step(*args, **kwargs))
    ivon = IVONGuide(model, num_data=NUM_DATA.get(name))
    args, kwargs = batches.next()
    history = fit_ivon(model, ivon, *args, num_steps=20, lr=0.01, progress=False, **kwargs)
    assert all(math.isfinite(loss) for loss in history["loss"])
    for fitted in (guide, ivon):
        draws = Predictive(model, guide=fitted, num_samples=5)(*args, **kwargs)
        for site, value in fitted.median().items():
            support = fitted.sites[site].message["fn"].support
            assert bool(support.check(value).all()) and bool(support.check(draws[site]).all())


def test_ivon_on_a_constrained_site_with_a_prior_that_is_not_normal():
    # IVON's fixed point is the mean-field optimum: here the exact posterior of z = log x.
    # The LogNormal prior is not IVON's weight decay (delta = 0): its log density and the
    # Jacobian join the loss, and h estimates their curvature with the likelihood's.
    # Tolerance as in test_ivon.py: 200 replicas, the last 1000 of 2000 steps averaged,
    # within 4 standard errors from the replicas' spread and 2% for the variance.
    replicas = 200
    model, mean, sd = _log_normal_model(replicas)
    pyro.set_rng_seed(0)
    guide = IVONGuide(model, hess_init=1.0)
    svi = IVONSVI(model, guide, lr=0.1, beta2=0.995)
    loc_sum = hess_sum = 0.0
    for step in range(2000):
        svi.step()
        if step >= 1000:
            loc_sum = loc_sum + guide.loc.detach()
            hess_sum = hess_sum + guide.hess.detach()
    loc, hess = loc_sum / 1000, hess_sum / 1000
    assert guide.closed_form_priors == set() and float(guide.weight_decay["x"].abs().max()) == 0
    assert abs(loc.mean() - mean) < 4 * loc.std() / replicas**0.5
    variance = 1 / (guide.ess * hess.mean())
    torch.testing.assert_close(variance, torch.tensor(sd**2, **F64), rtol=0.02, atol=0)
