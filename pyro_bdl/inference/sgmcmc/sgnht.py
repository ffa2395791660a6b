"""Stochastic gradient Nose-Hoover thermostat (SGNHT)."""

from __future__ import annotations

import math

import torch

from pyro_bdl.inference.sgmcmc.base import SGMCMCKernel, _check_positive

__all__ = ["SGNHT"]


class SGNHT(SGMCMCKernel):
    r"""Stochastic gradient Nose-Hoover thermostat, tempered.

    SGHMC whose friction is a scalar thermostat :math:`\xi` that adapts until the
    kinetic energy per dimension matches the temperature (Appendix B.3 of the
    posteriors paper, user temperature :math:`T = N\mathcal{T}`, :math:`d` parameters):

    .. math::

        m &\leftarrow m + \frac{\epsilon}{N} g - \frac{\epsilon\xi}{\sigma^2} m
            + \sqrt{\frac{2\epsilon T\alpha}{N}}\,\zeta, \qquad \zeta\sim\mathcal{N}(0, I), \\
        \theta &\leftarrow \theta + \frac{\epsilon}{\sigma^2} m, \\
        \xi &\leftarrow \xi + \epsilon\left(\frac{m^\top m}{\sigma^2 d} - \frac{T}{N}\right).

    As in Ding et al. (2014, Algorithm 2) and in :class:`SGHMC`, the position and the
    thermostat use the new momentum. :math:`\alpha` sets only the injected noise
    (:math:`\alpha = 0` is a reasonable choice); :math:`\xi` starts at :math:`\alpha`
    and momenta at zero. Note that at :math:`T = 0` the thermostat can only grow and
    the dynamics do not reduce to an optimiser (Appendix C).

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
        super().__init__(model, step_size, temperature, **kwargs)
        self.friction = _check_positive("friction", friction, allow_zero=True)
        self.mass = _check_positive("mass", mass)

    def hyperparameters(self) -> dict:
        return {**super().hyperparameters(), "friction": self.friction, "mass": self.mass}

    def _init_state(self, theta: list[torch.Tensor]) -> None:
        self.momenta = [torch.zeros_like(t) for t in theta]
        self.thermostat = torch.tensor(self.friction, dtype=theta[0].dtype, device=theta[0].device)
        self.dimension = sum(t.numel() for t in theta)

    def _state(self) -> dict[str, object]:
        return {"momenta": self.momenta, "thermostat": self.thermostat}

    def _extra_stats(self) -> dict[str, float]:
        return {"thermostat": float(self.thermostat) if hasattr(self, "thermostat") else math.nan}

    def _update(self, theta: list[torch.Tensor], grads: list[torch.Tensor], step_size: float):
        m = self.momenta
        friction = 1 - step_size * float(self.thermostat) / self.mass
        torch._foreach_mul_(m, friction)
        torch._foreach_add_(m, grads, alpha=step_size / self.num_data)
        if self.temperature > 0:
            noise_scale = math.sqrt(
                2 * step_size * self.temperature * self.friction / self.num_data
            )
            torch._foreach_add_(m, self.standard_normal(), alpha=noise_scale)
        torch._foreach_add_(theta, m, alpha=step_size / self.mass)
        kinetic = sum(float(torch.dot(x.reshape(-1), x.reshape(-1))) for x in m)
        self.thermostat += step_size * (
            kinetic / (self.mass * self.dimension) - self.temperature / self.num_data
        )
