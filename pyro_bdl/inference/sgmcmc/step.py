r"""The step every SGMCMC kernel takes, the draw it may end with, and the stop.

One step replaces each DataLoader argument of the model by its next minibatch; evaluates
the minibatch log joint :math:`\log p(\theta) + \frac{N}{B}\sum_{i \in \text{batch}} \log
p(y_i \mid \theta)` and its gradient :math:`g` in one forward and backward pass; lets the
warm-up adaptation see the gradient; and applies the method's ``update`` in place, under
the adaptation's mass. Under ``torchrun`` (one chain across the ranks) the log joint and
its gradient are averaged across ranks before the update (each rank's is scaled N /
B_local, so their mean is the global batch's).

**No device sync per step.** The potential energy stays on the device. A step reads one
scalar, its potential, to stop a diverging chain: on the CPU at once (a read costs
nothing there), on a GPU one step late, from a copy queued into pinned memory right after
the potential was computed, so the read never waits for the work queued since.
"Promptly" therefore means: before the update of the step whose potential is non-finite
on the CPU, before the update of the next step on a GPU, and in every case before a draw
is kept, so no non-finite draw is ever kept. The statistics of a kept draw (potential,
gradient norm, kinetic temperature) are read together, once per kept draw.

The functions take the kernel (an
:class:`~pyro_bdl.inference.sgmcmc.base.SGMCMCKernel`): its hyperparameters, its method's
``update`` and its chain, ``kernel.run``.
"""

from __future__ import annotations

import functools
import math

import torch

from pyro_bdl.inference.sgmcmc import langevin
from pyro_bdl.inference.sgmcmc.device import LaggedRead, norm
from pyro_bdl.inference.sgmcmc.divergence import (
    DivergenceError,
    blew_up,
    describe_start,
    diagnose,
)
from pyro_bdl.inference.sgmcmc.recovery import DIVERGED
from pyro_bdl.inference.sgmcmc.state import StepInfo
from pyro_bdl.likelihoods import ObservationError

__all__ = ["keep_draw", "step", "step_size", "stop"]


def step(kernel, record: bool) -> None:
    """Take one kernel step; with ``record``, note the statistics of the state it starts
    from (the last step of a kept draw)."""
    run = kernel.run
    state = run.state
    adaptation = state.adaptation
    state.adapting = adapting = adaptation is not None and state.iteration < run.warmup_steps
    if run.recovery is not None and adapting:
        run.recovery.save(state.step)
    batch = args, kwargs = run.batches.next()
    average = run.data_parallel
    try:
        with torch.enable_grad():
            log_joint, grads = run.target.log_joint_and_grad(
                state.params, args, kwargs, average=average
            )
    except ValueError as error:
        if not _stop_if_moved_there(kernel, batch, error):
            raise
        # set back in warm-up: the step is over
        _end_step(kernel, StepInfo(state.step, batch, math.nan))
        return
    if adapting:
        if state.step == 0:

            def gradient_at(params: dict) -> list[torch.Tensor]:
                with torch.enable_grad():
                    return run.target.log_joint_and_grad(params, args, kwargs, average=average)[1]

            adaptation.begin(gradient_at, state.params, grads)
        adaptation.observe_gradient(grads)
    info = StepInfo(state.step, batch, step_size(kernel))
    potential = -log_joint.autograd_value
    if torch.is_tensor(potential):
        potential = potential.detach()
    if record:
        # Device scalars of the state the step started from, read with the draw.
        info.recorded = {
            "potential_energy": potential - log_joint.analytic_prior_value(),
            "grad_norm": norm(grads),
        }
    with torch.no_grad():
        if adaptation is None:
            kernel.update(state.theta, grads, info.step_size)
        else:
            update, statistic_of = _dynamics(kernel, adapting and adaptation.langevin)
            adaptation.apply(update, state.theta, grads, info.step_size, adapting)
        watched = potential
        if adapting and kernel.adapt_step_size:
            # The statistic travels with the potential: still one read per step.
            statistic = statistic_of(info.step_size)
            watched = torch.stack([torch.as_tensor(potential).to(statistic), statistic])
    ready = run.watch.push(watched, info)
    if ready is not None:
        _check_potential(kernel, *ready)
    _end_step(kernel, info)


def _end_step(kernel, info: StepInfo) -> None:
    """Close the step: the adaptation's schedule, and the step's count."""
    state = kernel.run.state
    if state.adapting and state.adaptation.end_step(state.iteration):
        with torch.no_grad():
            kernel.refresh()
    state.step += 1
    kernel.run.info = info


