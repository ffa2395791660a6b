"""Every bad input to the SGMCMC kernels and schedules is a named error, raised at the call.

Each case is a call and the error it must raise: its type (``TypeError`` for the wrong
kind of object, ``ValueError`` for an impossible value) and the argument its message
must name. Numbers may be Python, NumPy or 0-d tensor scalars; bools are not numbers.
"""

import math

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import MCMC
from torch.utils.data import DataLoader, TensorDataset

import pyro_bdl as bdl
from pyro_bdl.inference import SGHMC, SGLD, SGNHT, Constant, RobbinsMonro

NUM_DATA = 12


def _model(batch, num_data):
    w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=torch.float64), 1.0).to_event(1))
    x, y = batch
    bdl.observe("y", dist.Normal(x @ w, 1.0), y, num_data)


def _batch():
    x = torch.randn(NUM_DATA, 2, dtype=torch.float64)
    return x, x.sum(-1)


def _run(kernel, *args, **mcmc_kwargs):
    MCMC(kernel, num_samples=2, disable_progbar=True, **mcmc_kwargs).run(*args)


def _no_latent(batch, num_data):
    bdl.observe("y", dist.Normal(torch.zeros(NUM_DATA), 1.0), batch[1], num_data)


def _discrete(batch, num_data):
    pyro.sample("k", dist.Poisson(3.0))
    _model(batch, num_data)


def _empty_loader():
    return DataLoader(TensorDataset(torch.zeros(0, 2), torch.zeros(0)), batch_size=4)


KERNEL_ARGUMENTS = [
    # (keyword arguments, error, the argument the message names)
    ({"step_size": -0.1}, ValueError, "step_size"),
    ({"step_size": 0.0}, ValueError, "step_size"),
    ({"step_size": math.nan}, ValueError, "step_size"),
    ({"step_size": math.inf}, ValueError, "step_size"),
    ({"step_size": True}, TypeError, "step_size"),
    ({"step_size": "0.1"}, TypeError, "step_size"),
    ({"step_size": torch.ones(2)}, TypeError, "step_size"),
    ({"step_size": 0.1, "temperature": -1.0}, ValueError, "temperature"),
    ({"step_size": 0.1, "temperature": math.nan}, ValueError, "temperature"),
    ({"step_size": 0.1, "temperature": math.inf}, ValueError, "temperature"),
    ({"step_size": 0.1, "temperature": False}, TypeError, "temperature"),
    ({"step_size": 0.1, "temperature": None}, TypeError, "temperature"),
    ({"step_size": 0.1, "num_data": 0}, ValueError, "num_data"),
    ({"step_size": 0.1, "num_data": -5}, ValueError, "num_data"),
    ({"step_size": 0.1, "num_data": 2.5}, TypeError, "num_data"),
    ({"step_size": 0.1, "num_data": True}, TypeError, "num_data"),
    ({"step_size": 0.1, "num_data": "100"}, TypeError, "num_data"),
    ({"step_size": 0.1, "thin": 0}, ValueError, "thin"),
    ({"step_size": 0.1, "thin": 2.0}, TypeError, "thin"),
    ({"step_size": 0.1, "thin": True}, TypeError, "thin"),
    ({"step_size": 0.1, "thin": -3}, ValueError, "thin"),
    ({"step_size": 0.1, "thin": None}, TypeError, "thin"),
    ({"step_size": 0.1, "schedule": 0.5}, TypeError, "schedule"),
    ({"step_size": 0.1, "schedule": "constant"}, TypeError, "schedule"),
    ({"step_size": 0.1, "init_params": 3.0}, TypeError, "init_params"),
    ({"step_size": 0.1, "init_params": [torch.zeros(2)]}, TypeError, "init_params"),
    ({"step_size": 0.1, "init_params": {"w": "zero"}}, TypeError, "init_params['w']"),
    (
        {"step_size": 0.1, "init_params": {"w": torch.tensor([0.0, math.nan])}},
        ValueError,
        "init_params['w']",
    ),
    ({"step_size": 0.1, "init_params": {"w": torch.tensor([1, 2])}}, TypeError, "init_params['w']"),
    ({"step_size": 0.1, "init_params": {3: torch.zeros(2)}}, TypeError, "init_params key"),
    ({"step_size": 0.1, "checkpoint": 3}, TypeError, "checkpoint"),
    ({"step_size": 0.1, "checkpoint": ["dir"]}, TypeError, "checkpoint"),
    ({"step_size": 0.1, "checkpoint_every": 0}, ValueError, "checkpoint_every"),
    ({"step_size": 0.1, "checkpoint_every": 1.5}, TypeError, "checkpoint_every"),
    ({"step_size": 0.1, "checkpoint_every": False}, TypeError, "checkpoint_every"),
    ({"step_size": 0.1, "keep_draws": "yes"}, TypeError, "keep_draws"),
    ({"step_size": 0.1, "keep_draws": 1}, TypeError, "keep_draws"),
]

