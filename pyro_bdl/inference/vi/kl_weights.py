r"""Weights of the KL term per minibatch (BLoB, Appendix B.1).

The minibatch objective is :math:`-\mathbb{E}_q[\log P(\mathcal{D}_i \mid W)] + \lambda_i
\mathrm{KL}` with weights that sum to about one over a cycle of :math:`M` minibatches (eq.
70). BLoB grows them within each cycle, :math:`\lambda_i = 2^i / (2^{M+1} - 1)` for
:math:`i = 1, \dots, M`, so that the data are fitted first and the complexity cost later;
Graves (2011) uses :math:`\lambda_i = 1 / M`. BLoB's cycle is the dataset size rescaled to
:math:`L^* = 100\, L_0^{\pi / \gamma}` (eq. 71) divided by the batch size.
"""

from __future__ import annotations

import math

from pyro_bdl._checks import integer, real

__all__ = ["blob_kl_cycle", "exponential_kl_weight", "uniform_kl_weight"]


def blob_kl_cycle(num_data: int, batch_size: int, gamma: float = 8.0) -> int:
    r"""The cycle length :math:`M = L^* / B` with :math:`L^* = 100\, L_0^{\pi/\gamma}` (eq. 71).

    :param int num_data: the training-set size :math:`L_0`.
    :param int batch_size: the minibatch size :math:`B`.
    :param float gamma: :math:`\gamma` (8 in all the paper's experiments).
    :return: :math:`M \ge 1` (the reference code truncates :math:`L^*/B` to an integer).
    """
    num_data = integer("num_data", num_data, low=1)
    batch_size = integer("batch_size", batch_size, low=1)
    gamma = real("gamma", gamma, positive=True)
    return max(1, int(100 * num_data ** (math.pi / gamma) / batch_size))


def exponential_kl_weight(step: int, cycle: int) -> float:
    r""":math:`\lambda_i = 2^i / (2^{M+1} - 1)` with :math:`i = (\text{step} \bmod M) + 1`.

    Computed as :math:`2^{i-M-1} / (1 - 2^{-M-1})`, which underflows to 0 for the early
    minibatches of a long cycle instead of overflowing (:math:`2^{1100}` is no double).

    :param int step: the training step, from 0.
    :param int cycle: the cycle length :math:`M`.
    """
    step, cycle = _check(step, cycle)
    i = step % cycle + 1
    return math.ldexp(1.0, i - cycle - 1) / -math.expm1(-(cycle + 1) * math.log(2.0))


def uniform_kl_weight(step: int, cycle: int) -> float:
    r""":math:`\lambda_i = 1 / M` (Graves, 2011).

    :param int step: the training step (unused: every step weighs the same).
    :param int cycle: the number of minibatches :math:`M` per epoch.
    """
    _, cycle = _check(step, cycle)
    return 1.0 / cycle


def _check(step: int, cycle: int) -> tuple[int, int]:
    return integer("step", step, low=0), integer("cycle", cycle, low=1)
