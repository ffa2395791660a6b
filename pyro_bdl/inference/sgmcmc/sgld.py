"""Stochastic gradient Langevin dynamics (SGLD)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pyro_bdl.inference.sgmcmc import langevin
from pyro_bdl.inference.sgmcmc.base import SGMCMCKernel
from pyro_bdl.inference.sgmcmc.hyperparameters import Hyperparameters
from pyro_bdl.inference.sgmcmc.state import ChainState

__all__ = ["SGLD"]


@dataclass(eq=False)
class SGLDState(ChainState):
    """SGLD's chain: the parameters alone (nothing auxiliary to save).

    :ivar inverse_mass: after warm-up, the adapted :math:`D^{-1}` (derived from
        ``scale``, so not saved), which makes a step two passes over the parameters.
    """

    inverse_mass: list[torch.Tensor] | None = None


@dataclass(frozen=True, kw_only=True)
class SGLDHyperparameters(Hyperparameters):
    """SGLD's hyperparameters: the shared ones (the step size scales as mass over
    curvature, ``step_exponent`` 1)."""


class SGLD(SGMCMCKernel):
    r"""Stochastic gradient Langevin dynamics, tempered.

    The Euler-Maruyama step of :math:`d\theta = N^{-1}\nabla\log\pi(\theta)\,dt +
    \sqrt{2T/N}\,dw` (Appendix B.1 of the posteriors paper, user temperature
    :math:`T = N\mathcal{T}`):

    .. math::

        \theta \leftarrow \theta + \frac{\epsilon}{N} g
            + \sqrt{\frac{2 \epsilon T}{N}}\, \xi, \qquad \xi \sim \mathcal{N}(0, I),

    with :math:`g = \nabla\log p(\theta) + \frac{N}{B}\sum_{i\in\text{batch}}
    \nabla\log p(y_i\mid\theta)`. Its stationary law is :math:`p(\theta\mid y)^{1/T}`;
    at :math:`T = 0` it is SGD with learning rate :math:`\epsilon` on
    :math:`-\log \hat p(\theta)/N`.

    **Warm-up adaptation** (``adapt_step_size`` and ``adapt_mass_matrix``, Pyro's names,
    on by default): warm-up learns a diagonal preconditioner :math:`D^{-1}` from the
    squared gradients and the step size, and the step is then

    .. math::

        \theta \leftarrow \theta + \frac{\epsilon}{N} D^{-1} g
            + \sqrt{\frac{2 \epsilon T}{N}}\, D^{-1/2} \xi,

    fixed after warm-up, so its stationary law is still the posterior's (a constant
    preconditioner needs no correction term). See
    :mod:`~pyro_bdl.inference.sgmcmc.adaptation`; ``step_size`` is then optional. A
    model of at most 200 parameters gets a dense preconditioner :math:`M^{-1} = L
    L^\top` instead, from the positions and gradients of the warm-up's windows (see
    :mod:`~pyro_bdl.inference.sgmcmc.dense`), and the step is :math:`\theta \leftarrow
    \theta + \frac{\epsilon}{N} M^{-1} g + \sqrt{2\epsilon T/N}\, L \xi`.

    **References**

    [1] M. Welling, Y. W. Teh. Bayesian learning via stochastic gradient Langevin
    dynamics. ICML 2011.
    [2] S. Duffield et al. Scalable Bayesian learning with posteriors. 2024, Appendix B.1.

    Example::

        mcmc = MCMC(SGLD(model), num_samples=1000, warmup_steps=1000)
        mcmc.run(train_loader, len(train_set))

    :param callable model: a Pyro model.
    :param float step_size: :math:`\epsilon` (with adaptation, where it starts).
    :param float temperature: :math:`T \ge 0`.
    :param kwargs: ``adapt_step_size``, ``adapt_mass_matrix``, ``target_excess``,
        ``num_data``, ``thin``, ``schedule`` (see
        :class:`~pyro_bdl.inference.sgmcmc.hyperparameters.Hyperparameters`),
        ``init_params``, ``checkpoint`` and the rest of
        :class:`~pyro_bdl.inference.sgmcmc.base.SGMCMCKernel`.
    """

    Hyperparameters = SGLDHyperparameters

    def __init__(self, model, step_size: float | None = None, temperature: float = 1.0, **kwargs):
        super().__init__(model, step_size, temperature, **kwargs)

    def init(self, params: dict[str, torch.Tensor]) -> SGLDState:
        return SGLDState(params)

    def update(self, theta: list[torch.Tensor], grads: list[torch.Tensor], step_size: float):
        state, num_data = self.state, self.num_data
        scale = state.scale
        if scale is None:
            langevin.update(self, theta, grads, step_size)
            return
        noise_scale = math.sqrt(2 * step_size * self.temperature / num_data)
        if not state.adapting:
            # The mass is fixed: theta += eps / N D^{-1} g + sqrt(2 eps T / N) D^{-1/2} xi,
            # two passes, as many as the fixed kernel's.
            if state.inverse_mass is None:
                state.inverse_mass = torch._foreach_mul(scale, scale)
            torch._foreach_addcmul_(theta, grads, state.inverse_mass, value=step_size / num_data)
            if self.temperature > 0:
                torch._foreach_addcmul_(theta, self.standard_normal(), scale, value=noise_scale)
            return
        # theta += D^{-1/2} (eps / N D^{-1/2} g + sqrt(2 eps T / N) xi), built in the
        # gradient tensors, which belong to this step.
        torch._foreach_mul_(grads, scale)
        state.drift_norm = langevin.squared_norm(grads)
        if self.temperature > 0:
            torch._foreach_add_(
                grads, self.standard_normal(), alpha=noise_scale * num_data / step_size
            )
        torch._foreach_addcmul_(theta, grads, scale, value=step_size / num_data)

    def adaptation_statistic(self, step_size: float) -> torch.Tensor:
        # SGLD is SGHMC with step_size * friction / mass = 1 (see langevin.statistic)
        return langevin.statistic(self, step_size)
