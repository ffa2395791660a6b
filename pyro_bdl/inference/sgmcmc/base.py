r"""The tempered stochastic-gradient MCMC step that SGLD, SGHMC and SGNHT share.

Every kernel here simulates an SDE whose stationary law is the tempered posterior
:math:`p(\theta \mid y_{1:N})^{1/T}` (Appendix B of the posteriors paper, with the
user temperature :math:`T = N \mathcal{T}`). One step:

1. replaces each DataLoader argument of the model by its next minibatch;
2. evaluates the minibatch log joint
   :math:`\log p(\theta) + \frac{N}{B}\sum_{i \in \text{batch}} \log p(y_i \mid \theta)`
   and its gradient :math:`g` in one forward and backward pass of the model;
3. applies the method's update in place with fused ``torch._foreach_*`` operations,
   drawing Gaussian noise only when :math:`T > 0`.

The kernels are Pyro :class:`~pyro.infer.mcmc.mcmc_kernel.MCMCKernel`\ s, so
``pyro.infer.MCMC`` drives them; warm-up steps, thinning, per-draw sample statistics,
divergence handling and checkpoints live here once. The chain's state is a
:class:`~pyro_bdl.inference.sgmcmc.state.ChainState` and each step reports a
:class:`~pyro_bdl.inference.sgmcmc.state.StepInfo`; the model's side (unconstrained
sites, log joint and gradient) is :mod:`~pyro_bdl.inference.sgmcmc.target`, the
diagnosis of a divergence :mod:`~pyro_bdl.inference.sgmcmc.divergence`, the lagged
device reads and the shared noise :mod:`~pyro_bdl.inference.sgmcmc.device`.

Under ``torchrun`` (a process group of W ranks) a kernel that ``pyro.infer.MCMC`` runs is
data-parallel: every rank starts from rank 0's values, steps on its shard of a
``DistributedSampler`` DataLoader, and the log joint and its gradient are averaged across
ranks before the update (each rank's is scaled N / B_local, so their mean is the global
batch's), and the noise is rank 0's draw: the chain is the one a single process runs with
the global batch. :class:`~pyro_bdl.inference.Chains` instead runs whole chains per rank.

**No device sync per step.** The potential energy stays on the device. A step reads
one scalar, its potential, to stop a diverging chain: on the CPU at once (a read costs
nothing there), on a GPU one step late, from a copy queued into pinned memory right
after the potential was computed, so the read never waits for the work queued since.
"Promptly" therefore means: before the update of the step whose potential is
non-finite on the CPU, before the update of the next step on a GPU, and in every case
before a draw is kept, so no non-finite draw is ever kept. The statistics of a kept
draw (potential, gradient norm, kinetic temperature) are read together, once per kept
draw.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from pyro.infer.mcmc.mcmc_kernel import MCMCKernel

from pyro_bdl import distributed
from pyro_bdl._checks import function, instance, integer, real
from pyro_bdl._offload import copied_to
from pyro_bdl.inference.minibatch import Minibatches
from pyro_bdl.inference.sgmcmc.adaptation import DEFAULT_TARGET_EXCESS, Adaptation
from pyro_bdl.inference.sgmcmc.checkpoint import Checkpoint, chain_number
from pyro_bdl.inference.sgmcmc.convergence import FunctionSpaceMonitor, convergence_warning
from pyro_bdl.inference.sgmcmc.dense import (
    DRIFT_TOLERANCE,
    DenseAdaptation,
    dense_by_default,
    largest_curvature,
    one_device,
)
from pyro_bdl.inference.sgmcmc.device import LaggedRead, Noise, norm
from pyro_bdl.inference.sgmcmc.divergence import DivergenceError, describe_start, diagnose
from pyro_bdl.inference.sgmcmc.kept import KeptDraws
from pyro_bdl.inference.sgmcmc.schedules import Constant
from pyro_bdl.inference.sgmcmc.state import ChainState, StepInfo
from pyro_bdl.inference.sgmcmc.target import checked_init_params, model_target, placed_like

__all__ = ["SGMCMCKernel", "DivergenceError"]


class SGMCMCKernel(MCMCKernel):
    """Base class of the tempered SGMCMC kernels; subclasses define one update.

    A subclass implements ``_new_state`` (its
    :class:`~pyro_bdl.inference.sgmcmc.state.ChainState`, with auxiliary variables such
    as momenta listed in its ``SAVED`` for checkpoints) and ``_update`` (the in-place
    step given the gradient). The chain's state is ``kernel.state``, the last step's
    :class:`~pyro_bdl.inference.sgmcmc.state.StepInfo` is ``kernel.info``.

    :param callable model: a Pyro model; DataLoader arguments of ``MCMC.run`` are
        replaced by a fresh minibatch at every step.
    :param float step_size: the step size :math:`\\epsilon` (positive); with
        ``adapt_step_size`` only where adaptation starts, and optional (see
        :mod:`~pyro_bdl.inference.sgmcmc.adaptation`).
    :param float temperature: :math:`T \\ge 0`; 1 is the Bayesian posterior, 0 is
        optimisation.
    :param bool adapt_step_size: tune the step size during warm-up (Pyro's name; a
        statistic of the chain's variance excess that minibatch gradients estimate).
    :param bool adapt_mass_matrix: learn a diagonal mass (preconditioner) from the
        squared gradients during warm-up (Pyro's name). Nothing adapts at
        ``temperature=0``, with ``warmup_steps=0`` or with both flags False: the kernel
        is then the fixed one, step for step.
    :param bool dense_mass: adapt a dense mass (Stan's ``dense_e``, Pyro's
        ``full_mass``) from the positions and gradients of the warm-up's windows (see
        :mod:`~pyro_bdl.inference.sgmcmc.dense`) instead of the diagonal one; by default
        (None) dense for models of at most ``DENSE_MAX_DIMENSION`` (200) unconstrained
        parameters, where strongly correlated posteriors are common and a
        :math:`d \\times d` matrix costs nothing, diagonal beyond (networks).
    :param float target_excess: the relative excess of the stationary position
        variance, from discretisation and gradient noise, that the step size is tuned
        to (default 0.1).
    :param int num_data: the data-set size N (default: the ``num_data`` of the model's
        ``bdl.observe`` site; a model whose batch is the whole data set needs neither).
    :param int thin: kernel steps per kept draw (after warm-up; each warm-up iteration
        is one step).
    :param callable schedule: ``t -> multiplier`` of the step size, see
        :mod:`~pyro_bdl.inference.sgmcmc.schedules`.
    :param init_params: where the chain starts: None (the module's current weights for
        sites made by :func:`~pyro_bdl.lift`, a feasible point otherwise, see
        :func:`~pyro_bdl.init_to_module`), a dict of site values, or a Pyro init
        strategy such as ``init_to_sample``.
    :param checkpoint: a directory; every kept draw and the chain's state are written
        there, and a run started with the same directory resumes where it stopped.
    :param int checkpoint_every: during warm-up, steps between state checkpoints.
    :param bool keep_draws: keep the draws in the kernel too, on the CPU (they are what
        :class:`DivergenceError` returns; the default); with a checkpoint they are
        read back from disk instead and never held twice in memory.
    :param tuple probe: the model's positional arguments on a fixed batch of inputs
        (e.g. ``((x_probe, y_probe), num_data)``) whose outputs the end-of-run check of a
        lifted network follows in function space (see
        :mod:`~pyro_bdl.inference.sgmcmc.convergence`); by default the first minibatch of
        the run's first chain, kept for its later chains.
    """

    def __init__(
        self,
        model: Callable,
        step_size: float | None = None,
        temperature: float = 1.0,
        *,
        adapt_step_size: bool = True,
        adapt_mass_matrix: bool = True,
        dense_mass: bool | None = None,
        target_excess: float = DEFAULT_TARGET_EXCESS,
        num_data: int | None = None,
        thin: int = 1,
        schedule: Callable[[int], float] | None = None,
        init_params: Mapping[str, torch.Tensor] | Callable | None = None,
        checkpoint: str | Path | None = None,
        checkpoint_every: int = 100,
        keep_draws: bool = True,
        probe: tuple | None = None,
    ):
        self.model = function("model", model, "a callable Pyro model")
        self.temperature = real("temperature", temperature, non_negative=True)
        self.adapt_step_size = instance("adapt_step_size", adapt_step_size, bool, "True or False")
        self.adapt_mass_matrix = instance(
            "adapt_mass_matrix", adapt_mass_matrix, bool, "True or False"
        )
        if dense_mass is not None:
            instance("dense_mass", dense_mass, bool, "True, False or None (by dimension)")
        self.dense_mass = dense_mass
        self.target_excess = real("target_excess", target_excess, positive=True, high=1.0)
        if step_size is None:
            if not adapt_step_size:
                raise ValueError(
                    "step_size: none given and adapt_step_size=False; give a step size, or "
                    "leave adapt_step_size=True to tune it during warm-up"
                )
            if self.temperature == 0:
                raise ValueError(
                    "step_size: none given at temperature 0, where the kernel is an optimiser "
                    "and nothing is adapted (adaptation targets the tempered posterior, "
                    "T > 0); give the learning rate as step_size"
                )
        self.step_size = None if step_size is None else real("step_size", step_size, positive=True)
        self._num_data_arg = None if num_data is None else integer("num_data", num_data, low=1)
        self.thin = integer("thin", thin, low=1)
        if schedule is not None:
            function("schedule", schedule, "a callable t -> step-size multiplier")
        self.schedule = schedule or Constant()
        self.init_params = checked_init_params(init_params)
        if checkpoint is not None:
            instance("checkpoint", checkpoint, (str, Path), "a directory path (str or Path)")
        self.checkpoint = Path(checkpoint) if checkpoint is not None else None
        self.checkpoint_every = integer("checkpoint_every", checkpoint_every, low=1)
        self.keep_draws = instance("keep_draws", keep_draws, bool, "True or False")
        if probe is not None:
            instance("probe", probe, tuple, "a tuple of the model's arguments on a batch")
        self.probe = probe
        self.function_monitor: FunctionSpaceMonitor | None = None  # across a run's chains
        self.transforms = None
        self._initial_params = None
        self._initial_params_given = False
        self._chain_id: int | None = None  # set by Chains; else the chain MCMC starts
        # what setup sets per chain; cleanup after a setup that failed finds no chain
        self.state: ChainState | None = None
        self.info: StepInfo | None = None  # the last step's
        self.kept: KeptDraws | None = None
        self._chain_checked = True

    # -- hyperparameters -------------------------------------------------------------

    def hyperparameters(self) -> dict:
        """The kernel's settings, JSON-serialisable (for ArviZ attributes and checkpoints)."""
        return {
            "method": type(self).__name__,
            "step_size": self.step_size,
            "adapt_step_size": self.adapt_step_size,
            "adapt_mass_matrix": self.adapt_mass_matrix,
            "dense_mass": self.dense_mass,
            "target_excess": self.target_excess,
            "temperature": self.temperature,
            "num_data": self.num_data if self.transforms is not None else self._num_data_arg,
            "thin": self.thin,
            "schedule": repr(self.schedule),
        }

    # -- Pyro's MCMCKernel interface -------------------------------------------------

    @property
    def initial_params(self) -> dict[str, torch.Tensor]:
        return self._initial_params

    @initial_params.setter
    def initial_params(self, params: dict[str, torch.Tensor]) -> None:
        self._initial_params = params
        self._initial_params_given = True

    def setup(self, warmup_steps: int, *args, **kwargs) -> None:
        self._warmup_steps = warmup_steps
        self._batches = Minibatches(args, kwargs)
        target, self.num_data = model_target(
            self.model,
            self._batches.peek(),
            self.init_params,
            num_data=self._num_data_arg,
            full_batch=not self._batches.has_loaders,
            kernel=type(self).__name__,
        )
        self.target = target
        # Pyro's MCMC stores unconstrained values and applies transforms[name].inv.
        self.transforms = target.transforms
        prototype = {
            name: target.unconstrain(name, site["value"].detach())
            for name, site in target.sites.items()
        }
        if self._initial_params_given:
            self._initial_params = placed_like(self._initial_params, prototype, "initial_params")
        else:
            self._initial_params = prototype
        theta = [
            self._initial_params[name].detach().clone().requires_grad_(True)
            for name in target.sites
        ]
        # Under torchrun, outside Chains, every rank steps the same chain on its shard of
        # the data: rank 0's start, averaged gradients, rank 0's noise.
        self._data_parallel = self._chain_id is None and distributed.is_distributed()
        if self._data_parallel:
            distributed.broadcast_(theta)
        self._initial_params_given = False
        self._returned = self._initial_params
        self._noise = None
        self.dimension = sum(t.numel() for t in theta)
        self.state = state = self._new_state(dict(zip(target.sites, theta)))
        state.adaptation = self._new_adaptation(warmup_steps)
        # a dense mass moves the chain in whitened coordinates with the unit-mass update
        dense = isinstance(state.adaptation, DenseAdaptation)
        state.scale = None if state.adaptation is None or dense else state.adaptation.scale
        self.info = None
        self._watch = LaggedRead()
        chain = chain_number(self._chain_id)
        store = None if self.checkpoint is None else Checkpoint(self.checkpoint, self, chain)
        self.kept = KeptDraws(self._stat_names(), state.params, store, self.keep_draws)
        if self.temperature > 0:  # at T = 0 the draws are an optimiser's, not to be judged
            probe = self._batches.peek() if self.probe is None else (self.probe, {})
            self.function_monitor = FunctionSpaceMonitor.for_chain(
                self.function_monitor, self._chain_id, target, probe
            )
        self._chain_checked = False

    def sample(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        state, store = self.state, self.kept.checkpoint
        if store is not None and store.replaying(state.iteration):
            self._returned = store.replay(state.iteration)
            if state.iteration >= self._warmup_steps:
                monitor = self.kept.monitor
                monitor.add(monitor.coordinates(self._returned).tolist())
                if self.function_monitor is not None:
                    self.function_monitor.add(self._returned)
        else:
            self._adopt(params)
            if state.iteration == self._warmup_steps:
                if state.adaptation is not None:
                    state.adaptation.finish()
                self._end_warmup()
            warmup = state.iteration < self._warmup_steps
            for inner in range(1 if warmup else self.thin):
                self._step_once(record=not warmup and inner == self.thin - 1)
            if not warmup:
                self._keep_draw()
            elif store is not None and (state.iteration + 1) % self.checkpoint_every == 0:
                store.save_state(state.iteration + 1)
            self._returned = state.current
        state.iteration += 1
        return self._returned

    def logging(self) -> dict:
        """The progress bar's figures: the step size and ``lp``, the minibatch log
        likelihood plus the priors that are not isotropic normals, at the last step read.
        The isotropic normal priors' value is left out to keep a pass over the weights out
        of every step; the sample statistic ``potential_energy`` of each kept draw is the
        whole (negative) minibatch log joint."""
        step_size = self.info.step_size if self.info else self.step_size or math.nan
        return {
            "step_size": f"{step_size:.2e}",
            "lp": f"{-self.state.potential_energy:.4g}",
        }

    def diagnostics(self) -> dict:
        # Pyro asks once, when the chain has finished: the time to judge its equilibrium.
        if self.state.iteration <= self._warmup_steps:  # the earliest a kernel can tell
            raise ValueError(
                "num_samples=0: MCMC kept no draw after its warm-up, and pyro.infer.MCMC "
                "cannot return zero draws; pass num_samples >= 1 (num_samples=1 keeps the "
                "state the warm-up ends at)"
            )
        self._check_chain()
        return {"sample_stats": self.kept.sample_stats()}

    def cleanup(self) -> None:
        self._check_chain()
        # Pyro now holds its own copy of every draw; drop ours unless they are on disk.
        if self.kept is not None:
            self.kept.release()

    # -- what subclasses define ------------------------------------------------------

    def _new_state(self, params: dict[str, torch.Tensor]) -> ChainState:
        """The chain's state at its start: the parameters and the method's auxiliary
        variables (momenta, thermostat)."""
        return ChainState(params)

    def _end_warmup(self) -> None:
        """Called once, before the first step after warm-up (auxiliary-variable refresh)."""

    def _update(self, theta: list[torch.Tensor], grads: list[torch.Tensor], step_size: float):
        """Update ``theta`` and the auxiliary variables in place, given the gradient."""
        raise NotImplementedError

    def _extra_stats(self) -> dict[str, torch.Tensor | float]:
        """Method-specific statistics of the current state (device scalars), recorded
        with each kept draw."""
        return {}

    def _equilibrium_warning(self) -> str | None:
        """A sentence saying the finished chain is off its stationary law, or None."""
        return None

    # The chain's step count, its statistics and its checkpoint by their former names.

    @property
    def _step(self) -> int:
        return self.state.step

    @property
    def _stats(self) -> dict[str, list[float]]:
        return self.kept.stats

    @property
    def _store(self) -> Checkpoint | None:
        return None if self.kept is None else self.kept.checkpoint

    # -- the shared step -------------------------------------------------------------

    def current_step_size(self) -> float:
        """The step size of the next kernel step: the given or adapted one, after the
        schedule."""
        state = self.state
        multiplier = self.schedule(state.step)
        if type(multiplier) is not float or not 0 < multiplier < math.inf:
            multiplier = self._checked_multiplier(multiplier)
        adaptation = state.adaptation
        base = self.step_size if adaptation is None else adaptation.step_size
        return base * multiplier

    @property
    def adapted_step_size(self) -> float | None:
        """The step size the chain runs with after warm-up (None before set-up, or while
        it is still to be found from the first gradient)."""
        adaptation = None if self.state is None else self.state.adaptation
        return self.step_size if adaptation is None else adaptation.step_size

    @property
    def stiffness(self) -> float | None:
        """How much stiffer than the average (after the mass) the stiffest direction
        found in warm-up is; the kept step size was lowered for it when above 1 (see
        :mod:`~pyro_bdl.inference.sgmcmc.stiffness`). None without step-size adaptation."""
        adaptation = None if self.state is None else self.state.adaptation
        return None if adaptation is None or not self.adapt_step_size else adaptation.stiffness

    @property
    def inverse_mass_matrix(self) -> dict[str, torch.Tensor] | None:
        """The diagonal of the adapted inverse mass :math:`D^{-1}` per site, shaped like
        the site's unconstrained value (None when the mass is not adapted): the
        preconditioner of SGLD, the inverse mass of SGHMC and SGNHT over ``mass``. With a
        dense mass, one entry keyed by the tuple of every site's name (as Pyro's HMC
        keys a ``full_mass`` group): the :math:`d \\times d` matrix over the sites'
        flattened values in order."""
        if isinstance(self._adaptation, DenseAdaptation):
            return {tuple(self.state.params): self._adaptation.inverse_mass_matrix}
        if self.state is None or self.state.scale is None:
            return None
        return {name: s.square() for name, s in zip(self.state.params, self.state.scale)}

    @property
    def _adaptation(self) -> Adaptation | None:
        return None if self.state is None else self.state.adaptation

    # -- warm-up adaptation ----------------------------------------------------------

    def _new_adaptation(self, warmup_steps: int) -> Adaptation | None:
        flags = self.adapt_step_size or self.adapt_mass_matrix
        if warmup_steps == 0 or self.temperature == 0 or not flags:
            if self.step_size is None:
                raise ValueError(
                    "step_size: none given, and with warmup_steps=0 nothing is adapted; give "
                    "a step size, or warm-up steps in which to find one"
                )
            return None
        settings = dict(
            adapt_step_size=self.adapt_step_size,
            adapt_mass_matrix=self.adapt_mass_matrix,
            target_excess=self.target_excess,
            scale=self.num_data * self.temperature,
            start=2 * self.target_excess,
            step_exponent=self._step_exponent,
            max_step_size=self._max_adapted_step_size(),
            relaxation=self._relaxation_rate(),
            data_parallel=self._data_parallel,
        )
        theta = self.state.theta
        dense = dense_by_default(theta) if self.dense_mass is None else self.dense_mass
        if dense and not one_device(theta):
            raise ValueError(
                "dense_mass=True needs the model's unconstrained parameters on one device; "
                "move the model's sites to one device, or pass dense_mass=False"
            )
        if dense and self.adapt_mass_matrix:
            return DenseAdaptation(
                theta,
                warmup_steps,
                self.step_size,
                num_data=self.num_data,
                temperature=self.temperature,
                **settings,
            )
        return Adaptation(theta, warmup_steps, self.step_size, **settings)

    #: The step size scales as (mass / curvature) to this power (SGLD: 1).
    _step_exponent = 1.0

    def _max_adapted_step_size(self) -> float:
        """The largest step size adaptation may try, in mass-adapted units."""
        return 1.0 if self.adapt_mass_matrix else math.inf

    def _relaxation_rate(self) -> float:
        """The rate (per unit of time) at which the adaptation statistic forgets its past."""
        return math.inf

    def _adaptation_statistic(self, step_size: float) -> torch.Tensor:
        """The excess of the position variance that this step shows (a device scalar),
        after the update; see :mod:`~pyro_bdl.inference.sgmcmc.adaptation`."""
        raise NotImplementedError

    def _refresh(self) -> None:
        """Draw the auxiliary variables afresh at the start of an adaptation window."""

    def _checked_multiplier(self, multiplier: object) -> float:
        step = self.state.step
        try:
            value = float(multiplier)
        except (TypeError, ValueError):
            raise TypeError(
                f"schedule must return a number (a step-size multiplier), returned "
                f"{type(multiplier).__name__} {multiplier!r} at step {step}"
            ) from None
        if not 0 < value < math.inf:
            self._stop(
                step,
                f"the step-size schedule {self.schedule!r} (a hyperparameter) returned the "
                f"multiplier {value} at step {step}; it must be positive and finite",
            )
        return value

    def _step_once(self, record: bool) -> None:
        state = self.state
        batch = args, kwargs = self._batches.next()
        with torch.enable_grad():
            log_joint, grads = self.target.log_joint_and_grad(
                state.params, args, kwargs, average=self._data_parallel
            )
        state.adapting = adapting = (
            state.adaptation is not None and state.iteration < self._warmup_steps
        )
        if adapting:
            if state.step == 0 and isinstance(state.adaptation, DenseAdaptation):

                def gradient_at(params: dict) -> list[torch.Tensor]:
                    with torch.enable_grad():
                        _, moved = self.target.log_joint_and_grad(
                            params, args, kwargs, average=self._data_parallel
                        )
                    return moved

                state.adaptation.start(largest_curvature(gradient_at, state.params, grads))
            state.adaptation.observe_gradient(grads)
        info = StepInfo(state.step, batch, self.current_step_size())
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
            adaptation = state.adaptation
            if isinstance(adaptation, DenseAdaptation):
                # the unit-mass update of z = L^{-1} theta, then theta += L (z' - z)
                whitened = adaptation.whiten(grads, clip=adapting)
                self._update(adaptation.displacement(), whitened, info.step_size)
                adaptation.move(state.theta)
            else:
                self._update(state.theta, grads, info.step_size)
            watched = potential
            if adapting and self.adapt_step_size:
                # The statistic travels with the potential: still one read per step.
                statistic = self._adaptation_statistic(info.step_size)
                watched = torch.stack([torch.as_tensor(potential).to(statistic), statistic])
        ready = self._watch.push(watched, info)
        if ready is not None:
            self._check_potential(*ready)
        if adapting and state.adaptation.end_step(state.iteration):
            with torch.no_grad():
                self._refresh()
        state.step += 1
        self.info = info

    def _check_potential(self, value: float | list[float], info: StepInfo) -> None:
        if isinstance(value, list):
            value, statistic = value
            self.state.adaptation.observe_statistic(statistic, value)
        if not math.isfinite(value):
            self._diverged(info, f"the minibatch potential energy is {value}")
        self.state.potential_energy = value

    def standard_normal(self) -> list[torch.Tensor]:
        """Fresh N(0, I) noise shaped like the parameters: one draw into one flat buffer
        per dtype and device, viewed per parameter."""
        if self._noise is None:
            self._noise = Noise(self.state.theta, self._data_parallel)
        return self._noise.draw()

    # -- draws, statistics, divergence -----------------------------------------------

    def _stat_names(self) -> list[str]:
        return ["potential_energy", "step_size", "temperature", "grad_norm", *self._extra_stats()]

    def _keep_draw(self) -> None:
        state, info = self.state, self.info
        names = [*info.recorded, *self._extra_stats()]
        device_stats = {**info.recorded, **self._extra_stats()}
        # One read of the device per kept draw: the statistics, the largest |theta| and
        # the coordinates the convergence check follows.
        scalars = [torch.as_tensor(device_stats[key]).reshape(()) for key in names]
        largest = torch.stack(torch._foreach_norm(state.theta, ord=math.inf)).max()
        followed = self.kept.monitor.coordinates(state.params).to(largest)
        read = torch.cat([torch.stack([s.to(largest) for s in scalars] + [largest]), followed])
        read = read.tolist()
        self.kept.monitor.add(read[len(names) + 1 :])
        read = read[: len(names) + 1]
        stats = dict(zip(names, read))
        if not math.isfinite(read[-1]):
            bad = [name for name, t in state.params.items() if not bool(torch.isfinite(t).all())]
            self._diverged(info, f"parameter {bad[0]!r} has non-finite values")
        if not math.isfinite(stats["potential_energy"]):
            self._diverged(info, f"the potential energy is {stats['potential_energy']}")
        stats.update(step_size=info.step_size, temperature=self.temperature)
        if self.function_monitor is not None:  # one forward pass on the probe batch
            self.function_monitor.add(state.params)
        draw = functools.partial(self.constrained_values, device="cpu")
        self.kept.add(stats, draw, state.iteration - self._warmup_steps, state.iteration + 1)

    def constrained_values(
        self, device: str | torch.device | None = None
    ) -> dict[str, torch.Tensor]:
        """A detached copy of the current values of every site, in its support.

        :param device: where to put the copy (default: where the parameters are); a copy
            to the CPU is one transfer per dtype, not one per site.
        """
        with torch.no_grad():
            values = {
                name: self.target.constrain(name, z).detach()
                for name, z in self.state.params.items()
            }
            if device is None:
                return {name: value.clone() for name, value in values.items()}
            return copied_to(values, torch.device(device))

    def get_draws(self) -> dict[str, torch.Tensor]:
        """The draws kept so far by this kernel: name -> ``(num_draws, *shape)``, on the CPU."""
        return self.kept.draws()

    def _diverged(self, info: StepInfo, symptom: str) -> None:
        cause = diagnose(
            symptom,
            self.target,
            info.batch,
            self._initial_params,
            self.state.params,
            step=info.step,
            kernel=type(self).__name__,
            last_potential=self.state.potential_energy,
            step_size=self.current_step_size,
        )
        if info.step == 0:
            start = describe_start(self.target, self._initial_params, self.init_params)
            cause += f"; the chain started at {start}"
        self._stop(info.step, cause)

    def _stop(self, step: int, cause: str) -> None:
        draws = self.get_draws()
        kept = len(next(iter(draws.values()))) if draws else 0
        raise DivergenceError(
            f"{type(self).__name__} diverged at step {step}: {cause}. The {kept} draws kept "
            "before it are in this error's .draws and in kernel.get_draws()",
            step=step,
            draws=draws,
            sample_stats=self.kept.sample_stats(),
            cause=cause,
        )

    def _check_chain(self) -> None:
        """Warn once per chain if its draws are off the stationary law."""
        if self._chain_checked:
            return
        self._chain_checked = True
        message = self._equilibrium_warning()
        adaptation = self._adaptation
        if isinstance(adaptation, DenseAdaptation) and adaptation.drift > DRIFT_TOLERANCE:
            message = (f"{message}; " if message else "") + (
                f"warm-up had not converged when it fixed the dense mass: the means of the "
                f"halves of its last window differ by {adaptation.drift:.2g} posterior sds "
                f"(more than {DRIFT_TOLERANCE:g}); run more warmup_steps (the last window "
                "doubles with them)"
            )
        if message:
            warnings.warn(f"{type(self).__name__}: {message}", RuntimeWarning, stacklevel=3)
        # At T = 0 the chain is an optimiser: its draws are not meant to mix.
        if self.temperature == 0:
            return
        found = convergence_warning(self.kept.monitor, self.function_monitor)
        if found is not None:
            message, category = found
            if category is RuntimeWarning:
                message += f"; {self._convergence_advice()}"
            warnings.warn(f"{type(self).__name__}: {message}", category, stacklevel=3)

    def _convergence_advice(self) -> str:
        """What to do about draws that have not converged."""
        advice = (
            "keep more draws (num_samples, or a larger thin) and run more warmup_steps, and "
            "check the traces (bdl.to_arviz and bdl.diagnostics.summary)"
        )
        if self.state.adaptation is None or not self.adapt_step_size:
            advice += (
                f"; the step size {self.current_step_size():.3g} was not adapted: let "
                "warm-up adapt it (adapt_step_size=True and adapt_mass_matrix=True, Pyro's "
                "defaults, with warmup_steps > 0)"
            )
        return advice

    # -- initial values --------------------------------------------------------------

    def _adopt(self, params: dict[str, torch.Tensor]) -> None:
        """Take parameter values that did not come from this kernel's last step."""
        if params is self._returned:
            return
        with torch.no_grad():
            for name, theta in self.state.params.items():
                value = params.get(name)
                if value is not None and value is not theta:
                    theta.copy_(value)
