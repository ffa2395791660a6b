"""A diverging chain stops at the step it happens, says what was non-finite, and keeps
its draws; labels outside the likelihood's support are a named error under MCMC too."""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import MCMC
from pyro.infer.autoguide.initialization import init_to_mean
from torch.utils.data import DataLoader, TensorDataset

import pyro_bdl as bdl
from pyro_bdl.inference import SGHMC, SGLD, DivergenceError
from pyro_bdl.likelihoods import ObservationError

NUM_DATA, BATCH = 24, 6


def _data(bad_row=None, value=math.nan):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(NUM_DATA, 3, generator=generator, dtype=torch.float64)
    y = x @ torch.tensor([1.0, -1.0, 0.5], dtype=torch.float64)
    if bad_row is not None:
        x[bad_row, 1] = value
    return x, y


def _loader(x, y):
    return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)


def _model(noise=0.5, prior_scale=None):
    torch.manual_seed(0)
    net = bdl.lift(torch.nn.Linear(3, 1).double(), bdl.priors.IIDNormal(1.0))

    def model(batch, num_data):
        x, y = batch
        if prior_scale is not None:
            pyro.sample("extra", dist.Normal(torch.tensor(0.0).double(), prior_scale))
        bdl.observe("y", dist.Normal(net(x).squeeze(-1), noise), y, num_data)

    return model


def _diverge(kernel, x, y, warmup_steps=2, num_samples=40, data=None):
    mcmc = MCMC(kernel, num_samples=num_samples, warmup_steps=warmup_steps, disable_progbar=True)
    with pytest.raises(DivergenceError) as error:
        mcmc.run(*((_loader(x, y), NUM_DATA) if data is None else data))
    return error.value


def test_nan_in_the_data_is_named_at_its_step_with_the_draws_kept():
    # Row 20 is in the fourth batch; steps cycle through 4 batches: steps 3, 7, 11, ...
    x, y = _data(bad_row=20)
    kernel = SGLD(_model(), step_size=1e-3)
    error = _diverge(kernel, x, y)
    assert error.step == 3
    assert "the data of that step is non-finite (argument 0[0]: 1 of 18 values)" in str(error)
    assert "step_size" not in error.cause
    assert len(error.draws["weight"]) == 1 and torch.isfinite(error.draws["weight"]).all()


def test_an_infinite_likelihood_hyperparameter_is_named():
    x, y = _data()
    error = _diverge(SGLD(_model(noise=torch.tensor(math.inf)), step_size=1e-3), x, y)
    assert error.step == 0
    assert "likelihood of the observed site 'y'" in error.cause
    assert "Normal.scale (6 of 6 entries non-finite, e.g. inf)" in error.cause
    assert "step_size" not in error.cause


def test_an_infinite_prior_scale_is_named():
    x, y = _data()
    error = _diverge(SGLD(_model(prior_scale=torch.tensor(math.inf)), step_size=1e-3), x, y)
    assert error.step == 0
    assert (
        "the prior of site 'extra'" in error.cause
        and "Normal.scale (1 of 1 entries non-finite, e.g. inf)" in error.cause
    )


def test_a_nan_gradient_at_finite_values_is_named():
    x, y = _data()

    def model(batch, num_data):
        w = pyro.sample("w", dist.Normal(torch.zeros(3, dtype=torch.float64), 1.0).to_event(1))
        x, y = batch
        # |w|: finite value, but sqrt's gradient at 0 is inf, and 0 * inf is NaN.
        mean = x @ w + 0.0 * torch.sqrt(torch.zeros((), dtype=torch.float64) * w.sum())
        bdl.observe("y", dist.Normal(mean, 0.5), y, num_data)

    error = _diverge(SGLD(model, step_size=1e-3, init_params={"w": torch.ones(3)}), x, y)
    assert error.step == 1
    assert "the gradient of the log joint on that step's batch is non-finite" in error.cause


def test_a_step_size_too_large_says_so():
    x, y = _data()
    error = _diverge(SGLD(_model(), step_size=50.0, temperature=0.0), x, y, num_samples=200)
    assert "the chain itself blew up" in error.cause and "smaller step_size" in error.cause
    assert 0 < len(error.draws["weight"]) < 200


def test_a_schedule_returning_nan_is_named_as_a_hyperparameter():
    x, y = _data()
    kernel = SGLD(_model(), step_size=1e-3, schedule=lambda t: 1.0 if t < 5 else math.nan)
    error = _diverge(kernel, x, y)
    assert error.step == 5 and "schedule" in error.cause and "hyperparameter" in error.cause
    assert len(error.draws["weight"]) == 3


def _classifier():
    torch.manual_seed(0)
    net = bdl.lift(torch.nn.Linear(3, 4).double(), bdl.priors.IIDNormal(1.0))

    def model(batch, num_data):
        x, labels = batch
        bdl.observe("y", dist.Categorical(logits=net(x)), labels, num_data)

    return model


