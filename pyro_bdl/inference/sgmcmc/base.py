r"""The tempered stochastic-gradient MCMC kernel that SGLD, SGHMC and SGNHT share.

Each simulates an SDE whose stationary law is the tempered posterior :math:`p(\theta \mid
y_{1:N})^{1/T}` (Appendix B of the posteriors paper, user temperature :math:`T = N
\mathcal{T}`), as a Pyro :class:`~pyro.infer.mcmc.mcmc_kernel.MCMCKernel` that
``pyro.infer.MCMC`` drives. A kernel is its method (:mod:`~pyro_bdl.inference.sgmcmc.method`:
a frozen hyperparameter record, ``init`` and ``update``) and, while a chain runs, one
:class:`~pyro_bdl.inference.sgmcmc.run.ChainRun` that owns the chain's run-time state; the
step is :mod:`~pyro_bdl.inference.sgmcmc.step`, the warm-up adaptation a component it
calls (:mod:`~pyro_bdl.inference.sgmcmc.warmup`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path

import torch
from pyro.infer.mcmc.mcmc_kernel import MCMCKernel

from pyro_bdl._checks import function, instance, integer
from pyro_bdl.inference.sgmcmc import run as chain_run
from pyro_bdl.inference.sgmcmc import step
from pyro_bdl.inference.sgmcmc.divergence import DivergenceError
from pyro_bdl.inference.sgmcmc.method import Method
from pyro_bdl.inference.sgmcmc.target import checked_init_params
from pyro_bdl.inference.sgmcmc.warmup import WarmupResults

__all__ = ["SGMCMCKernel", "DivergenceError"]


class SGMCMCKernel(Method, WarmupResults, MCMCKernel):
    """Base class of the tempered SGMCMC kernels: a method defines its ``Hyperparameters``
    record, ``init`` and ``update`` (see :class:`~pyro_bdl.inference.sgmcmc.method.Method`).

    The hyperparameters (``step_size``, ``temperature``, ``adapt_step_size``, ...) are
    those of :class:`~pyro_bdl.inference.sgmcmc.hyperparameters.Hyperparameters`, read and
    set (a new record, validated) as the kernel's attributes. The chain's state is
    ``kernel.state``, the last step's ``StepInfo`` is ``kernel.info``.

    :param callable model: a Pyro model; DataLoader arguments of ``MCMC.run`` are
        replaced by a fresh minibatch at every step.
    :param init_params: where the chain starts: None (the module's current weights for
        sites made by :func:`~pyro_bdl.lift`, a feasible point otherwise, see
        :func:`~pyro_bdl.init_to_module`), a dict of site values, or a Pyro init
        strategy such as ``init_to_sample``.
    :param checkpoint: a directory; every kept draw and the chain's state are written
        there, and a run started with the same directory resumes where it stopped.
    :param int checkpoint_every: during warm-up, steps between state checkpoints.
    :param bool keep_draws: keep the draws in the kernel too, on the CPU (they are what
        :class:`DivergenceError` returns; the default); with a checkpoint they are read
        back from disk instead and never held twice in memory.
    :param tuple probe: the model's positional arguments on a fixed batch of inputs whose
        outputs the end-of-run check of a lifted network follows in function space (see
        :mod:`~pyro_bdl.inference.sgmcmc.convergence`); by default the first minibatch
        of the run's first chain, kept for its later chains.
    :param hyperparameters: ``step_size``, ``temperature`` and the rest of the method's
        record.
    """

    def __init__(
        self,
        model: Callable,
        step_size: float | None = None,
        temperature: float = 1.0,
        *,
        init_params: Mapping[str, torch.Tensor] | Callable | None = None,
        checkpoint: str | Path | None = None,
        checkpoint_every: int = 100,
        keep_draws: bool = True,
        probe: tuple | None = None,
        **hyperparameters,
    ):
        self.model = function("model", model, "a callable Pyro model")
        self.hyper = self.Hyperparameters(
            step_size=step_size, temperature=temperature, **hyperparameters
        )
        self.init_params = checked_init_params(init_params)
        if checkpoint is not None:
            checkpoint = Path(instance("checkpoint", checkpoint, (str, Path), "a directory path"))
        self.checkpoint = checkpoint
        self.checkpoint_every = integer("checkpoint_every", checkpoint_every, low=1)
        self.keep_draws = instance("keep_draws", keep_draws, bool, "True or False")
        what = "a tuple of the model's arguments"
        self.probe = None if probe is None else instance("probe", probe, tuple, what)
        self.function_monitor = None  # across a run's chains
        self._given: dict[str, torch.Tensor] | None = None  # initial_params set by Pyro
        self._chain_id: int | None = None  # set by Chains; else the chain MCMC starts
        self.run: chain_run.ChainRun | None = None  # the chain set up last

    def __getattr__(self, name: str):
        # the hyperparameters read and set as the kernel's attributes (kernel.step_size)
        hyper = self.__dict__.get("hyper")
        if hyper is not None and name in hyper.names():
            return getattr(hyper, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __setattr__(self, name: str, value) -> None:
        hyper = self.__dict__.get("hyper")
        if hyper is not None and name in hyper.names():
            name, value = "hyper", replace(hyper, **{name: value})  # validated
        super().__setattr__(name, value)

    def hyperparameters(self) -> dict:
        """The kernel's settings, JSON-serialisable (for ArviZ attributes and checkpoints)."""
        return self.hyper.as_dict(type(self).__name__, self.num_data)

    @property
    def initial_params(self) -> dict[str, torch.Tensor] | None:
        if self._given is not None or self.run is None:
            return self._given
        return self.run.initial_params

    @initial_params.setter
    def initial_params(self, params: dict[str, torch.Tensor]) -> None:
        self._given = params

    @property
    def transforms(self) -> dict | None:
        return None if self.run is None else self.run.target.transforms

    def setup(self, warmup_steps: int, *args, **kwargs) -> None:
        given, self._given = self._given, None
        chain_run.start(self, warmup_steps, args, kwargs, given)

    def sample(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        run = self.run
        state, store, warmup_steps = run.state, run.kept.checkpoint, run.warmup_steps
        if store is not None and store.replaying(state.iteration):
            run.replay(store, self.function_monitor)
        else:
            run.adopt(params)
            if state.iteration == warmup_steps:
                if state.adaptation is not None:
                    state.adaptation.finish()
                run.end_warmup()
                self.end_warmup()
            warmup = state.iteration < warmup_steps
            for inner in range(1 if warmup else self.thin):
                step.step(self, record=not warmup and inner == self.thin - 1)
            if not warmup:
                step.keep_draw(self)
            elif store is not None and (state.iteration + 1) % self.checkpoint_every == 0:
                store.save_state(state.iteration + 1)
            run.returned = state.current
        state.iteration += 1
        return run.returned

    def logging(self) -> dict:
        """The progress bar's figures: the step size and ``lp``, the minibatch log likelihood
        and non-isotropic priors (``potential_energy`` of each draw is the whole log joint)."""
        step_size = self.info.step_size if self.info else self.step_size or math.nan
        return {"step_size": f"{step_size:.2e}", "lp": f"{-self.state.potential_energy:.4g}"}

    def diagnostics(self) -> dict:
        # Pyro asks once, when the chain has finished: the time to judge its equilibrium.
        if self.state.iteration <= self.run.warmup_steps:  # the earliest a kernel can tell
            raise ValueError(
                "num_samples=0: MCMC kept no draw after its warm-up, and pyro.infer.MCMC "
                "cannot return zero draws; pass num_samples >= 1 (num_samples=1 keeps the "
                "state the warm-up ends at)"
            )
        chain_run.check(self)
        return {"sample_stats": self.kept.sample_stats()}

    def cleanup(self) -> None:
        chain_run.check(self)
        if self.kept is not None:  # Pyro holds its own copy of every draw now
            self.kept.release()

    state = property(lambda self: None if self.run is None else self.run.state)
    info = property(lambda self: None if self.run is None else self.run.info)
    kept = property(lambda self: None if self.run is None else self.run.kept)
    target = property(lambda self: None if self.run is None else self.run.target)
    dimension = property(lambda self: None if self.run is None else self.run.dimension)

    @property
    def num_data(self) -> int | None:
        """N: the kernel's, or once set up the model's."""
        return self.hyper.num_data if self.run is None else self.run.num_data

    def current_step_size(self) -> float:
        """The next step's step size: the given or adapted one, after the schedule."""
        return step.step_size(self)

    def standard_normal(self) -> list[torch.Tensor]:
        """Fresh N(0, I) noise shaped like the parameters (one draw per dtype and device)."""
        return self.run.standard_normal()

    def constrained_values(self, device: str | torch.device | None = None) -> dict:
        """A detached copy of every site's current value, in its support, on ``device``
        (default: the parameters'; a copy to the CPU is one transfer per dtype)."""
        return self.run.constrained_values(device)

    def get_draws(self) -> dict[str, torch.Tensor]:
        """The draws kept so far by this kernel: name -> ``(num_draws, *shape)``, on the CPU."""
        return self.kept.draws()
