"""Why a chain diverged: the error it stops with, and the diagnosis in its message.

A step whose potential energy or parameters are non-finite stops the chain with a
:class:`DivergenceError` holding the draws kept before it. Its message says what was
non-finite, found by ``diagnose`` once the chain has diverged (so it may read the
device freely), in order: the data of that step; then the model on that step's batch
at the chain's start, where the model was finite, with Pyro's validation on (which
names invalid distribution parameters and observations outside the support) and each
site's log density (a non-finite prior or likelihood parameter, a hyperparameter of
the model); then the gradient there; and only if all of these are finite, the chain
itself (``blew_up``): its parameters blew up, and the step size is too large. A chain
that blew up in warm-up is set back instead of stopped
(:mod:`~pyro_bdl.inference.sgmcmc.recovery`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import pyro
import torch
from pyro.poutine.util import site_is_subsample

from pyro_bdl.inference.sgmcmc.target import Target
from pyro_bdl.likelihoods import ObservationError

__all__ = ["DivergenceError", "blew_up", "describe_start", "diagnose"]


class DivergenceError(RuntimeError):
    """A chain produced a non-finite potential or parameter and was stopped (or its values
    made a distribution's parameter invalid, which Pyro's validation, when on, rejects
    with a ValueError that the model at the chain's start does not raise).

    The message says what was non-finite at that step: the data, a prior or one of its
    parameters, a likelihood parameter (a hyperparameter of the model), the gradient,
    the step size from the schedule, or the parameters themselves (the chain blew up).

    :ivar int step: the kernel step (from 0, warm-up included) that diverged.
    :ivar str cause: what was non-finite, in words.
    :ivar dict draws: the draws kept before it, site name -> ``(num_draws, *shape)``.
    :ivar dict sample_stats: the statistics of those draws.
    """

    def __init__(self, message: str, step: int, draws: dict, sample_stats: dict, cause: str = ""):
        super().__init__(message)
        self.step = step
        self.cause = cause
        self.draws = draws
        self.sample_stats = sample_stats


def diagnose(
    symptom: str,
    target: Target,
    batch: tuple[tuple, dict],
    start: dict[str, torch.Tensor],
    *,
    step: int,
    kernel: str,
) -> str | None:
    """What outside the chain made a step's potential or parameters non-finite: the data
    of that step, the model or its gradient at the chain's start on that batch; None when
    all of these are finite (the chain itself blew up, see :func:`blew_up`).

    :param str symptom: what the step showed (e.g. "the potential energy is nan").
    :param Target target: the model as the chain sees it.
    :param batch: that step's ``(args, kwargs)``.
    :param dict start: the chain's start (unconstrained values).
    :param int step: the step's number; ``kernel`` the kernel's name.
    """
    args, kwargs = batch
    bad_data = _non_finite_inputs(args, kwargs)
    if bad_data:
        return (
            f"{symptom}; the data of that step is non-finite ({bad_data}): remove or "
            "impute NaN / inf values in the data set"
        )
    start = {name: target.constrain(name, z) for name, z in start.items()}
    model_cause = _model_cause(target, start, args, kwargs, step, kernel)
    if model_cause:
        return f"{symptom}; {model_cause}"
    if _gradient_is_non_finite(target, start, args, kwargs):
        return (
            f"{symptom}; the gradient of the log joint on that step's batch is non-finite "
            "at the chain's start, with finite data and log density (e.g. sqrt or log of "
            "0 in the model's backward pass)"
        )
    return None


def blew_up(
    params: dict[str, torch.Tensor], last_potential: float, advice: str, finite: bool = False
) -> str:
    """The chain itself blew up, in words: what its parameters became, the last finite
    potential energy it had, and ``advice`` (what to change); ``finite``: its values are
    finite still (a divergence found by :mod:`~pyro_bdl.inference.sgmcmc.recovery`)."""
    bad = [n for n, t in params.items() if not bool(torch.isfinite(t).all())]
    largest = max(float(t.detach().abs().max()) for t in params.values())
    if finite:
        return (
            f"the chain itself diverged (the largest |parameter| is {largest:.3g}; the "
            f"potential energy read before was {last_potential:.4g}): {advice}"
        )
    state = f"the largest |parameter| is {largest:.3g}, where the model overflows"
    state = f"{bad[0]!r} became non-finite" if bad else state
    return (
        f"the chain itself blew up ({state}; the last finite potential energy was "
        f"{last_potential:.4g}): {advice}"
    )


def _model_cause(
    target: Target, point: dict, args: tuple, kwargs: dict, step: int, kernel: str
) -> str | None:
    model = pyro.poutine.condition(target.model, data=point)
    try:
        with torch.no_grad(), pyro.validation_enabled(True):
            trace = pyro.poutine.trace(model).get_trace(*args, **kwargs)
            trace.compute_log_prob()
    except ObservationError as error:
        raise ObservationError(
            f"{error} (in the batch of step {step} of {kernel}; "
            "the draws kept before it are in kernel.get_draws())"
        ) from None
    except ValueError as error:
        return (
            "re-running the model on that step's batch with Pyro's validation on says "
            f"a distribution's parameter is invalid (a prior, a likelihood parameter or "
            f"a hyperparameter of the model): {error}"
        )
    for name, site in trace.nodes.items():
        if site["type"] != "sample" or site_is_subsample(site):
            continue
        log_density = float(site["log_prob_sum"])
        if math.isfinite(log_density):
            continue
        bad = _non_finite_parameters(site["fn"])
        if name in target.sites:
            what = f"the prior of site {name!r} has log density {log_density}"
            if bad:
                return f"{what}: its parameter {bad} is non-finite"
            return f"{what} at the chain's start"
        what = f"the likelihood of the observed site {name!r} has log density {log_density}"
        if bad:
            return (
                f"{what}: its parameter {bad} is non-finite at the chain's start, with "
                "finite data (a hyperparameter of the model, such as a noise scale, is "
                "non-finite, or the network overflows)"
            )
        return f"{what} at the chain's start, with finite data and parameters"
    return None


def _gradient_is_non_finite(target: Target, point: dict, args: tuple, kwargs: dict) -> bool:
    leaves = {
        name: target.unconstrain(name, value.detach()).clone().requires_grad_(True)
        for name, value in point.items()
    }
    with torch.enable_grad():
        _, grads = target.log_joint_and_grad(leaves, args, kwargs)
    return not all(bool(torch.isfinite(g).all()) for g in grads)


def describe_start(target: Target, start: dict[str, torch.Tensor], init_params: object) -> str:
    """Where a chain started (``start``, unconstrained) and by which rule, in words
    (non-finite sites first)."""
    if init_params is None:
        rule = (
            "init_params=None: lifted weights at the module's values, other sites by "
            "pyro_bdl.lift.init_to_module"
        )
    elif callable(init_params):
        rule = f"init_params={getattr(init_params, '__name__', type(init_params).__name__)}"
    else:
        rule = "the given init_params"
    values = {name: target.constrain(name, z).detach() for name, z in start.items()}
    order = sorted(values, key=lambda name: bool(torch.isfinite(values[name]).all()))
    shown = []
    for name in order[:6]:
        flat = values[name].reshape(-1)
        text = ", ".join(f"{v:.4g}" for v in flat[:3].tolist())
        text = f"[{text}{', ...' if flat.numel() > 3 else ''}]" if values[name].dim() else text
        bad = "" if bool(torch.isfinite(flat).all()) else " (not finite)"
        shown.append(f"{name}={text}{bad}")
    more = f" and {len(order) - 6} more sites" if len(order) > 6 else ""
    return (
        f"{', '.join(shown)}{more} ({rule}); pass init_params, e.g. a dict of values or "
        "pyro.infer.autoguide.init_to_median, to start elsewhere"
    )


def _non_finite_inputs(args: tuple, kwargs: dict) -> str:
    """Where the model's arguments hold non-finite floating values, in words ('' if none)."""
    found = []

    def walk(value, where):
        if torch.is_tensor(value):
            if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                count = int((~torch.isfinite(value)).sum())
                found.append(f"{where}: {count} of {value.numel()} values")
        elif isinstance(value, Mapping):
            for key, item in value.items():
                walk(item, f"{where}[{key!r}]")
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                walk(item, f"{where}[{i}]")

    for i, arg in enumerate(args):
        walk(arg, f"argument {i}")
    for key, arg in kwargs.items():
        walk(arg, f"argument {key!r}")
    return "; ".join(found)


def _non_finite_parameters(fn) -> str:
    """The non-finite tensor parameters of a distribution, in words ('' if none)."""
    found = []
    while fn is not None:
        for key in getattr(fn, "arg_constraints", {}):
            value = fn.__dict__.get(key)
            if torch.is_tensor(value) and not bool(torch.isfinite(value).all()):
                bad = value[~torch.isfinite(value)].reshape(-1)
                found.append(
                    f"{type(fn).__name__}.{key} ({len(bad)} of {value.numel()} entries "
                    f"non-finite, e.g. {bad[0].item()})"
                )
        fn = getattr(fn, "base_dist", None)
    return ", ".join(found)
