"""The warm-up adaptation a chain gets: which one, with the method's rules.

The kernel composes its adaptation as Pyro's ``HMC`` composes its ``WarmupAdapter``: it
asks :func:`new_adaptation` for one at set-up, then calls it at each warm-up step (see
``Adaptation`` in :mod:`~pyro_bdl.inference.sgmcmc.adaptation` for the calls). The diagonal
mass is :mod:`~pyro_bdl.inference.sgmcmc.adaptation`'s, the dense one
:mod:`~pyro_bdl.inference.sgmcmc.dense`'s; the method's rules (how the step size scales
with the mass, its bound, the statistic's memory) come from its hyperparameter record.
"""

from __future__ import annotations

import torch

from pyro_bdl.inference.sgmcmc.adaptation import Adaptation
from pyro_bdl.inference.sgmcmc.dense import DenseAdaptation, dense_by_default, one_device
from pyro_bdl.inference.sgmcmc.hyperparameters import Hyperparameters

__all__ = ["WarmupResults", "new_adaptation"]


def new_adaptation(
    hyper: Hyperparameters,
    theta: list[torch.Tensor],
    warmup_steps: int,
    num_data: int,
    data_parallel: bool,
) -> Adaptation | None:
    """The adaptation of a chain at ``theta``, or None when nothing adapts (temperature
    0, no warm-up, or both flags off: the kernel is then the fixed one, step for step).

    :param hyper: the kernel's :class:`~pyro_bdl.inference.sgmcmc.hyperparameters.Hyperparameters`.
    :param list theta: the chain's parameters.
    :param int warmup_steps: the warm-up steps.
    :param int num_data: N.
    :param bool data_parallel: one chain across the ranks of a job.
    """
    flags = hyper.adapt_step_size or hyper.adapt_mass_matrix
    if warmup_steps == 0 or hyper.temperature == 0 or not flags:
        if hyper.step_size is None:
            raise ValueError(
                "step_size: none given, and with warmup_steps=0 nothing is adapted; give "
                "a step size, or warm-up steps in which to find one"
            )
        return None
    settings = dict(
        adapt_step_size=hyper.adapt_step_size,
        adapt_mass_matrix=hyper.adapt_mass_matrix,
        target_excess=hyper.target_excess,
        scale=num_data * hyper.temperature,
        start=2 * hyper.target_excess,
        step_exponent=hyper.step_exponent,
        max_step_size=hyper.max_adapted_step_size(),
        relaxation=hyper.relaxation_rate(),
        data_parallel=data_parallel,
    )
    dense = dense_by_default(theta) if hyper.dense_mass is None else hyper.dense_mass
    if dense and not one_device(theta):
        raise ValueError(
            "dense_mass=True needs the model's unconstrained parameters on one device; "
            "move the model's sites to one device, or pass dense_mass=False"
        )
    if dense and hyper.adapt_mass_matrix:
        return DenseAdaptation(
            theta,
            warmup_steps,
            hyper.step_size,
            num_data=num_data,
            temperature=hyper.temperature,
            **settings,
        )
    return Adaptation(theta, warmup_steps, hyper.step_size, **settings)


class WarmupResults:
    """What warm-up found, as a kernel's properties (the kernel's ``state`` holds the
    adaptation; its hyperparameters ``step_size`` and ``adapt_step_size``)."""

    @property
    def _adaptation(self) -> Adaptation | None:
        return None if self.state is None else self.state.adaptation

    @property
    def adapted_step_size(self) -> float | None:
        """The step size the chain runs with after warm-up (None before set-up, or while
        it is still to be found from the first gradient)."""
        adaptation = self._adaptation
        return self.step_size if adaptation is None else adaptation.step_size

    @property
    def stiffness(self) -> float | None:
        """How much stiffer than the average (after the mass) the stiffest direction
        found in warm-up is; the kept step size was lowered for it when above 1 (see
        :mod:`~pyro_bdl.inference.sgmcmc.stiffness`). None without step-size adaptation."""
        adaptation = self._adaptation
        return None if adaptation is None or not self.adapt_step_size else adaptation.stiffness

    @property
    def recoveries(self) -> list[int]:
        """The warm-up steps at which the chain diverged and was set back to its last sane
        state with half the step size (see :mod:`~pyro_bdl.inference.sgmcmc.recovery`)."""
        return [] if self.run is None else list(self.run.recoveries)

    @property
    def inverse_mass_matrix(self) -> dict[str, torch.Tensor] | None:
        """The adapted inverse mass per site (None when the mass is not adapted): the
        diagonal :math:`D^{-1}` shaped like each site's unconstrained value (the
        preconditioner of SGLD, the inverse mass of SGHMC and SGNHT over ``mass``); with
        a dense mass one entry keyed by the tuple of every site's name (as Pyro's HMC
        keys a ``full_mass`` group), the :math:`d \\times d` matrix over the flattened
        values in order."""
        adaptation = self._adaptation
        return None if adaptation is None else adaptation.inverse_mass_matrix_of(self.state.params)

    @property
    def gradient_noise(self) -> float | None:
        """The minibatch gradient noise relative to the gradients' signal that warm-up
        measured (see :attr:`~pyro_bdl.inference.sgmcmc.dense.DenseAdaptation.
        gradient_noise`); None without it (no adaptation, or a diagonal mass)."""
        adaptation = self._adaptation
        return None if adaptation is None else adaptation.gradient_noise
