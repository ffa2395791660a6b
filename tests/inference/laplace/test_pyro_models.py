"""LaplaceGuide on models ported from Pyro's examples, against AutoLaplaceApproximation.

``curvature="full"`` must find the mode and covariance that Pyro's own
``AutoLaplaceApproximation`` finds (the mode of the log joint with the log-Jacobian in
the unconstrained space, and the inverse of its negative Hessian there), to 1e-4 in
float64, on every ported model that has a mode, whatever its idioms (constrained sites,
subsample plates, ``pyro.condition``, ``pyro.deterministic``, ``poutine.scale``, several
likelihood terms, DataLoaders). Where the model's structure allows the GGN curvatures
they are checked against closed forms; where it does not, they refuse by name.
"""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import Predictive, Trace_ELBO
from pyro.infer.autoguide import AutoLaplaceApproximation
from pyro_models import LAPLACE_MODELS, MODELS

import pyro_bdl as bdl
from pyro_bdl.inference import KronLowRank, LaplaceGuide
from pyro_bdl.inference.laplace.observation import StructureError

# Our fit stops at a Newton decrement of 3e-5 (posterior standard deviations); the
# reference's L-BFGS at a gradient of 1e-11: both modes are far inside 1e-4.
TOLERANCE = {"atol": 1e-4, "rtol": 1e-4}


def _fit(model, args, kwargs, curvature="full", **options):
    guide = LaplaceGuide(model, curvature)
    options = {"num_steps": 0, "mode_tolerance": 3e-5, **options}
    return guide.fit(*args, progress=False, **options, **kwargs)


def _auto_laplace(model, args, kwargs):
    """Pyro's AutoLaplaceApproximation, its MAP found by L-BFGS on Pyro's own loss."""
    guide = AutoLaplaceApproximation(model)
    # The plates' depth given: the eight schools example has a batch latent outside any
    # plate, which the shape check of Trace_ELBO's guess refuses (NUTS, its original
    # use, does not).
    trace = pyro.poutine.trace(model).get_trace(*args, **kwargs)
    frames = [f for site in trace.nodes.values() for f in site.get("cond_indep_stack", ())]
    elbo = Trace_ELBO(max_plate_nesting=max([-f.dim for f in frames], default=0))
    guide(*args, **kwargs)
    lbfgs = torch.optim.LBFGS(
        [guide.loc],
        max_iter=1000,
        tolerance_grad=1e-11,
        tolerance_change=0,
        history_size=50,
        line_search_fn="strong_wolfe",
    )

    def closure():
        lbfgs.zero_grad()
        loss = elbo.differentiable_loss(model, guide, *args, **kwargs)
        loss.backward()
        return loss

    lbfgs.step(closure)
    gaussian = guide.laplace_approximation(*args, **kwargs)
    scale, tril = gaussian.scale, gaussian.scale_tril
    return guide.loc.detach(), scale[:, None] * (tril @ tril.T) * scale[None, :]


def _covariance(guide, helpers):
    (block,) = guide.laplace_fit.blocks
    return torch.linalg.inv(helpers.dense_precision(block, guide.laplace_fit.prior_precision))


@pytest.mark.parametrize("name", LAPLACE_MODELS)
def test_full_matches_auto_laplace_approximation(name, helpers):
    entry = MODELS[name]
    pyro.set_rng_seed(0)
    guide = _fit(*entry.make())
    loc, covariance = _auto_laplace(*entry.make(full_batch=True))
    torch.testing.assert_close(guide.sites.pack(guide.laplace_fit.loc), loc, **TOLERANCE)
    torch.testing.assert_close(_covariance(guide, helpers), covariance, **TOLERANCE)
    if entry.exact is not None:  # and both equal the closed form
        mean, exact = entry.exact()
        torch.testing.assert_close(loc, mean, **TOLERANCE)
        torch.testing.assert_close(covariance, exact, **TOLERANCE)


@pytest.mark.parametrize("name", ["regression", "counts_deterministic"])
def test_get_posterior_is_auto_laplace_approximations(name):
    # Constrained sites, a hierarchical prior: the exact Hessian's Gaussian over the flat
    # unconstrained vector, packed as Pyro packs it (AutoMultivariateNormal.get_posterior).
    entry = MODELS[name]
    pyro.set_rng_seed(0)
    posterior = _fit(*entry.make()).get_posterior()
    loc, covariance = _auto_laplace(*entry.make(full_batch=True))
    assert isinstance(posterior, dist.MultivariateNormal)
    torch.testing.assert_close(posterior.loc, loc, **TOLERANCE)
    torch.testing.assert_close(posterior.covariance_matrix, covariance, **TOLERANCE)


