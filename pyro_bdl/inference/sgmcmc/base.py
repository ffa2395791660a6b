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
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path

import pyro
import torch
from pyro.distributions.transforms import biject_to
from pyro.infer.autoguide.initialization import InitMessenger
from pyro.infer.mcmc.mcmc_kernel import MCMCKernel
from pyro.poutine.util import site_is_subsample

from pyro_bdl import distributed
from pyro_bdl.inference.log_joint import LogJoint, observed_num_data
from pyro_bdl.inference.minibatch import Minibatches
from pyro_bdl.inference.sgmcmc.checkpoint import Checkpoint, chain_number
from pyro_bdl.inference.sgmcmc.schedules import Constant
from pyro_bdl.lift import init_to_module

__all__ = ["SGMCMCKernel", "DivergenceError"]


class DivergenceError(RuntimeError):
    """A chain produced a non-finite potential or parameter and was stopped.

    :ivar int step: the kernel step (from 0, warm-up included) that diverged.
    :ivar dict draws: the draws kept before it, site name -> ``(num_draws, *shape)``.
    :ivar dict sample_stats: the statistics of those draws.
    """

    def __init__(self, message: str, step: int, draws: dict, sample_stats: dict):
        super().__init__(message)
        self.step = step
        self.draws = draws
        self.sample_stats = sample_stats


def _check_positive(name: str, value: float, allow_zero: bool = False) -> float:
    ok = value >= 0 if allow_zero else value > 0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok:
        bound = "non-negative" if allow_zero else "positive"
        raise ValueError(f"{name} must be a {bound} number, got {value!r}")
    return float(value)


