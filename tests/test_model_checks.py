"""Every method checks the model it traces (pyro_bdl/model_checks.py), once, at set-up.

The mistakes of issue 35, reproduced first: labels of shape (N, 1) observed inside
``pyro.plate("data", N)`` against a distribution of batch shape (N,) (an (N, N) log
likelihood: before, Laplace, IVON and SGHMC fitted it silently, the weights near the
prior), and a forgotten ``obs=`` (before, four methods behaved four ways). Every method
now raises the same :class:`SiteShapeError` for the first and gives the same
:class:`ObservedLookingLatentWarning` for the second, before any step.
"""

import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from peft import LoraConfig, get_peft_model
from pyro.infer import MCMC, SVI, Trace_ELBO, TraceMeanField_ELBO

import pyro_bdl as bdl
from pyro_bdl.inference import (
    SGHMC,
    SGLD,
    SGNHT,
    BLoBGuide,
    Chains,
    IVONGuide,
    KronLowRank,
    LaplaceGuide,
    MeanFieldGuide,
    baselines,
    fit_blob,
    fit_ivon,
    fit_map,
)
from pyro_bdl.model_checks import (
    ObservedLookingLatentWarning,
    SiteShapeError,
    check_model,
    check_site_shapes,
)
from pyro_bdl.predict import predict_proba

NUM_DATA = 12


@pytest.fixture(autouse=True)
def _float64(float64):
    pass


def lora_net():
    """A lifted peft LoRA on one Linear(4 -> 3): A random, B a point weight (BLoB's layout,
    which every method takes)."""
    torch.manual_seed(0)
    peft_model = get_peft_model(
        torch.nn.Sequential(torch.nn.Linear(4, 3)),
        LoraConfig(r=2, lora_alpha=4, target_modules=["0"]),
    ).double()
    return bdl.lift(peft_model, bdl.priors.IIDNormal(0.5), random="lora_A", point="lora_B")


def plated_classifier(observe: bool = True):
    """A classifier observed with ``pyro.sample`` in ``pyro.plate("data", N)`` (or, with
    ``observe=False``, the same with ``obs=`` forgotten)."""
    net = lora_net()

    def model(x, y=None):
        logits = net(x)
        with pyro.plate("data", len(x)):
            pyro.sample("y", dist.Categorical(logits=logits), obs=y if observe else None)
        return logits

    model.net = net  # the baselines find the lifted network here
    return model


def data():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(NUM_DATA, 4, generator=generator)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()


def _laplace(curvature):
    def fit(model, x, y):
        LaplaceGuide(model, curvature).fit(x, y, num_steps=5, max_passes=2, progress=False)

    return fit


def _mean_field(model, x, y):
    svi = SVI(model, MeanFieldGuide(model), pyro.optim.Adam({"lr": 0.01}), TraceMeanField_ELBO())
    svi.step(x, y)


def _kernel(kernel):
    def fit(model, x, y):
        MCMC(kernel(model, step_size=1e-3), 2, 2, disable_progbar=True).run(x, y)

    return fit


def _chains(model, x, y):
    Chains(SGHMC(model, step_size=1e-3), 2, 2, num_chains=2, disable_progbar=True).run(x, y)


def _baseline(method, **options):
    def fit(model, x, y):
        method(model, x, y, num_steps=2, progress=False, **options)

    return fit


# Every method that traces a model, each called as a user calls it.
METHODS = {
    **{f"LaplaceGuide({c})": _laplace(c) for c in ("diag_ggn", "diag_ef", "kron", "full")},
    "LaplaceGuide(kron_lowrank)": _laplace(KronLowRank(rank=2)),
    "MeanFieldGuide": _mean_field,
    "fit_blob": lambda m, x, y: fit_blob(m, BLoBGuide(m), x, y, num_steps=2, progress=False),
    "fit_ivon": lambda m, x, y: fit_ivon(m, IVONGuide(m), x, y, num_steps=2, progress=False),
    "fit_map": lambda m, x, y: fit_map(m, x, y, num_steps=2, progress=False),
    "baselines.map_estimate": _baseline(baselines.map_estimate),
    "baselines.deep_ensemble": _baseline(baselines.deep_ensemble, num_members=2),
    "baselines.bbb": _baseline(baselines.bbb),
    "SGLD": _kernel(SGLD),
    "SGHMC": _kernel(SGHMC),
    "SGNHT": _kernel(SGNHT),
    "Chains": _chains,
}