@pytest.mark.parametrize("curvature", ["diag_ggn", "kron", KronLowRank(rank=2), "full"], ids=str)
@pytest.mark.parametrize("name", ["scale", "annealed_scale"])
def test_every_curvature_that_applies_is_the_closed_form(name, curvature, helpers):
    # One Normal measurement of a 0-d weight with a Normal prior, annealed by poutine.scale
    # in one: the GGN is the Hessian, every structure of one entry is exact.
    model, args, kwargs = MODELS[name].make()
    guide = _fit(model, args, kwargs, curvature)
    assert guide.exact_hessian_reason is None  # the GGN path, not the exact Hessian
    mean, variance = MODELS[name].exact()
    torch.testing.assert_close(guide.median()["weight"].reshape(1), mean, **TOLERANCE)
    torch.testing.assert_close(guide.variance()["weight"].reshape(1, 1), variance, **TOLERANCE)


def test_the_structured_curvatures_on_a_subsampled_logistic_regression(helpers):
    # The plate's own indices define the examples: the curvature pass enumerates them in
    # chunks of 50 (the last repeating 20, masked), and the data sit behind x[ind].
    model, args, kwargs = MODELS["logistic_subsample"].make()
    full = _fit(model, args, kwargs)
    assert full.exact_hessian_reason is None and full.num_data == 230
    precision = helpers.dense_precision(
        full.laplace_fit.blocks[0], full.laplace_fit.prior_precision
    )
    x, y = args
    mode = full.median()
    diagonal = LaplaceGuide(model, "diag_ggn").fit(*args, map=mode, progress=False, **kwargs)
    for site, value in diagonal.variance().items():
        start = 0 if site == "w" else 3
        expected = precision.diagonal()[start : start + value.numel()].reciprocal()
        torch.testing.assert_close(value.reshape(-1), expected)
    # The GGN of a Bernoulli with logits x w + b is sum_i p_i (1 - p_i) [x_i 1][x_i 1]^T.
    features = torch.cat([x, torch.ones(len(x), 1)], 1)
    probs = torch.sigmoid(features @ torch.cat([mode["w"], mode["b"].reshape(1)]))
    ggn = features.T @ (features * (probs * (1 - probs))[:, None]) + torch.eye(4)
    torch.testing.assert_close(precision, ggn)


def test_a_real_prior_that_is_not_normal_adds_its_own_curvature(helpers):
    # The logistic regression with Logistic priors (an exact reparametrisation of nothing
    # Gaussian): the GGN path takes the prior's curvature by autodiff, and "full" still
    # equals AutoLaplaceApproximation; K-FAC, one precision per layer, refuses by name.
    def model(x, y):
        w = pyro.sample("w", dist.Logistic(x.new_zeros(3), 0.5).to_event(1))
        b = pyro.sample("b", dist.Logistic(x.new_tensor(0.0), 0.5))
        with pyro.plate("data", len(x)):
            pyro.sample("obs", dist.Bernoulli(logits=x @ w + b), obs=y)

    _, (x, y), _ = MODELS["logistic_subsample"].make(full_batch=True)
    guide = _fit(model, (x, y), {})
    assert guide.exact_hessian_reason is None and set(guide.prior_precision) == set()
    loc, covariance = _auto_laplace(model, (x, y), {})
    torch.testing.assert_close(guide.sites.pack(guide.laplace_fit.loc), loc, **TOLERANCE)
    torch.testing.assert_close(_covariance(guide, helpers), covariance, **TOLERANCE)
    net = bdl.lift(torch.nn.Linear(3, 1).double(), prior=_LogisticPrior())

    def lifted(x, y):
        logits = net(x).squeeze(-1)
        with pyro.plate("data", len(x)):
            pyro.sample("obs", dist.Bernoulli(logits=logits), obs=y)

    with pytest.raises(ValueError, match="'weight' is a Logistic, not a Normal.*diag_ggn"):
        LaplaceGuide(lifted, "kron").fit(x, y, map=False, progress=False)


class _LogisticPrior:
    def distribution(self, name, param):
        return dist.Logistic(torch.zeros_like(param), 0.5).to_event(param.dim())


