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

__all__ = ["blob_kl_cycle", "exponential_kl_weight", "uniform_kl_weight"]


def blob_kl_cycle(num_data: int, batch_size: int, gamma: float = 8.0) -> int:
    r"""The cycle length :math:`M = L^* / B` with :math:`L^* = 100\, L_0^{\pi/\gamma}` (eq. 71).

    :param int num_data: the training-set size :math:`L_0`.
    :param int batch_size: the minibatch size :math:`B`.
    :param float gamma: :math:`\gamma` (8 in all the paper's experiments).
    :return: :math:`M \ge 1` (the reference code truncates :math:`L^*/B` to an integer).
    """
    for name, value in (("num_data", num_data), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"blob_kl_cycle: {name} must be a positive int, got {value!r}")
    if not gamma > 0:
        raise ValueError(f"blob_kl_cycle: gamma must be positive, got {gamma!r}")
    return max(1, int(100 * num_data ** (math.pi / gamma) / batch_size))


def exponential_kl_weight(step: int, cycle: int) -> float:
    r""":math:`\lambda_i = 2^i / (2^{M+1} - 1)` with :math:`i = (\text{step} \bmod M) + 1`.

    Computed as :math:`2^{i-M-1} / (1 - 2^{-M-1})`, which underflows to 0 for the early
    minibatches of a long cycle instead of overflowing (:math:`2^{1100}` is no double).

    :param int step: the training step, from 0.
    :param int cycle: the cycle length :math:`M`.
    """
    _check_cycle(cycle)
    i = step % cycle + 1
    return math.ldexp(1.0, i - cycle - 1) / -math.expm1(-(cycle + 1) * math.log(2.0))


def uniform_kl_weight(step: int, cycle: int) -> float:
    r""":math:`\lambda_i = 1 / M` (Graves, 2011).

    :param int step: the training step (unused: every step weighs the same).
    :param int cycle: the number of minibatches :math:`M` per epoch.
    """
    _check_cycle(cycle)
    return 1.0 / cycle


def _check_cycle(cycle: int) -> None:
    if isinstance(cycle, bool) or not isinstance(cycle, int) or cycle < 1:
        raise ValueError(f"the KL cycle length must be a positive int, got {cycle!r}")
