r"""Langevin dynamics under the adaptation's mass: SGLD's step, and the dense mass's warm-up.

The step of SGLD in the coordinates the adaptation gives (a unit mass, or the dense
mass's whitened coordinates, see :mod:`~pyro_bdl.inference.sgmcmc.dense`),

.. math::

    z \leftarrow z + \frac{\epsilon}{N} g + \sqrt{\frac{2\epsilon T}{N}}\,\xi,

and its step-size statistic, the excess of the kinetic temperature of its momentum (fresh
noise plus the kick) over a free particle's, :math:`\epsilon |g|^2 / (2 T N d)` (see
:mod:`~pyro_bdl.inference.sgmcmc.adaptation`).

SGHMC and SGNHT take this step too, in the dense mass's start buffer
(:attr:`~pyro_bdl.inference.sgmcmc.dense.DenseAdaptation.langevin`): their draws there are
discarded, so the dynamics need not be theirs, and the start buffer's metric needs
positions that Langevin dynamics give and theirs do not. See the dense module for why.
"""

from __future__ import annotations

import math

import torch

__all__ = ["squared_norm", "statistic", "update"]


def update(method, theta: list[torch.Tensor], grads: list[torch.Tensor], step_size: float):
    """One Langevin step of ``method``'s chain in place, at unit mass; during warm-up it
    keeps the squared norm of the drift for :func:`statistic`.

    :param method: the kernel (its ``state``, ``num_data``, ``temperature`` and
        ``standard_normal``).
    :param list theta: the parameters (or the dense mass's whitened displacement).
    :param list grads: the gradient of the log joint (whitened under a dense mass).
    :param float step_size: :math:`\\epsilon`.
    """
    state, num_data = method.state, method.num_data
    if state.adapting:
        state.drift_norm = squared_norm(grads)
    torch._foreach_add_(theta, grads, alpha=step_size / num_data)
    if method.temperature > 0:
        noise_scale = math.sqrt(2 * step_size * method.temperature / num_data)
        torch._foreach_add_(theta, method.standard_normal(), alpha=noise_scale)


def statistic(method, step_size: float) -> torch.Tensor:
    """The excess of a Langevin step (a device scalar), after :func:`update`: its momentum,
    fresh noise plus the kick, exceeds a free particle's kinetic temperature by
    :math:`\\epsilon |D^{-1/2} g|^2 / (2 T N d)` on average."""
    scale = 2 * method.temperature * method.num_data * method.dimension
    return method.state.drift_norm * (step_size / scale)


def squared_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """:math:`\\sum |t|^2` over the tensors, a device scalar."""
    return torch.stack(torch._foreach_norm(tensors)).square().sum()