def test_several_likelihood_terms_and_the_evidence_of_the_exact_hessian():
    # w ~ N(0, I), y1 ~ N(x w, 0.5^2) and y2 ~ N(w_0, 1) as two observed sites: a linear
    # Gaussian model, so the exact-Hessian Laplace is the posterior and its evidence exact.
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(20, 2, generator=generator)
    y1 = x @ torch.tensor([0.5, -1.0]) + 0.5 * torch.randn(20, generator=generator)
    y2 = torch.tensor(0.8)

    def model():
        w = pyro.sample("w", dist.Normal(torch.zeros(2), 1.0).to_event(1))
        with pyro.plate("data", 20):
            pyro.sample("y1", dist.Normal(x @ w, 0.5), obs=y1)
        pyro.sample("y2", dist.Normal(w[0], 1.0), obs=y2)

    with pytest.raises(StructureError, match="exactly one observed site.*'y1', 'y2'"):
        LaplaceGuide(model, "diag_ggn").fit(progress=False)
    guide = _fit(model, (), {})
    assert "exactly one observed site" in guide.exact_hessian_reason
    design = torch.cat([x, torch.tensor([[1.0, 0.0]])])
    noise = torch.diag(torch.cat([torch.full((20,), 0.25), torch.ones(1)]))
    targets = torch.cat([y1, y2.reshape(1)])
    precision = torch.eye(2) + design.T @ torch.linalg.solve(noise, design)
    mean = torch.linalg.solve(precision, design.T @ torch.linalg.solve(noise, targets))
    torch.testing.assert_close(guide.median()["w"], mean)
    torch.testing.assert_close(guide.laplace_fit.blocks[0].curvature, precision)
    evidence = dist.MultivariateNormal(torch.zeros(21), noise + design @ design.T)
    torch.testing.assert_close(guide.log_marginal_likelihood(), evidence.log_prob(targets))


@pytest.mark.parametrize("name", LAPLACE_MODELS)
def test_draws_medians_and_quantiles_are_in_the_support(name):
    entry = MODELS[name]
    pyro.set_rng_seed(0)
    model, args, kwargs = entry.make()
    guide = _fit(model, args, kwargs, num_steps=100, mode_tolerance=0.1)
    medians = guide.median()
    draws = guide.sample_posterior(200, torch.Generator().manual_seed(0))
    quantiles = guide.quantiles([0.05, 0.5, 0.95])
    for site_name, site in guide.sites.items():
        support = site.message["fn"].support
        assert bool(support.check(medians[site_name]).all())
        assert bool(support.check(draws[site_name]).all())
        assert draws[site_name].shape == (200, *site.shape)
        low, middle, high = quantiles[site_name]
        torch.testing.assert_close(middle, medians[site_name])  # a monotone transform
        assert bool((low <= middle).all() and (middle <= high).all())
    # the full-batch model: a DataLoader is the data of a fit, not of a prediction
    full_model, full_args, full_kwargs = entry.make(full_batch=True)
    predictive = Predictive(full_model, guide=guide, num_samples=3)(*full_args, **full_kwargs)
    assert all(bool(torch.isfinite(v.double()).all()) for v in predictive.values())


def test_a_draw_has_the_density_of_the_transformed_gaussian(helpers):
    # q(x) = N(z; z*, P^-1) |dz/dx| at x = T(z): the guide trace's log density of a draw of
    # the Beta coin (logit transform) against the closed form.
    model, args, kwargs = MODELS["coin"].make()
    guide = _fit(model, args, kwargs)
    trace = pyro.poutine.trace(guide).get_trace(*args, **kwargs)
    f = trace.nodes["latent_fairness"]["value"]
    z = torch.logit(f)
    mean, variance = MODELS["coin"].exact()
    expected = dist.Normal(mean, variance.sqrt()).log_prob(z) - torch.log(f * (1 - f))
    torch.testing.assert_close(trace.log_prob_sum(), expected.sum(), **TOLERANCE)