def _dynamics(kernel, langevin_step: bool) -> tuple:
    """The update and step-size statistic of this step: the method's, or Langevin
    dynamics' where the adaptation asks for them (see
    :mod:`~pyro_bdl.inference.sgmcmc.langevin`)."""
    if langevin_step:
        return functools.partial(langevin.update, kernel), functools.partial(
            langevin.statistic, kernel
        )
    return kernel.update, kernel.adaptation_statistic


def _check_potential(kernel, value: float | list[float], info: StepInfo) -> None:
    """Judge a step's potential and (while the step size adapts) statistic, read from
    the device: a divergence sets a warm-up chain back or stops the chain (see
    :mod:`~pyro_bdl.inference.sgmcmc.recovery`); otherwise the adaptation takes them."""
    run = kernel.run
    state = run.state
    if isinstance(value, list):
        value, statistic = value
        finite = math.isfinite(value) and math.isfinite(statistic)
        if finite and _judged_diverged(kernel, info, statistic, value, "steps"):
            return
        state.adaptation.observe_statistic(statistic, value)
    if not math.isfinite(value):
        _diverged(kernel, info, f"the minibatch potential energy is {value}")
        return
    state.potential_energy = value


def _judged_diverged(kernel, info: StepInfo, statistic: float, potential: float, reads: str):
    """Give the sentinel a read of the statistic and the energy (both finite); when it
    completes a divergence, set the chain back or stop it (:func:`_diverged`), and return
    True. ``reads``: what was read, steps or kept draws."""
    energy = potential + kernel.kinetic_energy_of(statistic, info.step_size)
    if not kernel.run.sentinel.diverged(statistic, energy):
        return False
    symptom = (
        f"the excess of the kinetic temperature read {statistic:.3g} (above "
        f"{DIVERGED:g} times its spread before and its target "
        f"{kernel.hyper.target_excess:g}) while the energy (potential plus kinetic) rose to "
        f"a new high, {energy:.4g}, two {reads} in a row"
    )
    _diverged(kernel, info, symptom, finite=True)
    return True


def step_size(kernel) -> float:
    """The step size of the next step: the given or adapted one, after the schedule."""
    state = kernel.run.state
    multiplier = kernel.schedule(state.step)
    if type(multiplier) is not float or not 0 < multiplier < math.inf:
        multiplier = _checked_multiplier(kernel, multiplier)
    adaptation = state.adaptation
    base = kernel.step_size if adaptation is None else adaptation.step_size
    return base * multiplier


def _checked_multiplier(kernel, multiplier: object) -> float:
    step = kernel.run.state.step
    try:
        value = float(multiplier)
    except (TypeError, ValueError):
        raise TypeError(
            f"schedule must return a number (a step-size multiplier), returned "
            f"{type(multiplier).__name__} {multiplier!r} at step {step}"
        ) from None
    if not 0 < value < math.inf:
        stop(
            kernel,
            step,
            f"the step-size schedule {kernel.schedule!r} (a hyperparameter) returned the "
            f"multiplier {value} at step {step}; it must be positive and finite",
        )
    return value


def keep_draw(kernel) -> None:
    """Keep the chain's current state as a draw, with its statistics: one read of the
    device (the statistics, the largest :math:`|\\theta|` and the coordinates the
    convergence check follows); a non-finite one stops the chain instead."""
    run = kernel.run
    state, info, kept = run.state, run.info, run.kept
    extra = kernel.extra_stats()
    names = [*info.recorded, *extra]
    device_stats = {**info.recorded, **extra}
    scalars = [torch.as_tensor(device_stats[key]).reshape(()) for key in names]
    largest = torch.stack(torch._foreach_norm(state.theta, ord=math.inf)).max()
    followed = kept.monitor.coordinates(state.params).to(largest)
    read = torch.cat([torch.stack([s.to(largest) for s in scalars] + [largest]), followed])
    read = read.tolist()
    kept.monitor.add(read[len(names) + 1 :])
    read = read[: len(names) + 1]
    stats = dict(zip(names, read))
    if not math.isfinite(read[-1]):
        bad = [name for name, t in state.params.items() if not bool(torch.isfinite(t).all())]
        _diverged(kernel, info, f"parameter {bad[0]!r} has non-finite values")
    potential = stats["potential_energy"]
    if not math.isfinite(potential):
        _diverged(kernel, info, f"the potential energy is {potential}")
    statistic = kernel.draw_statistic(stats, info.step_size)
    if statistic is not None and math.isfinite(statistic):
        _judged_diverged(kernel, info, statistic, potential, "kept draws")  # stops the chain
    stats.update(step_size=info.step_size, temperature=kernel.temperature)
    if kernel.function_monitor is not None:  # one forward pass on the probe batch
        kernel.function_monitor.add(state.params)
    draw = functools.partial(kernel.constrained_values, device="cpu")
    kept.add(stats, draw, state.iteration - run.warmup_steps, state.iteration + 1)


