"""One chain of a kernel, from ``setup`` to ``cleanup``: the run-time state it owns.

A kernel holds its hyperparameters (a frozen record) and, while a chain runs, one
:class:`ChainRun`: the model as the chain sees it, its minibatches, its
:class:`~pyro_bdl.inference.sgmcmc.state.ChainState` (what a step reads and changes, and
a checkpoint saves), the last step's :class:`~pyro_bdl.inference.sgmcmc.state.StepInfo`,
the kept draws and the device reads in flight. :func:`start` makes it from the model's
arguments; :func:`check` judges the chain when it ends. Under
``torchrun``, outside :class:`~pyro_bdl.inference.Chains`, every rank steps the same chain
on its shard of the data (``data_parallel``): rank 0's start, averaged gradients, rank 0's
noise.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import torch

from pyro_bdl import distributed
from pyro_bdl._offload import copied_to
from pyro_bdl.inference.minibatch import Minibatches
from pyro_bdl.inference.sgmcmc.checkpoint import Checkpoint, chain_number
from pyro_bdl.inference.sgmcmc.convergence import FunctionSpaceMonitor, convergence_warning
from pyro_bdl.inference.sgmcmc.device import LaggedRead, Noise
from pyro_bdl.inference.sgmcmc.equilibrium import excursion_warning
from pyro_bdl.inference.sgmcmc.kept import KeptDraws
from pyro_bdl.inference.sgmcmc.recovery import Recovery, Sentinel
from pyro_bdl.inference.sgmcmc.state import ChainState, StepInfo
from pyro_bdl.inference.sgmcmc.target import Target, model_target, placed_like
from pyro_bdl.inference.sgmcmc.warmup import new_adaptation

__all__ = ["ChainRun", "NOISY", "check", "start"]

#: Minibatch gradient noise, relative to the gradients' signal, from which the advice
#: on draws that have not converged names the noise as what held the step size down (at
#: 1 it at least halves SGLD's step).
NOISY = 1.0


@dataclass(eq=False)
class ChainRun:
    """The run-time state of one chain.

    :ivar target: the model as the chain sees it (:mod:`~pyro_bdl.inference.sgmcmc.target`).
    :ivar batches: the model's arguments, a fresh minibatch per step.
    :ivar int warmup_steps: the chain's warm-up iterations.
    :ivar int num_data: N, from the kernel or the model's ``bdl.observe`` site.
    :ivar bool data_parallel: one chain stepped by every rank of a ``torchrun`` job.
    :ivar dict initial_params: the chain's start (unconstrained values).
    :ivar state: the :class:`~pyro_bdl.inference.sgmcmc.state.ChainState`.
    :ivar kept: the ``KeptDraws`` (:mod:`~pyro_bdl.inference.sgmcmc.kept`).
    :ivar info: the last step's :class:`~pyro_bdl.inference.sgmcmc.state.StepInfo`.
    :ivar dict returned: what the last ``sample`` returned to Pyro.
    :ivar noise: the chain's ``Noise`` (:mod:`~pyro_bdl.inference.sgmcmc.device`), made at
        its first draw (none at temperature 0).
    :ivar watch: the potential energies in flight (a ``LaggedRead``).
    :ivar sentinel: the judge of the chain's reads that tells a divergence from noise
        (:mod:`~pyro_bdl.inference.sgmcmc.recovery`).
    :ivar recovery: while the step size adapts in warm-up, the ``Recovery`` that sets
        the chain back from a divergence; None otherwise.
    :ivar list recoveries: the warm-up steps at which the chain was set back.
    :ivar bool checked: whether the finished chain was judged already.
    :ivar int dimension: the number of unconstrained parameters.
    """

    target: Target
    batches: Minibatches
    warmup_steps: int
    num_data: int
    data_parallel: bool
    initial_params: dict[str, torch.Tensor]
    state: ChainState | None = None
    kept: KeptDraws | None = None
    info: StepInfo | None = None
    returned: dict[str, torch.Tensor] | None = None
    noise: Noise | None = None
    watch: LaggedRead = field(default_factory=LaggedRead)
    sentinel: Sentinel | None = None
    recovery: Recovery | None = None
    recoveries: list[int] = field(default_factory=list)
    checked: bool = False
    dimension: int = 0

    def end_warmup(self) -> None:
        """Warm-up is over: its copy of a sane state goes, and the draws' energies (their
        potential a different sum than the steps', see
        :mod:`~pyro_bdl.inference.sgmcmc.step`) are judged among themselves."""
        self.recovery = None
        self.sentinel.forget_energies()

    def adopt(self, params: dict[str, torch.Tensor]) -> None:
        """Take parameter values that did not come from the chain's last step."""
        if params is self.returned:
            return
        with torch.no_grad():
            for name, theta in self.state.params.items():
                value = params.get(name)
                if value is not None and value is not theta:
                    theta.copy_(value)

    def replay(self, store: Checkpoint, function_monitor: FunctionSpaceMonitor | None) -> None:
        """Return the draw a resumed chain kept before (the checkpoint's), following it in
        the convergence checks as if it were drawn again."""
        iteration = self.state.iteration
        self.returned = store.replay(iteration)
        if iteration >= self.warmup_steps:
            self.kept.monitor.add(self.kept.monitor.coordinates(self.returned).tolist())
            if function_monitor is not None:
                function_monitor.add(self.returned)

    def constrained_values(self, device: str | torch.device | None = None) -> dict:
        """A detached copy of the current values of every site, in its support, on
        ``device`` (default: where the parameters are; to the CPU one transfer per dtype)."""
        with torch.no_grad():
            values = {
                name: self.target.constrain(name, z).detach()
                for name, z in self.state.params.items()
            }
            if device is None:
                return {name: value.clone() for name, value in values.items()}
            return copied_to(values, torch.device(device))

    def standard_normal(self) -> list[torch.Tensor]:
        """Fresh N(0, I) noise shaped like the parameters (rank 0's when data-parallel)."""
        if self.noise is None:
            self.noise = Noise(self.state.theta, self.data_parallel)
        return self.noise.draw()