@pytest.mark.parametrize("method", list(METHODS))
def test_labels_of_shape_n_1_in_a_data_plate_are_a_named_error(method):
    """Before: LaplaceGuide(full), fit_ivon and SGHMC fitted the (N, N) likelihood without
    a word; now every method names the site, both shapes, the plate and the fix."""
    x, y = data()
    with pytest.raises(SiteShapeError) as error:
        METHODS[method](plated_classifier(), x, y.unsqueeze(-1))
    message = str(error.value)
    assert "'y' has a log density of shape (12, 12)" in message
    assert "'data' of size 12 at dim -1" in message and "give it (12,)" in message
    assert "value of shape (12, 1)" in message and "obs=y.squeeze(-1)" in message
    if error.value.site is not None:  # None where Pyro's trace re-raised it, message kept
        assert error.value.site == "y" and error.value.log_prob_shape == (12, 12)


@pytest.mark.parametrize("method", list(METHODS))
def test_a_forgotten_obs_is_named_by_every_method(method):
    """Before: a warning from SGHMC, silence from MeanFieldGuide, a 'not positive
    definite' error from Laplace, 'pass num_data=N' from IVON. Now one warning first,
    naming the site and the argument it looks like (the fit may then fail its own way)."""
    x, y = data()
    with pytest.warns(ObservedLookingLatentWarning) as caught:
        try:
            METHODS[method](plated_classifier(observe=False), x, y)
        except (ValueError, RuntimeError, NotImplementedError):
            pass  # what the method makes of a model without data; the warning came first
    message = str(caught[0].message)
    assert "latent site 'y' sits in the plate 'data' of size 12" in message
    assert "args[1]" in message and "obs=" in message


def test_a_latent_per_example_beside_its_observation_is_not_mistaken_for_data():
    """A local latent in the data plate, shaped like the data, with the data observed in
    the same plate (a per-example noise scale): meant, so no warning."""
    x, y = data()
    y = y.double()

    def model(x, y):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([4]).to_event(1))
        with pyro.plate("data", len(x)):
            scale = pyro.sample("scale", dist.LogNormal(0.0, 1.0))
            pyro.sample("y", dist.Normal(x @ w, scale), obs=y)

    trace = pyro.poutine.trace(model).get_trace(x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_model(trace, (x, y), {}, "test")


def test_bdl_observe_without_obs_in_a_fit_warns():
    x, y = data()
    net = lora_net()

    def model(x, labels):
        bdl.observe("y", dist.Categorical(logits=net(x)), None, NUM_DATA)

    with pytest.warns(ObservedLookingLatentWarning, match="made by bdl.observe without obs"):
        trace = pyro.poutine.trace(model).get_trace(x, y)
        check_model(trace, (x, y), {}, "test")


def _trace(model, *args):
    with torch.no_grad():
        return pyro.poutine.trace(model).get_trace(*args)


def test_a_grid_outside_every_plate_is_refused_too():
    """Without a plate Pyro's NUTS and Trace_ELBO's guessed nesting accept the grid; ours not."""
    x, y = data()
    y = y.double()

    def model(x, y):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([4]).to_event(1))
        pyro.sample("y", dist.Normal(x @ w, 1.0), obs=y)

    check_site_shapes(_trace(model, x, y), "test")  # y of shape (N,): fine
    with pytest.raises(SiteShapeError, match=r"but no plate: its value of shape \(12, 1\)"):
        check_site_shapes(_trace(model, x, y.unsqueeze(-1)), "test")


