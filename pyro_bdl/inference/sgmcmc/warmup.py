"""The warm-up adaptation a chain gets: which one, with the method's rules.

The kernel composes its adaptation as Pyro's ``HMC`` composes its ``WarmupAdapter``: it
asks :func:`new_adaptation` for one at set-up, then calls it at each warm-up step (see
:class:`~pyro_bdl.inference.sgmcmc.adaptation.Adaptation` for the calls). The diagonal
mass is :mod:`~pyro_bdl.inference.sgmcmc.adaptation`'s, the dense one
:mod:`~pyro_bdl.inference.sgmcmc.dense`'s; the method's rules (how the step size scales
with the mass, its bound, the statistic's memory) come from its hyperparameter record.
"""

from __future__ import annotations

import torch

from pyro_bdl.inference.sgmcmc.adaptation import Adaptation
from pyro_bdl.inference.sgmcmc.dense import DenseAdaptation, dense_by_default, one_device
from pyro_bdl.inference.sgmcmc.hyperparameters import Hyperparameters

__all__ = ["new_adaptation"]


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