MOMENTUM_ARGUMENTS = [
    ({"friction": -1.0}, ValueError, "friction"),
    ({"friction": math.nan}, ValueError, "friction"),
    ({"friction": math.inf}, ValueError, "friction"),
    ({"friction": True}, TypeError, "friction"),
    ({"friction": "1"}, TypeError, "friction"),
    ({"mass": 0.0}, ValueError, "mass"),
    ({"mass": -1.0}, ValueError, "mass"),
    ({"mass": math.inf}, ValueError, "mass"),
    ({"mass": True}, TypeError, "mass"),
    ({"mass": [1.0]}, TypeError, "mass"),
]

SCHEDULES = [
    (lambda: RobbinsMonro(b=0.0), ValueError, "b"),
    (lambda: RobbinsMonro(b=-10.0), ValueError, "b"),
    (lambda: RobbinsMonro(b=math.nan), ValueError, "b"),
    (lambda: RobbinsMonro(b=True), TypeError, "b"),
    (lambda: RobbinsMonro(b="1000"), TypeError, "b"),
    (lambda: RobbinsMonro(gamma=0.0), ValueError, "gamma"),
    (lambda: RobbinsMonro(gamma=1.5), ValueError, "gamma"),
    (lambda: RobbinsMonro(gamma=math.nan), ValueError, "gamma"),
    (lambda: RobbinsMonro(gamma=False), TypeError, "gamma"),
    (lambda: RobbinsMonro(gamma=None), TypeError, "gamma"),
    (lambda: RobbinsMonro()(-1), ValueError, "t"),
    (lambda: RobbinsMonro()(1.5), TypeError, "t"),
    (lambda: RobbinsMonro()(True), TypeError, "t"),
    (lambda: RobbinsMonro()("3"), TypeError, "t"),
    (lambda: RobbinsMonro()(None), TypeError, "t"),
    (lambda: Constant()(-2), ValueError, "t"),
    (lambda: Constant()(0.5), TypeError, "t"),
    (lambda: Constant()(True), TypeError, "t"),
    (lambda: Constant()("0"), TypeError, "t"),
    (lambda: Constant()(None), TypeError, "t"),
]

RUNS = [
    # (what MCMC runs, error, the argument or thing the message names)
    (lambda: _run(SGLD(_no_latent, 0.1), _batch(), NUM_DATA), ValueError, "latent sample sites"),
    (lambda: _run(SGLD(_discrete, 0.1), _batch(), NUM_DATA), ValueError, "site 'k' is discrete"),
    (lambda: _run(SGLD(_model, 0.1), _empty_loader(), NUM_DATA), ValueError, "DataLoader"),
    (lambda: _run(SGLD(_model, 0.1), _batch(), NUM_DATA - 1), ValueError, "num_data"),
    (lambda: _run(SGLD(_model, 0.1), _batch(), 0), ValueError, "num_data"),
    (lambda: _run(SGLD(_model, 0.1), _batch(), 12.0), TypeError, "num_data"),
    (lambda: _run(SGLD(_model, 0.1, num_data=50), _batch(), NUM_DATA), ValueError, "num_data=50"),
    (
        lambda: _run(SGLD(_model, 0.1, init_params={"w": torch.zeros(3)}), _batch(), NUM_DATA),
        ValueError,
        "init_params['w'] has shape (3,)",
    ),
    (
        lambda: _run(SGLD(_model, 0.1), _batch(), NUM_DATA, initial_params={"w": torch.zeros(5)}),
        ValueError,
        "initial_params['w'] has shape (5,)",
    ),
    (
        lambda: _run(
            SGLD(_model, 0.1),
            _batch(),
            NUM_DATA,
            initial_params={"w": torch.full((2,), math.inf)},
        ),
        ValueError,
        "initial_params['w'] has non-finite values",
    ),
    (
        lambda: _run(SGLD(_model, 0.1, schedule=lambda t: "fast"), _batch(), NUM_DATA),
        TypeError,
        "schedule must return a number",
    ),
]