def test_labels_outside_the_support_in_a_later_batch_are_a_named_error_under_mcmc():
    x, _ = _data()
    labels = torch.randint(0, 4, (NUM_DATA,), generator=torch.Generator().manual_seed(1))
    labels[13] = 4  # in the third batch, class 4 of 4
    mcmc = MCMC(SGHMC(_classifier(), step_size=1e-3), num_samples=10, disable_progbar=True)
    with pytest.raises(ObservationError, match=r"obs has 1 value\(s\) outside the support") as e:
        mcmc.run(_loader(x, labels), NUM_DATA)
    assert "e.g. [4] at batch position(s) [1]" in str(e.value)
    assert "in the batch of step 2 of SGHMC" in str(e.value)


def test_labels_outside_the_support_in_the_first_batch_fail_at_setup():
    x, _ = _data()
    labels = torch.zeros(NUM_DATA, dtype=torch.long)
    labels[0] = -1
    mcmc = MCMC(SGLD(_classifier(), step_size=1e-3), num_samples=2, disable_progbar=True)
    with pytest.raises(ObservationError, match=r"e.g. \[-1\] at batch position\(s\) \[0\]"):
        mcmc.run(_loader(x, labels), NUM_DATA)


def test_a_divergence_at_step_0_says_where_the_chain_started():
    # Issue 21, item 2: eight schools' tau started at the prior mean of a HalfCauchy, inf,
    # and the error never said so. (The default start is now feasible, tau = 1: the prior
    # mean is asked for here.)
    def model():
        mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0).double(), 5.0))
        tau = pyro.sample("tau", dist.HalfCauchy(torch.tensor(5.0).double()))
        pyro.sample("obs", dist.Normal(mu, tau), obs=torch.tensor(3.0).double())

    kernel = SGLD(model, step_size=1e-3, num_data=1, init_params=init_to_mean)
    error = _diverge(kernel, None, None, warmup_steps=0, num_samples=2, data=())
    assert error.step == 0
    assert "the chain started at tau=inf (not finite), mu=0" in error.cause
    assert "init_params=init_to_mean" in error.cause and "init_to_median" in error.cause


def _overflowing_classifier():
    # The logits x * exp(s) are finite at the start (s = 0) and NaN once a step has thrown
    # s past exp's overflow (0 * inf on the zero column), with s itself still finite.
    def model(batch, num_data):
        x, labels = batch
        s = pyro.sample("s", dist.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0))
        bdl.observe("y", dist.Categorical(logits=x * s.exp()), labels, num_data)

    x, _ = _data()
    x[:, 0] = 0.0
    labels = torch.randint(0, 3, (NUM_DATA,), generator=torch.Generator().manual_seed(1))
    return model, x, labels


def test_a_distribution_parameter_made_nan_by_a_huge_step_is_a_divergence():
    # With Pyro's validation on (a kernel stepped without pyro.infer.MCMC, or
    # disable_validation=False), the NaN logits raised a bare ValueError from the
    # Categorical's constructor (the adapted SGHMC of benchmarks/sgmcmc_overhead.py's MLP).
    model, x, labels = _overflowing_classifier()
    mcmc = MCMC(
        SGLD(model, step_size=1e3, temperature=0.0),
        num_samples=20,
        warmup_steps=0,
        disable_progbar=True,
        disable_validation=False,
    )
    with pytest.raises(DivergenceError) as error:
        mcmc.run(_loader(x, labels), NUM_DATA)
    cause = error.value.cause
    assert error.value.step == 2 and len(error.value.draws["s"]) == 2
    assert cause.startswith("the model raised a ValueError at the chain's values (Expected ")
    assert "Categorical" in cause and "the chain itself blew up" in cause
    assert "smaller step_size (now 1e+03)" in cause
    assert isinstance(error.value.__context__, ValueError)


def test_a_value_error_the_start_raises_too_propagates_as_it_is():
    # Not the chain's doing: the model rejects the third batch wherever the chain is.
    x, y = _data()

    def model(batch, num_data):
        x, y = batch
        if bool((x[:, 0] > 10).any()):
            raise ValueError("the model's own check")
        w = pyro.sample("w", dist.Normal(torch.zeros(3, dtype=torch.float64), 1.0).to_event(1))
        bdl.observe("y", dist.Normal(x @ w, 0.5), y, num_data)

    x[13, 0] = 11.0  # in the third batch
    mcmc = MCMC(SGLD(model, step_size=1e-3), num_samples=10, disable_progbar=True)
    with pytest.raises(ValueError, match="the model's own check"):  # not a DivergenceError
        mcmc.run(_loader(x, y), NUM_DATA)