def test_what_nuts_accepts_outside_plates_is_accepted():
    """Batch dimensions of a site in no plate are summed, as NUTS sums them: Pyro's eight
    schools (eta a batch of 8, no plate) and a batch of observations without a plate."""

    def schools(sigma, y):
        eta = pyro.sample("eta", dist.Normal(torch.zeros(8), 1.0))
        tau = pyro.sample("tau", dist.HalfCauchy(5.0))
        pyro.sample("obs", dist.Normal(tau * eta, sigma), obs=y)

    def coin(tosses):
        f = pyro.sample("f", dist.Beta(2.0, 2.0))
        pyro.sample("obs", dist.Bernoulli(f), obs=tosses)

    check_site_shapes(_trace(schools, torch.ones(8), torch.zeros(8)), "test")
    check_site_shapes(_trace(coin, torch.tensor([1.0, 0.0, 1.0])), "test")


def test_a_dimension_left_of_the_plates_is_refused_as_trace_elbo_refuses_it():
    """A latent with a batch dimension left of its plate: Trace_ELBO refuses it; so do we,
    with Pyro's own words appended."""

    def model(x):
        with pyro.plate("data", len(x)):
            pyro.sample("z", dist.Normal(torch.zeros(3, len(x)), 1.0))

    x, _ = data()
    with pytest.raises(SiteShapeError, match='Pyro\'s check_site_shape: at site "z"'):
        check_site_shapes(_trace(model, x), "test")
    with pytest.raises(ValueError, match="invalid log_prob shape"):  # Pyro's, the same model
        guide = pyro.infer.autoguide.AutoNormal(model)
        SVI(model, guide, pyro.optim.Adam({}), Trace_ELBO()).step(x)


def test_predict_proba_checks_the_first_draw():
    """The predictive path: a grid is refused; a guide that misses a latent site of the
    model (its draws from the prior) warns; the guide's own model predicts quietly."""
    x, y = data()
    model = plated_classifier()
    net = model.net
    point = {name: value.detach()[None] for name, value in net.init_values().items()}
    with pytest.raises(SiteShapeError, match="predict_proba: the observed site 'y'"):
        predict_proba(model, x, y.unsqueeze(-1), samples=point)
    guide = MeanFieldGuide(model)
    _mean_field_steps(model, guide, x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        probs = predict_proba(model, x, None, guide=guide, num_samples=2)
    assert probs.shape == (2, NUM_DATA, 3)

    def wider(x, y=None):
        pyro.sample("extra", dist.Normal(0.0, 1.0))
        return model(x, y)

    with pytest.warns(
        UserWarning, match=r"does not sample the model's latent site\(s\) \['extra'\]"
    ):
        predict_proba(wider, x, None, guide=guide, num_samples=2)


def _mean_field_steps(model, guide, x, y):
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.01}), TraceMeanField_ELBO())
    svi.step(x, y)


def test_the_rows_of_issue_35_are_named_errors():
    """The issue's own model: y of shape (N, 1), w ~ Normal, sigma ~ HalfNormal, a data
    plate. Before: LaplaceGuide(full) gave median w all 0.000 and sigma 1.0, fit_ivon wrong
    weights, SGHMC only convergence warnings; now each raises before its first step."""
    x, _ = data()
    y = (x @ torch.tensor([1.0, -2.0, 0.5, 0.0]) + 0.5).unsqueeze(-1)

    def model(x, y=None):
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([4]).to_event(1))
        sigma = pyro.sample("sigma", dist.HalfNormal(1.0))
        with pyro.plate("data", len(x)):
            pyro.sample("y", dist.Normal(x @ w, sigma), obs=y)

    fits = [
        lambda: LaplaceGuide(model, curvature="full").fit(x, y, progress=False),
        lambda: fit_ivon(model, IVONGuide(model), x, y, num_steps=2, progress=False),
        lambda: MCMC(SGHMC(model, step_size=1e-3), 2, 2, disable_progbar=True).run(x, y),
    ]
    for fit in fits:
        with pytest.raises(SiteShapeError, match=r"obs=y.squeeze\(-1\)"):
            fit()
