"""What an SGMCMC method defines: the interface SGLD, SGHMC and SGNHT implement.

A method is a frozen hyperparameter record (``Hyperparameters``, see
:mod:`~pyro_bdl.inference.sgmcmc.hyperparameters`), :meth:`Method.init` (its chain's
:class:`~pyro_bdl.inference.sgmcmc.state.ChainState`) and :meth:`Method.update` (the
in-place step given the gradient), as in posteriors' ``sgmcmc/sghmc.py`` (``build``,
``init``, ``update``) and blackjax's ``build_kernel``; the other calls have defaults.
The kernel (:class:`~pyro_bdl.inference.sgmcmc.base.SGMCMCKernel`) calls them.
"""

from __future__ import annotations

import torch

from pyro_bdl.inference.sgmcmc.hyperparameters import Hyperparameters
from pyro_bdl.inference.sgmcmc.state import ChainState

__all__ = ["Method"]


class Method:
    """The calls a method answers (its hyperparameters read as attributes of ``self``)."""

    #: The method's frozen hyperparameter record.
    Hyperparameters = Hyperparameters

    def init(self, params: dict[str, torch.Tensor]) -> ChainState:
        """The chain's state at its start: the parameters and the method's auxiliary
        variables (momenta, thermostat)."""
        return ChainState(params)

    def update(self, theta: list[torch.Tensor], grads: list[torch.Tensor], step_size: float):
        """Update ``theta`` and the auxiliary variables in place, given the gradient."""
        raise NotImplementedError

    def adaptation_statistic(self, step_size: float) -> torch.Tensor:
        """The excess of the position variance that this step shows (a device scalar),
        after the update; see :mod:`~pyro_bdl.inference.sgmcmc.adaptation`."""
        raise NotImplementedError

    def _free_kinetic_temperature(self, step_size: float) -> float:
        """The kinetic temperature of a free particle's momenta (SGLD's, drawn afresh
        each step: the temperature)."""
        return self.temperature

    def kinetic_energy_of(self, statistic: float, step_size: float) -> float:
        """The kinetic energy :math:`N |m|^2 / (2\\sigma^2)` that an adaptation statistic
        (the excess of the kinetic temperature) reads: in the units of the potential
        energy, so that the two add up to the chain's energy."""
        return self.dimension * self._free_kinetic_temperature(step_size) * (1 + statistic) / 2

    def draw_statistic(self, stats: dict[str, float], step_size: float) -> float | None:
        """A kept draw's adaptation statistic, from its statistics ``stats``, which tells a
        divergence after warm-up (see :mod:`~pyro_bdl.inference.sgmcmc.recovery`); None
        for a method whose draws do not show it (SGLD's momentum is fresh each step: its
        divergence cannot coast, and grows until it is non-finite)."""
        return None

    def refresh(self) -> None:
        """Draw the auxiliary variables afresh at the start of an adaptation window."""

    def end_warmup(self) -> None:
        """Called once, before the first step after warm-up (auxiliary-variable refresh)."""

    def extra_stats(self) -> dict[str, torch.Tensor | float]:
        """Method-specific statistics of the current state (device scalars), recorded
        with each kept draw."""
        return {}

    def stat_names(self) -> list[str]:
        """The sample statistics of each kept draw."""
        return ["potential_energy", "step_size", "temperature", "grad_norm", *self.extra_stats()]

    def equilibrium_warning(self) -> str | None:
        """A sentence saying the finished chain is off its stationary law, or None."""
        return None
