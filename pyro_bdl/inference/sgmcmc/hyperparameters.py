r"""The hyperparameters every SGMCMC kernel shares, as one frozen record.

Each method file extends :class:`Hyperparameters` with its own (``SGHMCHyperparameters``
adds the friction and the mass), the way posteriors' ``build`` and blackjax's
``build_kernel`` take their configuration: fixed for the kernel's life, validated once
when the kernel is made, and read by the method's ``init`` and ``update``. The record also
holds the method's rules for warm-up adaptation (``step_exponent``,
:meth:`Hyperparameters.max_adapted_step_size`, :meth:`Hyperparameters.relaxation_rate`),
which depend on these values alone.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import ClassVar

from pyro_bdl._checks import function, instance, integer, real
from pyro_bdl.inference.sgmcmc.adaptation import DEFAULT_TARGET_EXCESS
from pyro_bdl.inference.sgmcmc.schedules import Constant

__all__ = ["Hyperparameters"]


@dataclass(frozen=True, kw_only=True)
class Hyperparameters:
    """The settings of a tempered SGMCMC kernel.

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
        :mod:`~pyro_bdl.inference.sgmcmc.schedules` (default: constant).
    """

    #: The step size scales as (mass / curvature) to this power (SGLD: 1).
    step_exponent: ClassVar[float] = 1.0

    step_size: float | None = None
    temperature: float = 1.0
    adapt_step_size: bool = True
    adapt_mass_matrix: bool = True
    dense_mass: bool | None = None
    target_excess: float = DEFAULT_TARGET_EXCESS
    num_data: int | None = None
    thin: int = 1
    schedule: Callable[[int], float] = field(default_factory=Constant)

    def __post_init__(self):
        temperature = real("temperature", self.temperature, non_negative=True)
        instance("adapt_step_size", self.adapt_step_size, bool, "True or False")
        instance("adapt_mass_matrix", self.adapt_mass_matrix, bool, "True or False")
        if self.dense_mass is not None:
            instance("dense_mass", self.dense_mass, bool, "True, False or None (by dimension)")
        target_excess = real("target_excess", self.target_excess, positive=True, high=1.0)
        step_size = self.step_size
        if step_size is None:
            if not self.adapt_step_size:
                raise ValueError(
                    "step_size: none given and adapt_step_size=False; give a step size, or "
                    "leave adapt_step_size=True to tune it during warm-up"
                )
            if temperature == 0:
                raise ValueError(
                    "step_size: none given at temperature 0, where the kernel is an optimiser "
                    "and nothing is adapted (adaptation targets the tempered posterior, "
                    "T > 0); give the learning rate as step_size"
                )
        else:
            step_size = real("step_size", step_size, positive=True)
        num_data = self.num_data
        if num_data is not None:
            num_data = integer("num_data", num_data, low=1)
        thin = integer("thin", self.thin, low=1)
        schedule = self.schedule
        if schedule is None:
            schedule = Constant()
        else:
            function("schedule", schedule, "a callable t -> step-size multiplier")
        self._set(
            temperature=temperature,
            target_excess=target_excess,
            step_size=step_size,
            num_data=num_data,
            thin=thin,
            schedule=schedule,
        )

    @classmethod
    def names(cls) -> frozenset[str]:
        """The record's field names."""
        return _names(cls)

    def _set(self, **values) -> None:
        """Store the validated (converted) values in the frozen record."""
        for name, value in values.items():
            object.__setattr__(self, name, value)

    def as_dict(self, method: str, num_data: int | None) -> dict:
        """The record, JSON-serialisable (for ArviZ attributes and checkpoints).

        :param str method: the kernel's name.
        :param int num_data: N as the chain uses it (the model's, once set up).
        """
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return {"method": method, **values, "num_data": num_data, "schedule": repr(self.schedule)}

    def max_adapted_step_size(self) -> float:
        """The largest step size adaptation may try, in mass-adapted units."""
        return 1.0 if self.adapt_mass_matrix else math.inf

    def relaxation_rate(self) -> float:
        """The rate (per unit of time) at which the adaptation statistic forgets its past."""
        return math.inf


@functools.cache
def _names(record: type) -> frozenset[str]:
    return frozenset(f.name for f in fields(record))
