"""Stochastic gradient Nose-Hoover thermostat (SGNHT)."""

from __future__ import annotations

import math

import torch

from pyro_bdl.inference.sgmcmc.sghmc import SGHMC

__all__ = ["SGNHT"]


class SGNHT(SGHMC):
    r"""Stochastic gradient Nose-Hoover thermostat, tempered.

    SGHMC whose friction is a scalar thermostat :math:`\xi` that adapts until the
    kinetic energy per dimension matches the temperature (Appendix B.3 of the
    posteriors paper, user temperature :math:`T = N\mathcal{T}`, :math:`d` parameters,
    :math:`g` the minibatch gradient of the log joint):

    .. math::

        \theta_{k+1} &= \theta_k + \frac{\epsilon}{\sigma^2} m_k, \\
        m_{k+1} &= m_k + \frac{\epsilon}{N} g(\theta_k) - \frac{\epsilon\xi_k}{\sigma^2} m_k
            + \sqrt{\frac{2\epsilon T\alpha}{N}}\,\zeta_k, \qquad \zeta_k\sim\mathcal{N}(0, I), \\
        \xi_{k+1} &= \xi_k + \epsilon\left(\frac{m_k^\top m_k}{\sigma^2 d} - \frac{T}{N}\right),

    the explicit Euler-Maruyama step of B.3: every variable moves from the current
    state. :math:`\alpha` sets only the injected noise (:math:`\alpha = 0` is a reasonable
    choice); :math:`\xi` starts at :math:`\alpha` and momenta at zero. The thermostat
    equalises the kinetic energy of the discretised momenta, which biases the position
    variance by :math:`O(\epsilon\alpha/\sigma^2)`; keep that product small. At
    :math:`T = 0` the thermostat can only grow and the dynamics do not reduce to an
    optimiser (Appendix C).

    **References**

    [1] N. Ding et al. Bayesian sampling using stochastic gradient thermostats.
    NeurIPS 2014.
    [2] S. Duffield et al. Scalable Bayesian learning with posteriors. 2024, Appendix B.3.

    Example::

        mcmc = MCMC(SGNHT(model, step_size=1e-3, friction=0.1), num_samples=50)
        mcmc.run(train_loader, len(train_set))

    :param callable model: a Pyro model.
    :param float step_size: :math:`\epsilon`.
    :param float friction: :math:`\alpha \ge 0`, the noise level and initial thermostat.
    :param float mass: :math:`\sigma^2 > 0`.
    :param float temperature: :math:`T \ge 0`.
    :param kwargs: ``num_data``, ``thin``, ``schedule``, ``init_params``, ``checkpoint``
        and the rest of :class:`~pyro_bdl.inference.sgmcmc.base.SGMCMCKernel`.
    """

    def __init__(
        self,
        model,
        step_size: float,
        friction: float = 0.1,
        mass: float = 1.0,
        temperature: float = 1.0,
        **kwargs,
    ):
        super().__init__(model, step_size, friction, mass, temperature, **kwargs)

    def _init_state(self, theta: list[torch.Tensor]) -> None:
        super()._init_state(theta)
        self.thermostat = torch.tensor(self.friction, dtype=theta[0].dtype, device=theta[0].device)
        self.dimension = sum(t.numel() for t in theta)

    def _state(self) -> dict[str, object]:
        return {**super()._state(), "thermostat": self.thermostat}

    def _extra_stats(self) -> dict[str, float]:
        return {"thermostat": float(self.thermostat)}

    def _update(self, theta: list[torch.Tensor], grads: list[torch.Tensor], step_size: float):
        # Explicit Euler as in Appendix B.3: position, momentum and thermostat all move
        # from the current momentum m_k (the gradient is already at theta_k).
        m = self.momenta
        kinetic = sum(float(torch.dot(x.reshape(-1), x.reshape(-1))) for x in m)
        torch._foreach_add_(theta, m, alpha=step_size / self.mass)
        torch._foreach_mul_(m, 1 - step_size * float(self.thermostat) / self.mass)
        torch._foreach_add_(m, grads, alpha=step_size / self.num_data)
        if self.temperature > 0:
            noise_scale = math.sqrt(
                2 * step_size * self.temperature * self.friction / self.num_data
            )
            torch._foreach_add_(m, self.standard_normal(), alpha=noise_scale)
        self.thermostat += step_size * (
            kinetic / (self.mass * self.dimension) - self.temperature / self.num_data
        )