def start(kernel, warmup_steps: int, args: tuple, kwargs: dict, given: dict | None) -> ChainRun:
    """Set up a chain of ``kernel`` on the model's arguments (Pyro's ``setup``).

    :param kernel: the :class:`~pyro_bdl.inference.sgmcmc.base.SGMCMCKernel`; its
        ``run`` is set to the new chain before the checkpoint opens (which reads it).
    :param int warmup_steps: the warm-up iterations.
    :param dict given: ``initial_params`` that Pyro set, or None.
    """
    hyper = kernel.hyper
    batches = Minibatches(args, kwargs)
    target, num_data = model_target(
        kernel.model,
        batches.peek(),
        kernel.init_params,
        num_data=hyper.num_data,
        full_batch=not batches.has_loaders,
        kernel=type(kernel).__name__,
    )
    # Pyro's MCMC stores unconstrained values and applies transforms[name].inv.
    prototype = {
        name: target.unconstrain(name, site["value"].detach())
        for name, site in target.sites.items()
    }
    initial = prototype if given is None else placed_like(given, prototype, "initial_params")
    theta = [initial[name].detach().clone().requires_grad_(True) for name in target.sites]
    data_parallel = kernel._chain_id is None and distributed.is_distributed()
    if data_parallel:
        distributed.broadcast_(theta)
    run = kernel.run = ChainRun(target, batches, warmup_steps, num_data, data_parallel, initial)
    run.returned = initial
    run.dimension = sum(t.numel() for t in theta)
    run.state = state = kernel.init(dict(zip(target.sites, theta)))
    state.adaptation = new_adaptation(hyper, theta, warmup_steps, num_data, data_parallel)
    state.scale = None if state.adaptation is None else state.adaptation.unit_scale
    run.sentinel = Sentinel(hyper.target_excess)
    if state.adaptation is not None and hyper.adapt_step_size:
        run.recovery = Recovery(state, run.sentinel)
        run.recoveries = run.recovery.steps
    chain = chain_number(kernel._chain_id)
    store = None if kernel.checkpoint is None else Checkpoint(kernel.checkpoint, kernel, chain)
    run.kept = KeptDraws(kernel.stat_names(), state.params, store, kernel.keep_draws)
    if hyper.temperature > 0:  # at T = 0 the draws are an optimiser's, not to be judged
        probe = batches.peek() if kernel.probe is None else (kernel.probe, {})
        kernel.function_monitor = FunctionSpaceMonitor.for_chain(
            kernel.function_monitor, kernel._chain_id, target, probe
        )
    return run