class SGMCMCKernel(MCMCKernel):
    """Base class of the tempered SGMCMC kernels; subclasses define one update.

    A subclass implements ``_init_state`` (auxiliary variables such as momenta)
    and ``_update`` (the in-place step given the gradient), and lists its
    auxiliary tensors in ``_state`` for checkpoints.

    :param callable model: a Pyro model; DataLoader arguments of ``MCMC.run`` are
        replaced by a fresh minibatch at every step.
    :param float step_size: the step size :math:`\\epsilon` (positive).
    :param float temperature: :math:`T \\ge 0`; 1 is the Bayesian posterior, 0 is
        optimisation.
    :param int num_data: the data-set size N (default: the ``num_data`` of the model's
        ``bdl.observe`` site).
    :param int thin: kernel steps per kept draw (after warm-up; each warm-up iteration
        is one step).
    :param callable schedule: ``t -> multiplier`` of the step size, see
        :mod:`~pyro_bdl.inference.sgmcmc.schedules`.
    :param init_params: where the chain starts: None (the module's current weights for
        sites made by :func:`~pyro_bdl.lift`, the prior mean otherwise), a dict of
        site values, or a Pyro init strategy such as ``init_to_sample``.
    :param checkpoint: a directory; every kept draw and the chain's state are written
        there, and a run started with the same directory resumes where it stopped.
    :param int checkpoint_every: during warm-up, steps between state checkpoints.
    :param bool keep_draws: keep the draws in the kernel too (they are what
        :class:`DivergenceError` returns; the default); with a checkpoint they are
        read back from disk instead and never held twice in memory.
    """

    def __init__(
        self,
        model: Callable,
        step_size: float,
        temperature: float = 1.0,
        *,
        num_data: int | None = None,
        thin: int = 1,
        schedule: Callable[[int], float] | None = None,
        init_params: Mapping[str, torch.Tensor] | Callable | None = None,
        checkpoint: str | Path | None = None,
        checkpoint_every: int = 100,
        keep_draws: bool = True,
    ):
        if not callable(model):
            raise TypeError(f"model must be a callable Pyro model, got {type(model).__name__}")
        self.model = model
        self.step_size = _check_positive("step_size", step_size)
        self.temperature = _check_positive("temperature", temperature, allow_zero=True)
        if num_data is not None and (not isinstance(num_data, int) or num_data < 1):
            raise ValueError(
                f"num_data must be a positive int (the data-set size), got {num_data!r}"
            )
        self._num_data_arg = num_data
        if isinstance(thin, bool) or not isinstance(thin, int) or thin < 1:
            raise ValueError(f"thin must be an int >= 1 (kernel steps per kept draw), got {thin!r}")
        self.thin = thin
        if schedule is not None and not callable(schedule):
            raise TypeError(f"schedule must be a callable t -> multiplier, got {schedule!r}")
        self.schedule = schedule or Constant()
        if init_params is not None and not (
            callable(init_params) or isinstance(init_params, Mapping)
        ):
            raise TypeError(
                "init_params must be None, a dict of site values or a Pyro init strategy, "
                f"got {type(init_params).__name__}"
            )
        self.init_params = init_params
        self.checkpoint = Path(checkpoint) if checkpoint is not None else None
        if (
            isinstance(checkpoint_every, bool)
            or not isinstance(checkpoint_every, int)
            or checkpoint_every < 1
        ):
            raise ValueError(f"checkpoint_every must be an int >= 1, got {checkpoint_every!r}")
        self.checkpoint_every = checkpoint_every
        self.keep_draws = keep_draws
        self.transforms = None
        self._initial_params = None
        self._initial_params_given = False
        self._chain_id: int | None = None  # set by Chains; else the chain MCMC starts

    # -- hyperparameters -------------------------------------------------------------

    def hyperparameters(self) -> dict:
        """The kernel's settings, JSON-serialisable (for ArviZ attributes and checkpoints)."""
        return {
            "method": type(self).__name__,
            "step_size": self.step_size,
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
        for name, site in self._sites.items():
            if site["fn"].support.is_discrete:
                raise ValueError(
                    f"site {name!r} is discrete; SGMCMC kernels need continuous latent sites"
                )
        self.num_data = self._num_data_arg or observed_num_data(trace)
        if self.num_data is None:
            raise ValueError(
                "num_data: the model has no bdl.observe site with num_data; pass "
                "num_data=<size of the training set> to the kernel"
            )
        # Pyro's MCMC stores unconstrained values and applies transforms[name].inv.
        self._bijections = {
            name: biject_to(site["fn"].support)
            for name, site in self._sites.items()
            if not _is_real(site["fn"].support)
        }
        self.transforms = {name: b.inv for name, b in self._bijections.items()}
        if not self._initial_params_given:
            self._initial_params = {
                name: self._unconstrain(name, site["value"].detach())
                for name, site in self._sites.items()
            }
        self._theta = [
            self._initial_params[name].detach().clone().requires_grad_(True) for name in self._sites
        ]
        self._params = dict(zip(self._sites, self._theta))
        # Under torchrun, outside Chains, every rank steps the same chain on its shard of
        # the data: rank 0's start, averaged gradients, rank 0's noise.
        self._data_parallel = self._chain_id is None and distributed.is_distributed()
        if self._data_parallel:
            distributed.broadcast_(self._theta)
        self._initial_params_given = False
        self._returned = self._initial_params
        self._noise_buffers = None
        self._init_state(self._theta)
        self._step = 0
        self._iteration = 0
        self._last = {
            "potential_energy": math.nan,
            "grad_norm": math.nan,
            "step_size": self.step_size,
        }
        self._stats: dict[str, list[float]] = {key: [] for key in self._stat_names()}
        self._draws: list[dict[str, torch.Tensor]] = []
        chain = chain_number(self._chain_id)
        self._store = None if self.checkpoint is None else Checkpoint(self.checkpoint, self, chain)

    def sample(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self._store is not None and self._store.replaying(self._iteration):
            self._returned = self._store.replay(self._iteration)
        else:
            self._adopt(params)
            warmup = self._iteration < self._warmup_steps
            for inner in range(1 if warmup else self.thin):
                self._step_once(record=not warmup and inner == self.thin - 1)
            if not warmup:
                self._keep_draw()
            elif self._store is not None and (self._iteration + 1) % self.checkpoint_every == 0:
                self._store.save_state(self._iteration + 1)
            self._returned = {name: theta.detach() for name, theta in self._params.items()}
        self._iteration += 1
        return self._returned

    def logging(self) -> dict:
        return {
            "step_size": f"{self._last['step_size']:.2e}",
            "lp": f"{-self._last['potential_energy']:.4g}",
        }

    def diagnostics(self) -> dict:
        return {"sample_stats": {key: list(values) for key, values in self._stats.items()}}

    def cleanup(self) -> None:
        # Pyro now holds its own copy of every draw; drop ours unless they are on disk.
        self._draws = []
        if self._store is not None:
            self._store.close()

    # -- what subclasses define ------------------------------------------------------

    def _init_state(self, theta: list[torch.Tensor]) -> None:
        """Create auxiliary variables (momenta, thermostat) for the parameters."""

    def _update(self, theta: list[torch.Tensor], grads: list[torch.Tensor], step_size: float):
        """Update ``theta`` and the auxiliary variables in place, given the gradient."""
        raise NotImplementedError

    def _state(self) -> dict[str, object]:
        """Auxiliary state to checkpoint: name -> tensor, list of tensors or number."""
        return {}

    def _extra_stats(self) -> dict[str, float]:
        """Method-specific statistics recorded with each kept draw."""
        return {}

    # -- the shared step -------------------------------------------------------------

    def current_step_size(self) -> float:
        """The step size of the next kernel step, after the schedule."""
        return self.step_size * self.schedule(self._step)

    def _step_once(self, record: bool) -> None:
        args, kwargs = self._batches.next()
        step_size = self.current_step_size()
        with torch.enable_grad():
            log_joint, grads = self._log_joint_and_grad(args, kwargs)
        potential = -float(log_joint)
        if not math.isfinite(potential):
            self._diverged(f"the minibatch potential energy is {potential}")
        with torch.no_grad():
            self._update(self._theta, grads, step_size)
        self._step += 1
        self._last.update(potential_energy=potential, step_size=step_size)
        if record:
            norms = torch._foreach_norm(grads)
            self._last["grad_norm"] = float(torch.linalg.vector_norm(torch.stack(norms)))

    def _log_joint_and_grad(self, args: tuple, kwargs: dict):
        """The minibatch log joint (detached) and its gradient, one tensor per site."""
        values = {}
        log_jacobian = 0.0
        for name, z in self._params.items():
            bijection = self._bijections.get(name)
            if bijection is None:
                values[name] = z
            else:
                values[name] = x = bijection(z)
                log_jacobian = log_jacobian + bijection.log_abs_det_jacobian(z, x).sum()
        with LogJoint(values, analytic_priors=True) as log_joint:
            self.model(*args, **kwargs)
        total = log_joint.value + log_jacobian
        if torch.is_tensor(total) and total.requires_grad:
            grads = torch.autograd.grad(total, self._theta, allow_unused=True)
        else:
            grads = [None] * len(self._theta)
        grads = {
            name: torch.zeros_like(z) if g is None else g
            for (name, z), g in zip(self._params.items(), grads)
        }
        log_joint.add_prior_scores(grads)
        total, grads = total.detach(), list(grads.values())
        if self._data_parallel:
            distributed.all_reduce_([total, *grads], op="mean")  # the global batch's
        return total, grads

    def standard_normal(self) -> list[torch.Tensor]:
        """Fresh N(0, I) noise shaped like the parameters, in reused buffers."""
        if self._noise_buffers is None:
            self._noise_buffers = [torch.empty_like(t) for t in self._theta]
        for buffer in self._noise_buffers:
            buffer.normal_()
        if self._data_parallel:
            distributed.broadcast_(self._noise_buffers)  # one draw, rank 0's, for every rank
        return self._noise_buffers

    # -- draws, statistics, divergence -----------------------------------------------

    def _stat_names(self) -> list[str]:
        return ["potential_energy", "step_size", "temperature", "grad_norm", *self._extra_stats()]

    def _keep_draw(self) -> None:
        bad = [name for name, t in self._params.items() if not bool(torch.isfinite(t).all())]
        if bad:
            self._diverged(f"parameter {bad[0]!r} has non-finite values")
        stats = {**self._last, "temperature": self.temperature, **self._extra_stats()}
        for key in self._stats:
            self._stats[key].append(float(stats[key]))
        draw = self.constrained_values()
        if self._store is not None:
            self._store.save_draw(self._iteration - self._warmup_steps, draw, self._iteration + 1)
        elif self.keep_draws:
            self._draws.append(draw)

    def constrained_values(self) -> dict[str, torch.Tensor]:
        """A detached copy of the current values of every site, in its support."""
        with torch.no_grad():
            return {
                name: (self._bijections[name](z) if name in self._bijections else z)
                .detach()
                .clone()
                for name, z in self._params.items()
            }

    def get_draws(self) -> dict[str, torch.Tensor]:
        """The draws kept so far by this kernel: site name -> ``(num_draws, *shape)``."""
        if self._store is not None:
            return self._store.draws()
        draws = self._draws
        if not draws:
            return {}
        return {name: torch.stack([d[name] for d in draws]) for name in draws[0]}

    def _diverged(self, cause: str) -> None:
        step = self._step
        raise DivergenceError(
            f"{type(self).__name__} diverged at step {step}: {cause}. Try a smaller step_size "
            f"(now {self.current_step_size():.3g}); the {len(self._stats['step_size'])} draws kept "
            "before it are in this error's .draws and in kernel.get_draws()",
            step=step,
            draws=self.get_draws(),
            sample_stats={key: list(v) for key, v in self._stats.items()},
        )

    # -- initial values and bookkeeping ----------------------------------------------

    def _prototype_trace(self, args: tuple, kwargs: dict) -> pyro.poutine.Trace:
        init = self.init_params
        if init is None:
            strategy = init_to_module
        elif callable(init):
            strategy = init
        else:
            strategy = _init_from_dict(init)
        with torch.no_grad(), pyro.poutine.block():
            return pyro.poutine.trace(InitMessenger(strategy)(self.model)).get_trace(
                *args, **kwargs
            )

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


def _is_real(support: torch.distributions.constraints.Constraint) -> bool:
    while isinstance(support, torch.distributions.constraints.independent):
        support = support.base_constraint
    return support is torch.distributions.constraints.real


def _init_from_dict(values: Mapping[str, torch.Tensor]) -> Callable[[dict], torch.Tensor]:
    def init(site: dict) -> torch.Tensor:
        if site["name"] in values:
            return torch.as_tensor(values[site["name"]]).detach().clone()
        return init_to_module(site)

    return init
