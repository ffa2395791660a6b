"""Stochastic gradient Hamiltonian Monte Carlo (SGHMC)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from pyro_bdl._checks import real
from pyro_bdl.inference.sgmcmc.base import SGMCMCKernel
from pyro_bdl.inference.sgmcmc.equilibrium import (  # noqa: F401 (public names here too)
    KINETIC_TOLERANCE,
    MIN_DRAWS_FOR_CHECK,
    kinetic_advice,
    kinetic_warning,
)
from pyro_bdl.inference.sgmcmc.hyperparameters import Hyperparameters
from pyro_bdl.inference.sgmcmc.state import ChainState

__all__ = ["SGHMC"]


@dataclass(eq=False)
class SGHMCState(ChainState):
    """SGHMC's chain: the parameters and their momenta :math:`m` (whitened, :math:`u =
    D^{-1/2} m`, with an adapted mass)."""

    SAVED = ("momenta",)

    momenta: list[torch.Tensor] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class SGHMCHyperparameters(Hyperparameters):
    """SGHMC's hyperparameters: the shared ones, the friction :math:`\\alpha \\ge 0` and
    the mass :math:`\\sigma^2 > 0`."""

    #: Time runs as the square root of mass over curvature.
    step_exponent: ClassVar[float] = 0.5

    friction: float = 1.0
    mass: float = 1.0

    def __post_init__(self):
        super().__post_init__()
        friction = real("friction", self.friction, non_negative=True)
        mass = real("mass", self.mass, positive=True)
        self._set(friction=friction, mass=mass)
        damping = None if self.step_size is None else self.step_size * friction / mass
        if damping is not None and damping >= 2:
            raise ValueError(
                f"step_size * friction / mass must be below 2, got {self.step_size:g} * "
                f"{friction:g} / {mass:g} = {damping:g}: each step multiplies the "
                f"momentum by 1 - step_size * friction / mass = {1 - damping:g}, so it grows "
                "without bound; lower step_size or friction, or raise mass (below 1 the "
                "momentum keeps its sign, as SGD's momentum)"
            )

    def max_adapted_step_size(self) -> float:
        # step_size * friction / mass <= 1: the momentum keeps its sign, as SGD's does.
        return self.mass / self.friction if self.friction > 0 else math.inf

    def relaxation_rate(self) -> float:
        # the kinetic energy forgets at the friction's rate
        return self.friction / self.mass


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

    **Warm-up adaptation** (``adapt_step_size`` and ``adapt_mass_matrix``, Pyro's names,
    on by default at :math:`T > 0`): warm-up learns a diagonal mass :math:`\sigma^2 D`
    from the squared gradients (``mass`` then scales it) and the step size; the momenta
    are then kept whitened, :math:`u = D^{-1/2} m`, and the step is

    .. math::

        u &\leftarrow u + \frac{\epsilon}{N} D^{-1/2} g - \frac{\epsilon\alpha}{\sigma^2}
            u + \sqrt{\frac{2\epsilon T\alpha}{N}}\,\xi, \\
        \theta &\leftarrow \theta + \frac{\epsilon}{\sigma^2} D^{-1/2} u,

    SGHMC with mass :math:`\sigma^2 D` and friction :math:`\alpha D` (the same damping
    rate :math:`\alpha/\sigma^2` in every direction), fixed after warm-up. See
    :mod:`~pyro_bdl.inference.sgmcmc.adaptation`; ``step_size`` is then optional. A
    model of at most 200 parameters gets a dense mass :math:`(L L^\top)^{-1}` instead
    (:mod:`~pyro_bdl.inference.sgmcmc.dense`): the same step with :math:`L` for
    :math:`D^{-1/2}`; its start buffer takes Langevin steps, whose positions the first
    dense metric needs (see :mod:`~pyro_bdl.inference.sgmcmc.dense`).
    ``step_size * friction / mass`` must be below 2 (the momentum's factor per step,
    :math:`1 - \epsilon\alpha/\sigma^2`, would otherwise reach -1).

    **Kinetic temperature.** In equilibrium the momenta are :math:`\mathcal{N}(0,
    \sigma^2 T / N)`, so the sample statistic ``kinetic_temperature``,
    :math:`N m^\top m / (\sigma^2 d)` over the :math:`d` parameters at each kept draw,
    fluctuates around :math:`T` (in the user's units; :math:`T / (1 - \epsilon\alpha /
    (2\sigma^2))` for this discretisation of a free particle, within 1 % of the exact
    stationary value on Gaussian targets at :math:`\epsilon\lambda \le 0.4`) with a
    relative spread :math:`\sqrt{2/d}` per draw. When a chain ends, the mean over the
    later and over the earlier half of its kept draws are each compared with that
    target; a distance beyond ``KINETIC_TOLERANCE`` (0.1) plus four standard errors (the
    draws' spread, at least the chi-square spread :math:`T\sqrt{2/d}`, over the square
    root of their number of independent values, which the friction bounds) is a
    warning: a cold chain is still settling from its start or
    over-damped, a hot one is heated by minibatch gradient noise (lower the step size
    or raise the friction). No check at :math:`T = 0`, nor with fewer than
    ``MIN_DRAWS_FOR_CHECK`` (40) draws (see :mod:`~pyro_bdl.inference.sgmcmc.equilibrium`).

    **References**

    [1] T. Chen, E. Fox, C. Guestrin. Stochastic gradient Hamiltonian Monte Carlo.
    ICML 2014.
    [2] S. Duffield et al. Scalable Bayesian learning with posteriors. 2024,
    Appendices B.2 and C.

    Example::

        kernel = SGHMC(model, friction=1.0, temperature=1.0)  # step size adapted
        mcmc = MCMC(kernel, num_samples=500, warmup_steps=500)
        mcmc.run(train_loader, len(train_set))

    :param callable model: a Pyro model.
    :param float step_size: :math:`\epsilon` (with adaptation, where it starts).
    :param float friction: :math:`\alpha \ge 0`.
    :param float mass: :math:`\sigma^2 > 0`.
    :param float temperature: :math:`T \ge 0`.
    :param kwargs: ``adapt_step_size``, ``adapt_mass_matrix``, ``target_excess``,
        ``num_data``, ``thin``, ``schedule`` (see
        :class:`~pyro_bdl.inference.sgmcmc.hyperparameters.Hyperparameters`),
        ``init_params``, ``checkpoint`` and the rest of
        :class:`~pyro_bdl.inference.sgmcmc.base.SGMCMCKernel`.
    """

    Hyperparameters = SGHMCHyperparameters

    def __init__(
        self,
        model,
        step_size: float | None = None,
        friction: float = 1.0,
        mass: float = 1.0,
        temperature: float = 1.0,
        **kwargs,
    ):
        super().__init__(model, step_size, temperature, friction=friction, mass=mass, **kwargs)

    def init(self, params: dict[str, torch.Tensor]) -> SGHMCState:
        return SGHMCState(params, momenta=[torch.zeros_like(t) for t in params.values()])

    @property
    def momenta(self) -> list[torch.Tensor]:
        """The chain's momenta, one tensor per site (updated in place)."""
        return self.state.momenta

    def extra_stats(self) -> dict[str, torch.Tensor | float]:
        if self.state is None:  # names only, before set-up
            return {"kinetic_temperature": math.nan}
        return {"kinetic_temperature": self.kinetic_energy() * (self.num_data / self.dimension)}

    def kinetic_energy(self) -> torch.Tensor:
        """:math:`m^\\top m / \\sigma^2` on the device (twice the kinetic energy)."""
        return torch.stack(torch._foreach_norm(self.state.momenta)).square().sum() / self.mass

    def _decay(self, step_size: float) -> float | torch.Tensor:
        """The momenta's factor per step, ``1 - step_size * friction / mass``."""
        return 1 - step_size * self.friction / self.mass

    def update(self, theta: list[torch.Tensor], grads: list[torch.Tensor], step_size: float):
        m, scale, num_data = self.state.momenta, self.state.scale, self.num_data
        torch._foreach_mul_(m, self._decay(step_size))
        if scale is None:
            torch._foreach_add_(m, grads, alpha=step_size / num_data)
        else:
            # With an adapted diagonal mass sigma^2 D the momenta are whitened by D^{1/2}:
            # the noise and the friction stay scalars, the kinetic energy m^T m / sigma^2.
            torch._foreach_addcmul_(m, grads, scale, value=step_size / num_data)
        if self.temperature > 0:
            noise_scale = math.sqrt(2 * step_size * self.temperature * self.friction / num_data)
            torch._foreach_add_(m, self.standard_normal(), alpha=noise_scale)
        if scale is None:
            torch._foreach_add_(theta, m, alpha=step_size / self.mass)
        else:
            torch._foreach_addcmul_(theta, m, scale, value=step_size / self.mass)

    # -- warm-up adaptation ----------------------------------------------------------

    def _free_kinetic_temperature(self, step_size: float) -> float:
        """The kinetic temperature of these discretised momenta for a free particle."""
        return self.temperature / (1 - step_size * self.friction / (2 * self.mass))

    def adaptation_statistic(self, step_size: float) -> torch.Tensor:
        kinetic = self.kinetic_energy() * (self.num_data / self.dimension)
        return kinetic / self._free_kinetic_temperature(step_size) - 1

    def draw_statistic(self, stats: dict[str, float], step_size: float) -> float | None:
        # the statistic above, from the kinetic temperature a kept draw records (none at
        # T = 0, nor where a schedule took the momenta's factor to -1 or beyond)
        if self.temperature == 0 or step_size * self.friction / self.mass >= 2:
            return None
        return stats["kinetic_temperature"] / self._free_kinetic_temperature(step_size) - 1

    def refresh(self) -> None:
        # A Gibbs draw of the momenta from their stationary law, independent of theta.
        variance = self.mass * self._free_kinetic_temperature(self.current_step_size())
        momenta = self.state.momenta
        torch._foreach_mul_(momenta, 0.0)
        torch._foreach_add_(
            momenta, self.standard_normal(), alpha=math.sqrt(variance / self.num_data)
        )

    # -- equilibrium (see pyro_bdl.inference.sgmcmc.equilibrium) ---------------------

    def equilibrium_warning(self) -> str | None:
        # The target, the rate and the advice are this method's (SGNHT's differ).
        rules = (self._kinetic_target, self._decorrelation_rate, self._equilibrium_advice)
        return kinetic_warning(self.kept.stats, self.temperature, self.thin, self.dimension, *rules)

    def _kinetic_target(self) -> float:
        """The expected kinetic temperature of this discretisation in equilibrium (with
        an adapted step size, 1 + the average excess it was tuned to included)."""
        adaptation = self.state.adaptation
        tuned = adaptation is not None and self.adapt_step_size
        excess = 1 + adaptation.average_excess if tuned else 1.0
        return self._free_kinetic_temperature(self.adapted_step_size) * excess

    def _decorrelation_rate(self, part: slice) -> float:
        """The rate (per unit time) at which the momenta's energy decorrelates."""
        return self.friction / self.mass

    def _equilibrium_advice(self, cold: bool) -> str:
        return kinetic_advice(cold)
