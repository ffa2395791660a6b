"""Step-size schedules for the SGMCMC kernels.

A schedule is a callable ``t -> multiplier``: at kernel step ``t`` (counting from 0,
warm-up included) the step size is ``step_size * schedule(t)``.
"""

from __future__ import annotations

from pyro_bdl._checks import integer, real

__all__ = ["Constant", "RobbinsMonro"]


class Constant:
    """The same step size at every step (multiplier 1).

    Example::

        SGLD(model, step_size=1e-3, schedule=Constant())
    """

    def __call__(self, t: int) -> float:
        _step(t)
        return 1.0

    def __repr__(self) -> str:
        return "Constant()"


class RobbinsMonro:
    r"""Polynomial decay :math:`\epsilon_t = a (b + t)^{-\gamma}`.

    With ``gamma`` in (0.5, 1] the steps satisfy the Robbins-Monro conditions
    :math:`\sum_t \epsilon_t = \infty`, :math:`\sum_t \epsilon_t^2 < \infty` under
    which SGLD's bias vanishes asymptotically (Welling and Teh, 2011). As a multiplier
    of the kernel's ``step_size`` it is ``(b / (b + t)) ** gamma``, so the first step
    is ``step_size`` and :math:`a = \text{step\_size} \cdot b^{\gamma}`.

    **References**

    [1] M. Welling, Y. W. Teh. Bayesian learning via stochastic gradient Langevin
    dynamics. ICML 2011.

    Example::

        SGLD(model, step_size=1e-2, schedule=RobbinsMonro(b=1000.0, gamma=0.55))

    :param float b: offset, positive; larger values decay later.
    :param float gamma: decay exponent, in (0, 1].
    """

    def __init__(self, b: float = 1000.0, gamma: float = 0.55):
        self.b = real("b", b, positive=True)
        self.gamma = real("gamma", gamma, positive=True, high=1.0)

    def __call__(self, t: int) -> float:
        return (self.b / (self.b + _step(t))) ** self.gamma

    def __repr__(self) -> str:
        return f"RobbinsMonro(b={self.b}, gamma={self.gamma})"


def _step(t: int) -> int:
    """The kernel step ``t``, checked (a plain int passes without a call)."""
    return t if type(t) is int and t >= 0 else integer("t", t, low=0)