def _kernel_cases():
    for kernel_class in (SGLD, SGHMC, SGNHT):
        for kwargs, error, name in KERNEL_ARGUMENTS:
            yield pytest.param(
                kernel_class, kwargs, error, name, id=f"{kernel_class.__name__}-{kwargs}"
            )
    for kernel_class in (SGHMC, SGNHT):
        for kwargs, error, name in MOMENTUM_ARGUMENTS:
            kwargs = {"step_size": 0.1, **kwargs}
            yield pytest.param(
                kernel_class, kwargs, error, name, id=f"{kernel_class.__name__}-{kwargs}"
            )
    yield pytest.param(
        SGNHT, {"step_size": 0.1, "friction": 0.0}, ValueError, "friction", id="sgnht-no-noise"
    )
    yield pytest.param(SGLD, {"step_size": 0.1, "model": None}, TypeError, "model", id="model-none")
    yield pytest.param(
        SGHMC, {"step_size": 0.1, "model": "model"}, TypeError, "model", id="model-str"
    )


@pytest.mark.parametrize("kernel_class, kwargs, error, name", _kernel_cases())
def test_kernel_arguments_are_checked_at_the_call(kernel_class, kwargs, error, name):
    kwargs = {"model": _model, **kwargs}
    with pytest.raises(error) as raised:
        kernel_class(**kwargs)
    assert name in str(raised.value)


@pytest.mark.parametrize("call, error, name", SCHEDULES)
def test_schedule_arguments_are_checked(call, error, name):
    with pytest.raises(error) as raised:
        call()
    assert f"{name} must be" in str(raised.value)


@pytest.mark.parametrize("call, error, name", RUNS)
def test_bad_runs_fail_at_setup_with_a_named_error(call, error, name):
    with pytest.raises(error) as raised:
        call()
    assert name in str(raised.value)


@pytest.mark.parametrize("kernel_class", [SGLD, SGHMC, SGNHT])
def test_numpy_and_tensor_scalars_are_numbers(kernel_class):
    kernel = kernel_class(
        _model,
        step_size=np.float32(0.01),
        temperature=torch.tensor(0.5),
        thin=np.int64(2),
        num_data=torch.tensor(NUM_DATA),
    )
    assert (kernel.step_size, kernel.temperature, kernel.thin) == (
        pytest.approx(0.01),
        0.5,
        2,
    )
    assert type(kernel.thin) is int and kernel.hyper.num_data == NUM_DATA
    assert RobbinsMonro(b=np.float64(10.0), gamma=torch.tensor(1.0))(np.int64(10)) == 0.5


def test_a_hyperparameter_set_on_the_kernel_is_validated_and_in_its_record():
    kernel = SGHMC(_model, step_size=0.1)
    kernel.step_size = np.float32(0.05)
    assert kernel.step_size == pytest.approx(0.05) and type(kernel.step_size) is float
    assert kernel.hyperparameters()["step_size"] == kernel.hyper.step_size == kernel.step_size
    with pytest.raises(ValueError, match="step_size \\* friction / mass must be below 2"):
        kernel.step_size = 10.0
    with pytest.raises(ValueError, match="friction must be a non-negative"):
        kernel.friction = -1.0
    assert (kernel.step_size, kernel.friction) == (pytest.approx(0.05), 1.0)


@pytest.mark.parametrize("kernel_class", [SGLD, SGHMC, SGNHT])
def test_mcmc_with_no_samples_says_so_instead_of_failing_inside_pyro(kernel_class):
    mcmc = MCMC(kernel_class(_model, 0.01), num_samples=0, warmup_steps=3, disable_progbar=True)
    with pytest.raises(ValueError, match=r"num_samples=0: .* pass num_samples >= 1"):
        mcmc.run(_batch(), NUM_DATA)