def check(kernel) -> None:
    """Warn once per chain of ``kernel`` if its draws are off the stationary law (the
    method's equilibrium and the adaptation's warnings) or have not converged (not at
    temperature 0, where the chain is an optimiser whose draws are not meant to mix).
    Called from the kernel's ``diagnostics`` and ``cleanup`` (a chain whose set-up
    failed has nothing to judge)."""
    run = kernel.run
    if run is None or run.checked or run.kept is None:
        return
    run.checked = True
    name = type(kernel).__name__
    adaptation = run.state.adaptation
    warmup = adaptation and adaptation.warning()
    found = (
        kernel.equilibrium_warning(),
        excursion_warning(run.kept.stats, kernel.temperature),
        warmup,
    )
    message = "; ".join(m for m in found if m)
    if message:
        warnings.warn(f"{name}: {message}", RuntimeWarning, stacklevel=3)
    if kernel.temperature == 0:
        return
    converged = convergence_warning(run.kept.monitor, kernel.function_monitor)
    if converged is not None:
        message, category = converged
        if category is RuntimeWarning:
            message += f"; {_convergence_advice(kernel, warmup)}"
        warnings.warn(f"{name}: {message}", category, stacklevel=3)


def _convergence_advice(kernel, warmup: str | None) -> str:
    """What to do about draws that have not converged, after the warm-up's own warning
    ``warmup`` (whose cause and remedy come first)."""
    if warmup:
        return "warm-up had not converged: see its warning for the cause and what to do"
    noisy = _noise_advice(kernel)
    advice = (
        "keep more draws (num_samples, or a larger thin) and run more warmup_steps, and "
        "check the traces (bdl.to_arviz and bdl.diagnostics.summary)"
    )
    if noisy is not None:
        return f"{noisy}; or {advice}"
    if kernel.run.state.adaptation is None or not kernel.adapt_step_size:
        advice += (
            f"; the step size {kernel.current_step_size():.3g} was not adapted: let "
            "warm-up adapt it (adapt_step_size=True and adapt_mass_matrix=True, Pyro's "
            "defaults, with warmup_steps > 0)"
        )
    return advice


def _noise_advice(kernel) -> str | None:
    """The cause and the remedy when warm-up held the step size down against minibatch
    gradient noise at least as large as the gradients' signal (``NOISY``), or None.

    The noise heats the chain as a larger step would, so the step-size adaptation keeps
    the step small enough for the heat, about ``1 + noise`` times smaller than full
    batches allow for SGLD (its square root for SGHMC and SGNHT; on posteriordb's
    earnings and nes regressions with batches of 100, the full-batch steps were larger
    by 1.1 - 1.6 times that factor, and by 0.3 times it on earnings-logearn_interaction_z,
    whose stiffness limits the full-batch step too), and the chain moves about as many times
    more slowly: more draws at the same batch cost as many times more steps. The noise
    of batches of B of N data is about proportional to ``N / B - 1``, so the batch that
    brings it down to the signal's level is named.
    """
    run = kernel.run
    noise = kernel.gradient_noise if kernel.adapt_step_size else None
    if noise is None or noise < NOISY or not run.batches.has_loaders:
        return None
    num_data, per_epoch_now = run.num_data, run.batches.batches_per_epoch
    batch = num_data / per_epoch_now
    ratio = per_epoch_now - 1  # N / B - 1: the noise per unit of the per-datum gradients' spread
    if ratio < NOISY:  # batches this large are not what heats the chain
        return None
    # The batch B' with noise * (N / B' - 1) / ratio = NOISY, rounded up to equal
    # batches: a last batch much smaller than the others brings its own noise (one of 20
    # after two of 586 left SGLD's step smaller than batches of 100 did on posteriordb's
    # earnings).
    per_epoch = math.floor(1 + ratio * NOISY / noise)
    size = math.ceil(num_data / per_epoch)
    slower = (1 + noise) ** kernel.hyper.step_exponent
    remedy = (
        "batches of the whole data set remove it"
        if per_epoch == 1
        else f"batches of {size}, {per_epoch} of about equal size an epoch, bring it to the "
        "signal's level or below, the whole data set removes it"
    )
    return (
        f"minibatch gradient noise held the step size down: after warm-up the gradients "
        f"carried noise {noise:.3g} times their signal (batches of about {batch:.0f} of the "
        f"{num_data} data), which heats the chain as a larger step would, so the step-size "
        f"adaptation keeps the step (here {kernel.current_step_size():.3g}) about "
        f"{slower:.2g}-fold below what full batches allow, and the chain moves about as "
        "many times more slowly; pass larger batches (the noise falls "
        f"about as N / batch - 1: {remedy})"
    )