def _stop_if_moved_there(kernel, batch: tuple[tuple, dict], error: ValueError) -> bool:
    """Stop the chain if the model's ``error`` on this step's batch comes from where the
    chain moved: a distribution's validation of a parameter the chain's values made
    non-finite (a network's logits that overflowed), where the model at the chain's
    start raises nothing on the same batch; in warm-up set it back instead, and return
    True. An error the start raises too, or labels outside the support, is the model's
    or the data's, and propagates as it is (False)."""
    if isinstance(error, ObservationError):
        return False
    run = kernel.run
    start = {
        name: z.detach().clone().requires_grad_(True) for name, z in run.initial_params.items()
    }
    try:
        with torch.enable_grad():
            run.target.log_joint_and_grad(start, *batch)
    except ValueError:
        return False
    message = str(error).splitlines()[0] if str(error) else type(error).__name__
    symptom = f"the model raised a ValueError at the chain's values ({message})"
    _diverged(kernel, StepInfo(run.state.step, batch, math.nan), symptom)
    return True


def _diverged(kernel, info: StepInfo, symptom: str, finite: bool = False) -> None:
    """Set a warm-up chain that blew up back to its last sane state (see
    :mod:`~pyro_bdl.inference.sgmcmc.recovery`), or stop the chain, saying why. A
    non-finite value is the chain's doing only when the data, the model and its gradient
    are finite at the chain's start on that batch; ``finite`` values (the sentinel's
    verdict) are."""
    run = kernel.run
    cause = None
    if not finite:
        kind, start = type(kernel).__name__, run.initial_params
        cause = diagnose(symptom, run.target, info.batch, start, step=info.step, kernel=kind)
    recovery = run.recovery
    warmup = info.step < run.warmup_steps
    # Set back only a chain the sentinel could judge: one that blows up within its first
    # reads is thrown by its first steps, and set back to its start with half the step it
    # may be thrown again, into a region flat enough to hold it (SGLD on posteriordb's
    # kidiq with step_size=0.01 and a unit mass: log sigma at 38, every draw there).
    if cause is None and recovery is not None and warmup and run.sentinel.armed:
        if recovery.restore(info.step):
            run.watch = LaggedRead()  # a read in flight is of the state set back
            with torch.no_grad():
                kernel.refresh()  # the momenta, drawn afresh
            return
        advice = recovery.advice(info.step)
    else:
        advice = _advice(kernel, warmup)
    if cause is None:
        state = run.state
        cause = blew_up(state.params, state.potential_energy, advice, finite)
        if not finite:
            cause = (
                "the data, priors, likelihood and gradient are finite at the chain's start "
                f"on that batch, so {cause}"
            )
        cause = f"{symptom}; {cause}"
    if info.step == 0:
        start = describe_start(run.target, run.initial_params, kernel.init_params)
        cause += f"; the chain started at {start}"
    stop(kernel, info.step, cause)


def _advice(kernel, warmup: bool) -> str:
    """What to change when a chain blew up: its step size (fixed, or where warm-up
    starts), or after warm-up the step size that warm-up adapted."""
    now = kernel.current_step_size()
    adaptation = kernel.run.state.adaptation
    if adaptation is None or not kernel.adapt_step_size or warmup:
        return f"try a smaller step_size (now {now:.3g})"
    target = kernel.hyper.target_excess
    # (posteriordb's sblrc-blr: after 500 warm-up steps SGHMC diverged at draw 78, after
    # 2,000 it sampled the posterior)
    return (
        f"the step size warm-up adapted, {now:.3g}, is too large for where the chain went; "
        "run more warmup_steps (warm-up may have ended before the chain reached the "
        f"posterior), or pass a smaller target_excess (now {target:g}; {target / 4:g} about "
        "halves SGHMC's and SGNHT's step and quarters SGLD's), or adapt_step_size=False "
        f"with step_size={adaptation.unit_step_size() / 2:.3g} (half the adapted step, for "
        "the unit mass)"
    )


def stop(kernel, step: int, cause: str) -> None:
    """Stop the chain at ``step`` with a :class:`DivergenceError` that holds the draws
    kept before it."""
    kept = kernel.run.kept
    draws = kept.draws()
    number = len(next(iter(draws.values()))) if draws else 0
    raise DivergenceError(
        f"{type(kernel).__name__} diverged at step {step}: {cause}. The {number} draws kept "
        "before it are in this error's .draws and in kernel.get_draws()",
        step=step,
        draws=draws,
        sample_stats=kept.sample_stats(),
        cause=cause,
    )
