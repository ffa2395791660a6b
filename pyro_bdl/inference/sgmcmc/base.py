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
divergence handling and checkpoints live here once.

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

import math
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path

import pyro
import torch
from pyro.distributions.transforms import biject_to
from pyro.infer.autoguide.initialization import InitMessenger
from pyro.infer.mcmc.mcmc_kernel import MCMCKernel
from pyro.poutine.util import site_is_subsample

from pyro_bdl import distributed
from pyro_bdl._checks import function, instance, integer, is_real, real, site_keys
from pyro_bdl._draws import copied_to
from pyro_bdl.inference.log_joint import LogJoint, observed_num_data
from pyro_bdl.inference.minibatch import Minibatches
from pyro_bdl.inference.sgmcmc._buffers import FlatBuffers
from pyro_bdl.inference.sgmcmc.adaptation import DEFAULT_TARGET_EXCESS, Adaptation
from pyro_bdl.inference.sgmcmc.checkpoint import Checkpoint, chain_number
from pyro_bdl.inference.sgmcmc.convergence import ConvergenceMonitor
from pyro_bdl.inference.sgmcmc.schedules import Constant
from pyro_bdl.lift import init_to_module
from pyro_bdl.likelihoods import ObservationError, invalid_observations

__all__ = ["SGMCMCKernel", "DivergenceError"]


