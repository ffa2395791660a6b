"""Stochastic gradient Hamiltonian Monte Carlo (SGHMC)."""

from __future__ import annotations

import math

import torch

from pyro_bdl.inference.sgmcmc.base import SGMCMCKernel, _check_positive

__all__ = ["SGHMC"]


class SGHMC(SGMCMCKernel):
    r"""Stochastic gradient Hamiltonian Monte Carlo, tempered.

    Momenta :math:`m` with mass :math:`\sigma^2` and friction :math:`\alpha`
    (Appendix B.2 of the posteriors paper, user temperature :math:`T = N\mathcal{T}`);
    the momentum moves first and the position uses the new momentum, the order of
    PyTorch's SGD:

    .. math::

        m &\leftarrow m + \frac{\epsilon}{N} g - \frac{\epsilon\alpha}{\sigma^2} m
            + \sqrt{\frac{2\epsilon T\alpha}{N}}\,\xi, \qquad \xi\sim\mathcal{N}(0, I), \\
        \theta &\leftarrow \theta + \frac{\epsilon}{\sigma^2} m.

    The stationary law of :math:`\theta` is :math:`p(\theta\mid y)^{1/T}`. At
    :math:`T = 0` this is exactly ``torch.optim.SGD(lr=eps / sigma^2,
    momentum=1 - eps * alpha / sigma^2, dampening=1 - eps)`` on the loss
    :math:`-\log\hat p(\theta)/N` (Appendix C, eq. 10), with the momentum buffer
    starting at zero. Momenta start at zero.

    **References**

    [1] T. Chen, E. Fox, C. Guestrin. Stochastic gradient Hamiltonian Monte Carlo.
    ICML 2014.
    [2] S. Duffield et al. Scalable Bayesian learning with posteriors. 2024,
    Appendices B.2 and C.

    Example::

        kernel = SGHMC(model, step_size=1e-3, friction=1.0, temperature=1.0)
        mcmc = MCMC(kernel, num_samples=50, warmup_steps=500)
        mcmc.run(train_loader, len(train_set))

    :param callable model: a Pyro model.
    :param float step_size: :math:`\epsilon`.
    :param float friction: :math:`\alpha \ge 0`.
    :param float mass: :math:`\sigma^2 > 0`.
    :param float temperature: :math:`T \ge 0`.
    :param kwargs: ``num_data``, ``thin``, ``schedule``, ``init_params``, ``checkpoint``
        and the rest of :class:`~pyro_bdl.inference.sgmcmc.base.SGMCMCKernel`.
    """

    def __init__(
        self,
        model,
        step_size: float,
        friction: float = 1.0,
        mass: float = 1.0,
        temperature: float = 1.0,
        **kwargs,
    ):
        super().__init__(model, step_size, temperature, **kwargs)
        self.friction = _check_positive("friction", friction, allow_zero=True)
        self.mass = _check_positive("mass", mass)

    def hyperparameters(self) -> dict:
        return {**super().hyperparameters(), "friction": self.friction, "mass": self.mass}

    def _init_state(self, theta: list[torch.Tensor]) -> None:
        self.momenta = [torch.zeros_like(t) for t in theta]

    def _state(self) -> dict[str, object]:
        return {"momenta": self.momenta}

    def _update(self, theta: list[torch.Tensor], grads: list[torch.Tensor], step_size: float):
        m = self.momenta
        torch._foreach_mul_(m, 1 - step_size * self.friction / self.mass)
        torch._foreach_add_(m, grads, alpha=step_size / self.num_data)
        if self.temperature > 0:
            noise_scale = math.sqrt(
                2 * step_size * self.temperature * self.friction / self.num_data
            )
            torch._foreach_add_(m, self.standard_normal(), alpha=noise_scale)
        torch._foreach_add_(theta, m, alpha=step_size / self.mass)