def test_what_needs_the_ggn_structure_refuses_an_exact_hessian_fit_by_name():
    model, args, kwargs = MODELS["regression"].make()
    for curvature in ("kron", "diag_ggn", "diag_ef", "kron_lowrank"):
        with pytest.raises(StructureError, match="'sigma' has the constrained support"):
            LaplaceGuide(model, curvature).fit(*args, map=False, progress=False)
    with pytest.raises(ValueError, match="prior_precision: the site 'sigma'.*in the model"):
        LaplaceGuide(model, "full", prior_precision=2.0).fit(*args, map=False, progress=False)
    guide = LaplaceGuide(model, "full").fit(*args, num_steps=200, progress=False)
    assert guide.prior_precision == {}
    with pytest.raises(ValueError, match="no prior precision to tune"):
        guide.optimize_prior_precision()
    with pytest.raises(ValueError, match="linearised .GLM. predictive needs the GGN structure"):
        guide.predictive(*args)
    with pytest.raises(ValueError, match="as_prior .* needs the GGN structure"):
        guide.as_prior()
    settings = guide.hyperparameters()
    assert settings["fisher"] == "hessian" and math.isfinite(settings["log_marginal_likelihood"])
    bdl.to_arviz(guide, num_samples=4, model_args=args)


def test_a_point_that_is_no_mode_has_no_laplace_approximation():
    # Two measurements of x^2 = 1: x = 0 is a minimum of the log joint, not a mode.
    def model():
        x = pyro.sample("x", dist.Normal(torch.tensor(0.0), 1.0))
        for name in ("y1", "y2"):
            pyro.sample(name, dist.Normal(x**2, 0.1), obs=torch.tensor(1.0))

    with pytest.raises(ValueError, match="not positive definite .smallest eigenvalue -399"):
        LaplaceGuide(model, "full").fit(map=False, progress=False)


@pytest.mark.parametrize("curvature", ["diag_ggn", "full"])
def test_a_latent_in_a_plate_of_constant_size(curvature, helpers):
    # w ~ N(0, 1) in a plate of 3 (a vector of weights declared per plate entry), y ~
    # N(x w, 0.5^2): the GGN path, with the guide sampling w inside the same plate.
    problem = helpers.LinearGaussian(alpha=1.0, sigma=0.5)

    def model(x, y):
        with pyro.plate("features", 3):
            w = pyro.sample("w", dist.Normal(0.0, 1.0))
        with pyro.plate("data", len(x)):
            pyro.sample("y", dist.Normal(x @ w, 0.5), obs=y)

    guide = _fit(model, (problem.x, problem.y), {}, curvature)
    assert guide.exact_hessian_reason is None
    torch.testing.assert_close(guide.median()["w"], problem.mean, **TOLERANCE)
    expected = problem.covariance if curvature == "full" else problem.precision.diagonal() ** -1
    covariance = _covariance(guide, helpers)
    torch.testing.assert_close(
        covariance if curvature == "full" else covariance.diagonal(), expected
    )
    trace = pyro.poutine.trace(guide).get_trace(problem.x, problem.y)
    assert trace.nodes["w"]["cond_indep_stack"][0].name == "features"


@pytest.mark.parametrize("name", ["coin", "logistic_subsample"])
def test_the_new_fits_survive_save_and_load(name, tmp_path):
    # An exact-Hessian fit of a constrained site, and a GGN fit of a subsampled model:
    # bdl.load rebuilds the sites from the model and restores the Gaussian.
    model, args, kwargs = MODELS[name].make()
    guide = _fit(model, args, kwargs)
    bdl.save(guide, tmp_path / "posterior")
    loaded = bdl.load(tmp_path / "posterior", model, model_args=args, model_kwargs=kwargs)
    assert loaded.exact_hessian_reason == guide.exact_hessian_reason
    for site, value in guide.median().items():
        torch.testing.assert_close(loaded.median()[site], value)
    for site, value in guide.variance().items():
        torch.testing.assert_close(loaded.variance()[site], value)
    torch.testing.assert_close(loaded.log_marginal_likelihood(), guide.log_marginal_likelihood())


def test_a_deterministic_site_is_not_a_likelihood(helpers):
    # The third reproducer: pyro.deterministic was counted as an observed site.
    problem = helpers.LinearGaussian(alpha=1.0, sigma=0.5)

    def model(x, y):
        w = pyro.sample("w", dist.Normal(torch.zeros(3), 1.0).to_event(1))
        mean = pyro.deterministic("mean", x @ w)
        with pyro.plate("data", len(x)):
            pyro.sample("y", dist.Normal(mean, 0.5), obs=y)

    for curvature in ("kron", "full"):  # K-FAC: a vector used by x @ w is diagonal
        guide = _fit(model, (problem.x, problem.y), {}, curvature)
        assert guide.exact_hessian_reason is None
        torch.testing.assert_close(guide.median()["w"], problem.mean, **TOLERANCE)
    torch.testing.assert_close(_covariance(guide, helpers), problem.covariance)