class DivergenceError(RuntimeError):
    """A chain produced a non-finite potential or parameter and was stopped.

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


class SGMCMCKernel(MCMCKernel):
    """Base class of the tempered SGMCMC kernels; subclasses define one update.

    A subclass implements ``_init_state`` (auxiliary variables such as momenta)
    and ``_update`` (the in-place step given the gradient), and lists its
    auxiliary tensors in ``_state`` for checkpoints.

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
    """

    def __init__(
        self,
        model: Callable,
        step_size: float | None = None,
        temperature: float = 1.0,
        *,
        adapt_step_size: bool = True,
        adapt_mass_matrix: bool = True,
        target_excess: float = DEFAULT_TARGET_EXCESS,
        num_data: int | None = None,
        thin: int = 1,
        schedule: Callable[[int], float] | None = None,
        init_params: Mapping[str, torch.Tensor] | Callable | None = None,
        checkpoint: str | Path | None = None,
        checkpoint_every: int = 100,
        keep_draws: bool = True,
    ):
        self.model = function("model", model, "a callable Pyro model")
        self.temperature = real("temperature", temperature, non_negative=True)
        self.adapt_step_size = instance("adapt_step_size", adapt_step_size, bool, "True or False")
        self.adapt_mass_matrix = instance(
            "adapt_mass_matrix", adapt_mass_matrix, bool, "True or False"
        )
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
        self.init_params = _checked_init_params(init_params)
        if checkpoint is not None:
            instance("checkpoint", checkpoint, (str, Path), "a directory path (str or Path)")
        self.checkpoint = Path(checkpoint) if checkpoint is not None else None
        self.checkpoint_every = integer("checkpoint_every", checkpoint_every, low=1)
        self.keep_draws = instance("keep_draws", keep_draws, bool, "True or False")
        self.transforms = None
        self._initial_params = None
        self._initial_params_given = False
        self._chain_id: int | None = None  # set by Chains; else the chain MCMC starts
        # what setup sets per chain; cleanup after a setup that failed finds no chain
        self._store, self._chain_checked = None, True

    # -- hyperparameters -------------------------------------------------------------

    def hyperparameters(self) -> dict:
        """The kernel's settings, JSON-serialisable (for ArviZ attributes and checkpoints)."""
        return {
            "method": type(self).__name__,
            "step_size": self.step_size,
            "adapt_step_size": self.adapt_step_size,
            "adapt_mass_matrix": self.adapt_mass_matrix,
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
        first_args, first_kwargs = self._batches.peek()
        trace = self._prototype_trace(first_args, first_kwargs)
        self._sites = {
            name: site
            for name, site in trace.nodes.items()
            if site["type"] == "sample" and not site["is_observed"] and not site_is_subsample(site)
        }
        if not self._sites:
            raise ValueError("the model has no latent sample sites for the kernel to sample")
        if isinstance(self.init_params, Mapping):
            site_keys("init_params", self.init_params, self._sites, "the model's latent sites")
        for name, site in self._sites.items():
            if site["fn"].support.is_discrete:
                raise ValueError(
                    f"site {name!r} is discrete; SGMCMC kernels need continuous latent sites"
                )
        self.num_data = observed_num_data(
            trace, self._num_data_arg, full_batch=not self._batches.has_loaders
        )
        if not _has_observations(trace):
            warnings.warn(
                f"{type(self).__name__}: the model has no observed site, so the kernel samples "
                f"the prior of {sorted(self._sites)}; condition on data with "
                "pyro.sample(..., obs=...) or bdl.observe(...) to sample a posterior",
                UserWarning,
                stacklevel=3,
            )
            self.num_data = self.num_data or 1
        if self.num_data is None:
            raise ValueError(
                "num_data: the model's likelihood declares no data-set size (no "
                "bdl.observe(..., num_data=N)); pass num_data=<size of the training set> "
                "to the kernel"
            )
        # Pyro's MCMC stores unconstrained values and applies transforms[name].inv.
        self._bijections = {
            name: biject_to(site["fn"].support)
            for name, site in self._sites.items()
            if not is_real(site["fn"].support)
        }
        self.transforms = {name: b.inv for name, b in self._bijections.items()}
        prototype = {
            name: self._unconstrain(name, site["value"].detach())
            for name, site in self._sites.items()
        }
        if self._initial_params_given:
            self._initial_params = _placed_like(self._initial_params, prototype, "initial_params")
        else:
            self._initial_params = prototype
        self._theta = [
            self._initial_params[name].detach().clone().requires_grad_(True) for name in self._sites
        ]
        self._params = dict(zip(self._sites, self._theta))
        # Under torchrun, outside Chains, every rank steps the same chain on its shard of
        # the data: rank 0's start, averaged gradients, rank 0's noise.
        self._data_parallel = self._chain_id is None and distributed.is_distributed()
        if self._data_parallel:
            distributed.broadcast_(self._theta)
        # Detached views of the parameters, made once: the updates are in place, so they
        # always show the current values, and Pyro gets them without a dict per step.
        self._current = {name: theta.detach() for name, theta in self._params.items()}
        self._initial_params_given = False
        self._returned = self._initial_params
        self._noise = None
        self._scale = None  # D^{-1/2} of an adapted diagonal mass, per parameter
        self.dimension = sum(t.numel() for t in self._theta)
        self._init_state(self._theta)
        self._adaptation = self._new_adaptation(warmup_steps)
        self._adapting = False
        self._step = 0
        self._iteration = 0
        self._last = {"potential_energy": math.nan, "step_size": self.step_size or math.nan}
        self._recorded: dict[str, torch.Tensor] = {}
        self._watch = _LaggedRead()
        self._previous_potential = math.nan
        self._stats: dict[str, list[float]] = {key: [] for key in self._stat_names()}
        self._draws: list[dict[str, torch.Tensor]] = []
        self._monitor = ConvergenceMonitor(self._params)
        self._chain_checked = False
        chain = chain_number(self._chain_id)
        self._store = None if self.checkpoint is None else Checkpoint(self.checkpoint, self, chain)

    def sample(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self._store is not None and self._store.replaying(self._iteration):
            self._returned = self._store.replay(self._iteration)
            if self._iteration >= self._warmup_steps:
                self._monitor.add(self._monitor.coordinates(self._returned).tolist())
        else:
            self._adopt(params)
            if self._iteration == self._warmup_steps:
                self._finish_adaptation()
                self._end_warmup()
            warmup = self._iteration < self._warmup_steps
            for inner in range(1 if warmup else self.thin):
                self._step_once(record=not warmup and inner == self.thin - 1)
            if not warmup:
                self._keep_draw()
            elif self._store is not None and (self._iteration + 1) % self.checkpoint_every == 0:
                self._store.save_state(self._iteration + 1)
            self._returned = self._current
        self._iteration += 1
        return self._returned

    def logging(self) -> dict:
        """The progress bar's figures: the step size and ``lp``, the minibatch log
        likelihood plus the priors that are not isotropic normals, at the last step read.
        The isotropic normal priors' value is left out to keep a pass over the weights out
        of every step; the sample statistic ``potential_energy`` of each kept draw is the
        whole (negative) minibatch log joint."""
        return {
            "step_size": f"{self._last['step_size']:.2e}",
            "lp": f"{-self._last['potential_energy']:.4g}",
        }

    def diagnostics(self) -> dict:
        # Pyro asks once, when the chain has finished: the time to judge its equilibrium.
        if self._iteration <= self._warmup_steps:  # the earliest a kernel can tell
            raise ValueError(
                "num_samples=0: MCMC kept no draw after its warm-up, and pyro.infer.MCMC "
                "cannot return zero draws; pass num_samples >= 1 (num_samples=1 keeps the "
                "state the warm-up ends at)"
            )
        self._check_chain()
        return {"sample_stats": {key: list(values) for key, values in self._stats.items()}}

    def cleanup(self) -> None:
        self._check_chain()
        # Pyro now holds its own copy of every draw; drop ours unless they are on disk.
        self._draws = []
        if self._store is not None:
            self._store.close()

    # -- what subclasses define ------------------------------------------------------

    def _init_state(self, theta: list[torch.Tensor]) -> None:
        """Create auxiliary variables (momenta, thermostat) for the parameters."""

    def _end_warmup(self) -> None:
        """Called once, before the first step after warm-up (auxiliary-variable refresh)."""

    def _update(self, theta: list[torch.Tensor], grads: list[torch.Tensor], step_size: float):
        """Update ``theta`` and the auxiliary variables in place, given the gradient."""
        raise NotImplementedError

    def _state(self) -> dict[str, object]:
        """Auxiliary state to checkpoint: name -> tensor, list of tensors or number."""
        return {}

    def _extra_stats(self) -> dict[str, torch.Tensor | float]:
        """Method-specific statistics of the current state (device scalars), recorded
        with each kept draw."""
        return {}

    def _equilibrium_warning(self) -> str | None:
        """A sentence saying the finished chain is off its stationary law, or None."""
        return None

    # -- the shared step -------------------------------------------------------------

    def current_step_size(self) -> float:
        """The step size of the next kernel step: the given or adapted one, after the
        schedule."""
        multiplier = self.schedule(self._step)
        if type(multiplier) is not float or not 0 < multiplier < math.inf:
            multiplier = self._checked_multiplier(multiplier)
        adaptation = self._adaptation
        base = self.step_size if adaptation is None else adaptation.step_size
        return base * multiplier

    @property
    def adapted_step_size(self) -> float | None:
        """The step size the chain runs with after warm-up (None before set-up, or while
        it is still to be found from the first gradient)."""
        adaptation = getattr(self, "_adaptation", None)
        return self.step_size if adaptation is None else adaptation.step_size

    @property
    def inverse_mass_matrix(self) -> dict[str, torch.Tensor] | None:
        """The diagonal of the adapted inverse mass :math:`D^{-1}` per site, shaped like
        the site's unconstrained value (None when the mass is not adapted): the
        preconditioner of SGLD, the inverse mass of SGHMC and SGNHT over ``mass``."""
        if getattr(self, "_scale", None) is None:
            return None
        return {name: s.square() for name, s in zip(self._params, self._scale)}

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
        adaptation = Adaptation(
            self._theta,
            warmup_steps,
            self.step_size,
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
        self._scale = adaptation.scale
        return adaptation

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

    def _finish_adaptation(self) -> None:
        if self._adaptation is not None:
            self._adaptation.finish()

    def _checked_multiplier(self, multiplier: object) -> float:
        try:
            value = float(multiplier)
        except (TypeError, ValueError):
            raise TypeError(
                f"schedule must return a number (a step-size multiplier), returned "
                f"{type(multiplier).__name__} {multiplier!r} at step {self._step}"
            ) from None
        if not 0 < value < math.inf:
            self._stop(
                self._step,
                f"the step-size schedule {self.schedule!r} (a hyperparameter) returned the "
                f"multiplier {value} at step {self._step}; it must be positive and finite",
            )
        return value

    def _step_once(self, record: bool) -> None:
        args, kwargs = self._last_batch = self._batches.next()
        with torch.enable_grad():
            log_joint, grads = self._log_joint_and_grad(
                self._params, args, kwargs, average=self._data_parallel
            )
        self._adapting = adapting = (
            self._adaptation is not None and self._iteration < self._warmup_steps
        )
        if adapting:
            self._adaptation.observe_gradient(grads)
        step_size = self.current_step_size()
        potential = -log_joint.autograd_value
        if torch.is_tensor(potential):
            potential = potential.detach()
        if record:
            # Device scalars of the state the step started from, read with the draw.
            self._recorded = {
                "potential_energy": potential - log_joint.analytic_prior_value(),
                "grad_norm": _norm(grads),
            }
        with torch.no_grad():
            self._update(self._theta, grads, step_size)
            watched = potential
            if adapting and self.adapt_step_size:
                # The statistic travels with the potential: still one read per step.
                statistic = self._adaptation_statistic(step_size)
                watched = torch.stack([torch.as_tensor(potential).to(statistic), statistic])
        ready = self._watch.push(watched, (self._step, args, kwargs))
        if ready is not None:
            self._check_potential(*ready)
        if adapting and self._adaptation.end_step(self._iteration):
            with torch.no_grad():
                self._refresh()
        self._step += 1
        self._last["step_size"] = step_size

    def _check_potential(self, value: float | list[float], context: tuple) -> None:
        step, args, kwargs = context
        if isinstance(value, list):
            value, statistic = value
            self._adaptation.observe_statistic(statistic, value)
        if not math.isfinite(value):
            self._diverged(step, args, kwargs, f"the minibatch potential energy is {value}")
        self._last["potential_energy"] = value
        self._previous_potential = value

    def _log_joint_and_grad(
        self, params: dict[str, torch.Tensor], args: tuple, kwargs: dict, average: bool = False
    ):
        """The minibatch log joint at ``params`` (unconstrained leaves) and its gradient;
        with ``average``, each averaged across the ranks of a data-parallel chain (the
        global batch's; the analytic priors' value, the same on every rank, is not)."""
        values = dict(params)
        log_jacobian = 0.0
        for name, bijection in self._bijections.items():
            z = params[name]
            values[name] = x = bijection(z)
            log_jacobian = log_jacobian + bijection.log_abs_det_jacobian(z, x).sum()
        with LogJoint(values, analytic_priors=True) as log_joint:
            self.model(*args, **kwargs)
        if self._bijections:
            log_joint.autograd_value = log_joint.autograd_value + log_jacobian
        total, leaves = log_joint.autograd_value, list(params.values())
        if torch.is_tensor(total) and total.requires_grad:
            grads = torch.autograd.grad(total, leaves, allow_unused=True)
        else:
            grads = [None] * len(leaves)
        grads = {
            name: torch.zeros_like(z) if g is None else g
            for (name, z), g in zip(params.items(), grads)
        }
        log_joint.add_prior_scores(grads)
        grads = list(grads.values())
        if torch.is_tensor(total):
            log_joint.autograd_value = total = total.detach()
            if average:
                distributed.all_reduce_([total, *grads], op="mean")  # the global batch's
        return log_joint, grads

    def standard_normal(self) -> list[torch.Tensor]:
        """Fresh N(0, I) noise shaped like the parameters: one draw into one flat buffer
        per dtype and device, viewed per parameter."""
        self._noise_flats()
        return self._noise.views

    def _noise_flats(self) -> list[torch.Tensor]:
        """Fresh N(0, I) noise as the flat buffers behind :meth:`standard_normal`."""
        if self._noise is None:
            self._noise = FlatBuffers(self._theta)
        for flat in self._noise.flats:
            flat.normal_()
        if self._data_parallel:
            distributed.broadcast_(self._noise.flats)  # one draw, rank 0's, for every rank
        return self._noise.flats

    # -- draws, statistics, divergence -----------------------------------------------

    def _stat_names(self) -> list[str]:
        return ["potential_energy", "step_size", "temperature", "grad_norm", *self._extra_stats()]

    def _keep_draw(self) -> None:
        names = [*self._recorded, *self._extra_stats()]
        device_stats = {**self._recorded, **self._extra_stats()}
        # One read of the device per kept draw: the statistics, the largest |theta| and
        # the coordinates the convergence check follows.
        scalars = [torch.as_tensor(device_stats[key]).reshape(()) for key in names]
        largest = torch.stack(torch._foreach_norm(self._theta, ord=math.inf)).max()
        followed = self._monitor.coordinates(self._params).to(largest)
        read = torch.cat([torch.stack([s.to(largest) for s in scalars] + [largest]), followed])
        read = read.tolist()
        self._monitor.add(read[len(names) + 1 :])
        read = read[: len(names) + 1]
        stats = dict(zip(names, read))
        step = self._step - 1
        if not math.isfinite(read[-1]):
            bad = [name for name, t in self._params.items() if not bool(torch.isfinite(t).all())]
            self._diverged(step, *self._last_batch, f"parameter {bad[0]!r} has non-finite values")
        if not math.isfinite(stats["potential_energy"]):
            self._diverged(
                step, *self._last_batch, f"the potential energy is {stats['potential_energy']}"
            )
        stats.update(step_size=self._last["step_size"], temperature=self.temperature)
        for key in self._stats:
            self._stats[key].append(float(stats[key]))
        if self._store is not None:
            draw = self.constrained_values(device="cpu")
            self._store.save_draw(self._iteration - self._warmup_steps, draw, self._iteration + 1)
        elif self.keep_draws:
            self._draws.append(self.constrained_values(device="cpu"))

    def constrained_values(
        self, device: str | torch.device | None = None
    ) -> dict[str, torch.Tensor]:
        """A detached copy of the current values of every site, in its support.

        :param device: where to put the copy (default: where the parameters are); a copy
            to the CPU is one transfer per dtype, not one per site.
        """
        with torch.no_grad():
            values = {
                name: (self._bijections[name](z) if name in self._bijections else z).detach()
                for name, z in self._params.items()
            }
            if device is None:
                return {name: value.clone() for name, value in values.items()}
            return copied_to(values, torch.device(device))

    def get_draws(self) -> dict[str, torch.Tensor]:
        """The draws kept so far by this kernel: name -> ``(num_draws, *shape)``, on the CPU."""
        if self._store is not None:
            return self._store.draws()
        draws = self._draws
        if not draws:
            return {}
        return {name: torch.stack([d[name] for d in draws]) for name in draws[0]}

    def _diverged(self, step: int, args: tuple, kwargs: dict, symptom: str) -> None:
        cause = _Diagnosis(self, step, args, kwargs).cause(symptom)
        if step == 0:
            cause += f"; the chain started at {self._describe_start()}"
        self._stop(step, cause)

    def _describe_start(self) -> str:
        """Where the chain started and by which rule, in words (non-finite sites first)."""
        init = self.init_params
        if init is None:
            rule = (
                "init_params=None: lifted weights at the module's values, other sites by "
                "pyro_bdl.lift.init_to_module"
            )
        elif callable(init):
            rule = f"init_params={getattr(init, '__name__', type(init).__name__)}"
        else:
            rule = "the given init_params"
        values = {
            name: (self._bijections[name](z) if name in self._bijections else z).detach()
            for name, z in self._initial_params.items()
        }
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

    def _stop(self, step: int, cause: str) -> None:
        draws = self.get_draws()
        kept = len(next(iter(draws.values()))) if draws else 0
        raise DivergenceError(
            f"{type(self).__name__} diverged at step {step}: {cause}. The {kept} draws kept "
            "before it are in this error's .draws and in kernel.get_draws()",
            step=step,
            draws=draws,
            sample_stats={key: list(v) for key, v in self._stats.items()},
            cause=cause,
        )

    def _check_chain(self) -> None:
        """Warn once per chain if its draws are off the stationary law."""
        if self._chain_checked or not hasattr(self, "_stats"):
            return
        self._chain_checked = True
        message = self._equilibrium_warning()
        if message:
            warnings.warn(f"{type(self).__name__}: {message}", RuntimeWarning, stacklevel=3)
        # At T = 0 the chain is an optimiser: its draws are not meant to mix.
        message = self._monitor.warning() if self.temperature > 0 else None
        if message:
            warnings.warn(
                f"{type(self).__name__}: {message}; {self._convergence_advice()}",
                RuntimeWarning,
                stacklevel=3,
            )

    def _convergence_advice(self) -> str:
        """What to do about draws that have not converged."""
        advice = (
            "keep more draws (num_samples, or a larger thin) and run more warmup_steps, and "
            "check the traces (bdl.to_arviz and bdl.diagnostics.summary)"
        )
        if self._adaptation is None or not self.adapt_step_size:
            advice += (
                f"; the step size {self.current_step_size():.3g} was not adapted: let "
                "warm-up adapt it (adapt_step_size=True and adapt_mass_matrix=True, Pyro's "
                "defaults, with warmup_steps > 0)"
            )
        return advice

    # -- initial values and bookkeeping ----------------------------------------------

    def _prototype_trace(self, args: tuple, kwargs: dict) -> pyro.poutine.Trace:
        init = self.init_params
        if init is None:
            strategy = init_to_module
        elif callable(init):
            strategy = init
        else:
            strategy = _init_from_dict(init)
        model = InitMessenger(strategy)(self.model)
        with torch.no_grad(), pyro.poutine.block():
            trace = pyro.poutine.trace(model).get_trace(*args, **kwargs)
            if invalid_observations(trace):
                # Inside pyro.infer.MCMC validation is off and observe only marked them;
                # with it on, observe names them.
                with pyro.validation_enabled(True):
                    pyro.poutine.trace(model).get_trace(*args, **kwargs)
        return trace

    def _unconstrain(self, name: str, value: torch.Tensor) -> torch.Tensor:
        bijection = self._bijections.get(name)
        return value if bijection is None else bijection.inv(value)

    def _adopt(self, params: dict[str, torch.Tensor]) -> None:
        """Take parameter values that did not come from this kernel's last step."""
        if params is self._returned:
            return
        with torch.no_grad():
            for name, theta in self._params.items():
                value = params.get(name)
                if value is not None and value is not theta:
                    theta.copy_(value)


class _Diagnosis:
    """What was non-finite at a step that gave a non-finite potential or parameter.

    Run once, when a chain has diverged (it may read the device freely). In order:
    the data of that step; then the model on that step's batch at the chain's start,
    where the model was finite, with Pyro's validation on (which names invalid
    distribution parameters and observations outside the support) and each site's log
    density (a non-finite prior or likelihood parameter, a hyperparameter of the
    model); then the gradient there; and only if all of these are finite, the chain
    itself: its parameters blew up, and the step size is too large.
    """

    def __init__(self, kernel: SGMCMCKernel, step: int, args: tuple, kwargs: dict):
        self.kernel, self.step, self.args, self.kwargs = kernel, step, args, kwargs

    def cause(self, symptom: str) -> str:
        kernel = self.kernel
        bad_data = _non_finite_inputs(self.args, self.kwargs)
        if bad_data:
            return (
                f"{symptom}; the data of that step is non-finite ({bad_data}): remove or "
                "impute NaN / inf values in the data set"
            )
        start = {
            name: kernel._bijections[name](z) if name in kernel._bijections else z
            for name, z in kernel._initial_params.items()
        }
        model_cause = self._model_cause(start)
        if model_cause:
            return f"{symptom}; {model_cause}"
        if self._gradient_is_non_finite(start):
            return (
                f"{symptom}; the gradient of the log joint on that step's batch is non-finite "
                "at the chain's start, with finite data and log density (e.g. sqrt or log of "
                "0 in the model's backward pass)"
            )
        bad = [n for n, t in kernel._params.items() if not bool(torch.isfinite(t).all())]
        largest = max(float(t.detach().abs().max()) for t in kernel._params.values())
        state = (
            f"{bad[0]!r} became non-finite"
            if bad
            else f"the largest |parameter| is {largest:.3g}, where the model overflows"
        )
        return (
            f"{symptom}; the data, priors, likelihood and gradient are finite at the chain's "
            f"start on that batch, so the chain itself blew up ({state}; the last finite "
            f"potential energy was {kernel._previous_potential:.4g}): try a smaller "
            f"step_size (now {kernel.current_step_size():.3g})"
        )

    def _model_cause(self, point: dict[str, torch.Tensor]) -> str | None:
        kernel = self.kernel
        model = pyro.poutine.condition(kernel.model, data=point)
        try:
            with torch.no_grad(), pyro.validation_enabled(True):
                trace = pyro.poutine.trace(model).get_trace(*self.args, **self.kwargs)
                trace.compute_log_prob()
        except ObservationError as error:
            raise ObservationError(
                f"{error} (in the batch of step {self.step} of {type(kernel).__name__}; "
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
            if name in kernel._sites:
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

    def _gradient_is_non_finite(self, point: dict[str, torch.Tensor]) -> bool:
        kernel = self.kernel
        leaves = {
            name: kernel._unconstrain(name, value.detach()).clone().requires_grad_(True)
            for name, value in point.items()
        }
        with torch.enable_grad():
            _, grads = kernel._log_joint_and_grad(leaves, self.args, self.kwargs)
        return not all(bool(torch.isfinite(g).all()) for g in grads)


class _LaggedRead:
    """Reads a device scalar per step without stalling the device.

    On the CPU a value is read at once. On a GPU, reading a tensor waits for all the
    work queued before the read; instead each value is copied, right after it is
    computed, into pinned host memory with an event behind the copy, and read one
    step later, when the device finished that point long ago (the host has queued a
    whole forward and backward pass since).
    """

    def __init__(self):
        self._pending = None
        self._host: list[torch.Tensor] = []

    def push(
        self, value: torch.Tensor | float, context: object
    ) -> tuple[float | list[float], object] | None:
        """Queue ``value`` (a scalar, or a vector read as a list); return ``(value,
        context)`` of the entry now readable, if any."""
        if not torch.is_tensor(value) or value.device.type != "cuda":
            return _read(value), context
        host = self._host[0] if self._host else None
        if host is None or host.dtype != value.dtype or host.shape != value.shape:
            self._host = [
                torch.empty(value.shape, dtype=value.dtype, pin_memory=True) for _ in range(2)
            ]
        host = self._host[0]
        self._host.reverse()  # alternate: the other buffer may still hold the pending read
        host.copy_(value, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        ready, self._pending = self._pending, (host, event, context)
        if ready is None:
            return None
        ready[1].synchronize()
        return _read(ready[0]), ready[2]


def _read(value: torch.Tensor | float) -> float | list[float]:
    if torch.is_tensor(value) and value.dim() > 0:
        return value.tolist()
    return float(value)


def _norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The Euclidean norm of a list of tensors as one vector, on the device."""
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(tensors)))


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


def _has_observations(trace: pyro.poutine.Trace) -> bool:
    """Whether a trace has an observed sample site (``pyro.deterministic`` is none)."""
    return any(
        site["type"] == "sample"
        and site["is_observed"]
        and not site_is_subsample(site)
        and not site["infer"].get("_deterministic")
        for site in trace.nodes.values()
    )


def _checked_init_params(init_params: object) -> object:
    if init_params is None or callable(init_params):
        return init_params
    if not isinstance(init_params, Mapping):
        raise TypeError(
            "init_params must be None, a dict of site values or a Pyro init strategy, "
            f"got {type(init_params).__name__}"
        )
    for name, value in init_params.items():
        instance("init_params key", name, str, "a site name (str)")
        try:
            tensor = torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(
                f"init_params[{name!r}] must be a tensor (or array) of site values, got "
                f"{type(value).__name__}"
            ) from None
        if not tensor.is_floating_point():
            raise TypeError(
                f"init_params[{name!r}] must hold real numbers, got dtype {tensor.dtype}"
            )
        if not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"init_params[{name!r}] has non-finite values")
    return init_params


def _placed_like(
    values: Mapping[str, torch.Tensor], like: Mapping[str, torch.Tensor], what: str
) -> dict[str, torch.Tensor]:
    """``values`` checked against ``like`` (same sites and shapes, finite) and moved to
    its dtype and device (a CUDA model started from CPU tensors)."""
    site_keys(what, values, like, "the model's latent sites")
    placed = {}
    for name, reference in like.items():
        if name not in values:
            raise ValueError(f"{what}: no value for the site {name!r}; it has {sorted(values)}")
        value = torch.as_tensor(values[name])
        if value.shape != reference.shape:
            raise ValueError(
                f"{what}[{name!r}] has shape {tuple(value.shape)}, but the site has shape "
                f"{tuple(reference.shape)}"
            )
        value = value.detach().to(dtype=reference.dtype, device=reference.device)
        if not bool(torch.isfinite(value).all()):
            raise ValueError(f"{what}[{name!r}] has non-finite values")
        placed[name] = value
    return placed


def _init_from_dict(values: Mapping[str, torch.Tensor]) -> Callable[[dict], torch.Tensor]:
    def init(site: dict) -> torch.Tensor:
        # the default start gives the site's shape, dtype and device; its fallback,
        # init_to_feasible, draws from the prior to find them, which must not move the
        # random stream of a chain whose start is given
        with torch.random.fork_rng(devices=[]):
            reference = init_to_module(site)
        if site["name"] not in values:
            return reference
        value = torch.as_tensor(values[site["name"]])
        if value.shape != reference.shape:
            raise ValueError(
                f"init_params[{site['name']!r}] has shape {tuple(value.shape)}, but the site "
                f"has shape {tuple(reference.shape)}"
            )
        return value.detach().to(dtype=reference.dtype, device=reference.device, copy=True)

    return init
