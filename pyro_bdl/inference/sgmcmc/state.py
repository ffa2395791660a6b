"""The state of an SGMCMC chain and the record of one step.

A kernel's :class:`ChainState` is everything a step reads and changes, and so
everything a checkpoint saves: the parameters, the method's auxiliary variables
(listed in ``SAVED``), the counters and the warm-up adaptation. Each method extends
it with its own variables (``SGHMCState``'s momenta, ``SGNHTState``'s thermostat), as
posteriors' ``SGHMCState`` and blackjax's ``HMCState`` do. A step reports a
:class:`StepInfo` (blackjax's ``HMCInfo``): what it did, for the draw it may end and
for the diagnosis of a divergence.

The tensors are updated in place, so the state is one object for the chain's life
(a 7B model's parameters and momenta are never copied per step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch

__all__ = ["ChainState", "StepInfo"]


@dataclass(eq=False)
class ChainState:
    """Where a chain is.

    :ivar dict params: site name -> its unconstrained value, a leaf tensor (requiring
        grad) that the update changes in place.
    :ivar list theta: the same tensors as a list, in the model's order (the update's
        argument).
    :ivar dict current: detached views of ``params``, which Pyro gets back from each
        step without a dict per step.
    :ivar int step: kernel steps taken, warm-up included (thinning makes several per
        iteration).
    :ivar int iteration: ``pyro.infer.MCMC`` iterations done.
    :ivar adaptation: the warm-up ``Adaptation`` (see
        :mod:`~pyro_bdl.inference.sgmcmc.adaptation`), or None when nothing adapts.
    :ivar scale: :math:`D^{-1/2}` of an adapted diagonal mass per parameter, or None.
    :ivar bool adapting: whether the step in progress is an adapting warm-up step.
    :ivar drift_norm: during an adapting Langevin step (SGLD's, and every method's in
        the dense mass's start buffer), the squared norm of the preconditioned drift
        :math:`|D^{-1/2} g|^2` (a device scalar) that the step-size statistic reads (see
        :mod:`~pyro_bdl.inference.sgmcmc.langevin`).
    :ivar float potential_energy: the last minibatch potential energy read from the
        device (on a GPU, of the step before).
    """

    #: The method's auxiliary variables that a checkpoint saves, by attribute name.
    SAVED: ClassVar[tuple[str, ...]] = ()

    params: dict[str, torch.Tensor]
    theta: list[torch.Tensor] = field(init=False)
    current: dict[str, torch.Tensor] = field(init=False)
    step: int = 0
    iteration: int = 0
    adaptation: object = None
    scale: list[torch.Tensor] | None = None
    adapting: bool = False
    drift_norm: torch.Tensor | None = None
    potential_energy: float = math.nan

    def __post_init__(self):
        self.theta = list(self.params.values())
        self.current = {name: theta.detach() for name, theta in self.params.items()}

    def auxiliary(self) -> dict[str, object]:
        """The method's variables to checkpoint: name -> tensor, list of tensors or number."""
        return {name: getattr(self, name) for name in self.SAVED}


@dataclass(eq=False)
class StepInfo:
    """What one kernel step did.

    :ivar int step: the step's number (from 0, warm-up included).
    :ivar tuple batch: the model's ``(args, kwargs)`` at that step (its minibatch).
    :ivar float step_size: the step size it took (after the schedule).
    :ivar dict recorded: for the last step of a kept draw, device scalars of the state
        it started from (``potential_energy``, ``grad_norm``), read with the draw;
        empty otherwise.
    """

    step: int
    batch: tuple[tuple, dict]
    step_size: float
    recorded: dict[str, torch.Tensor] = field(default_factory=dict)
