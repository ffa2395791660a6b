"""Stochastic gradient Hamiltonian Monte Carlo (SGHMC)."""

from __future__ import annotations

import math

import numpy as np
import torch

from pyro_bdl._checks import real
from pyro_bdl.diagnostics import _ess
from pyro_bdl.inference.sgmcmc.base import SGMCMCKernel

__all__ = ["SGHMC"]

#: Relative distance of the mean kinetic temperature from its target that the
#: equilibrium check allows beyond its Monte Carlo error: discretisation (of order
#: ``step_size * curvature``) and minibatch-noise heating smaller than this bias the
#: position variances by similar, small amounts; beyond it the draws are too wide or
#: too narrow by as much.
KINETIC_TOLERANCE = 0.1
#: Fewest kept draws for the equilibrium check (each half's error estimate needs
#: an autocorrelation).
MIN_DRAWS_FOR_CHECK = 40


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
    :mod:`~pyro_bdl.inference.sgmcmc.adaptation`; ``step_size`` is then optional.
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
    ``MIN_DRAWS_FOR_CHECK`` (40) draws.

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
        ``num_data``, ``thin``, ``schedule``, ``init_params``, ``checkpoint`` and the rest
        of :class:`~pyro_bdl.inference.sgmcmc.base.SGMCMCKernel`.
    """

    def __init__(
        self,
        model,
        step_size: float | None = None,
        friction: float = 1.0,
        mass: float = 1.0,
        temperature: float = 1.0,
        **kwargs,
    ):
        super().__init__(model, step_size, temperature, **kwargs)
        self.friction = real("friction", friction, non_negative=True)
        self.mass = real("mass", mass, positive=True)
        damping = None if self.step_size is None else self.step_size * self.friction / self.mass
        if damping is not None and damping >= 2:
            raise ValueError(
                f"step_size * friction / mass must be below 2, got {self.step_size:g} * "
                f"{self.friction:g} / {self.mass:g} = {damping:g}: each step multiplies the "
                f"momentum by 1 - step_size * friction / mass = {1 - damping:g}, so it grows "
                "without bound; lower step_size or friction, or raise mass (below 1 the "
                "momentum keeps its sign, as SGD's momentum)"
            )

    def hyperparameters(self) -> dict:
        return {**super().hyperparameters(), "friction": self.friction, "mass": self.mass}

    def _init_state(self, theta: list[torch.Tensor]) -> None:
        self.momenta = [torch.zeros_like(t) for t in theta]

    def _state(self) -> dict[str, object]:
        return {"momenta": self.momenta}

    def _extra_stats(self) -> dict[str, torch.Tensor | float]:
        if not hasattr(self, "momenta"):  # names only, before set-up
            return {"kinetic_temperature": math.nan}
        return {"kinetic_temperature": self.kinetic_energy() * (self.num_data / self.dimension)}

    def kinetic_energy(self) -> torch.Tensor:
        """:math:`m^\\top m / \\sigma^2` on the device (twice the kinetic energy)."""
        return torch.stack(torch._foreach_norm(self.momenta)).square().sum() / self.mass

    def _decay(self, step_size: float) -> float | torch.Tensor:
        """The momenta's factor per step, ``1 - step_size * friction / mass``."""
        return 1 - step_size * self.friction / self.mass

    def _update(self, theta: list[torch.Tensor], grads: list[torch.Tensor], step_size: float):
        m, num_data = self.momenta, self.num_data
        torch._foreach_mul_(m, self._decay(step_size))
        if self._scale is None:
            torch._foreach_add_(m, grads, alpha=step_size / num_data)
        else:
            # With an adapted diagonal mass sigma^2 D the momenta are whitened by D^{1/2}:
            # the noise and the friction stay scalars, the kinetic energy m^T m / sigma^2.
            torch._foreach_addcmul_(m, grads, self._scale, value=step_size / num_data)
        if self.temperature > 0:
            noise_scale = math.sqrt(2 * step_size * self.temperature * self.friction / num_data)
            torch._foreach_add_(m, self.standard_normal(), alpha=noise_scale)
        if self._scale is None:
            torch._foreach_add_(theta, m, alpha=step_size / self.mass)
        else:
            torch._foreach_addcmul_(theta, m, self._scale, value=step_size / self.mass)

    # -- warm-up adaptation ----------------------------------------------------------

    #: Time runs as the square root of mass over curvature.
    _step_exponent = 0.5

    def _max_adapted_step_size(self) -> float:
        # step_size * friction / mass <= 1: the momentum keeps its sign, as SGD's does.
        return self.mass / self.friction if self.friction > 0 else math.inf

    def _relaxation_rate(self) -> float:
        # the kinetic energy forgets at the friction's rate
        return self.friction / self.mass

    def _free_kinetic_temperature(self, step_size: float) -> float:
        """The kinetic temperature of these discretised momenta for a free particle."""
        return self.temperature / (1 - step_size * self.friction / (2 * self.mass))

    def _adaptation_statistic(self, step_size: float) -> torch.Tensor:
        kinetic = self.kinetic_energy() * (self.num_data / self.dimension)
        return kinetic / self._free_kinetic_temperature(step_size) - 1

    def _refresh(self) -> None:
        # A Gibbs draw of the momenta from their stationary law, independent of theta.
        variance = self.mass * self._free_kinetic_temperature(self.current_step_size())
        torch._foreach_mul_(self.momenta, 0.0)
        torch._foreach_add_(
            self.momenta, self.standard_normal(), alpha=math.sqrt(variance / self.num_data)
        )

    # -- equilibrium -----------------------------------------------------------------

    def _kinetic_target(self) -> float:
        """The expected kinetic temperature of this discretisation in equilibrium (with
        an adapted step size, the excess it was tuned to included)."""
        return self._free_kinetic_temperature(self.adapted_step_size) * self._tuned_excess()

    def _tuned_excess(self) -> float:
        """1 + the excess the step size was tuned to (1 when it was not tuned)."""
        tuned = self._adaptation is not None and self.adapt_step_size
        return 1 + self.target_excess if tuned else 1.0

    def _equilibrium_warning(self) -> str | None:
        values = np.asarray(self._stats["kinetic_temperature"], dtype=float)
        if self.temperature == 0 or len(values) < MIN_DRAWS_FOR_CHECK:
            return None
        target = self._kinetic_target()
        half = len(values) // 2
        # The later half first: a chain that stays off; then the earlier half: a
        # transient that warm-up did not cover (its draws are off too).
        for part, name in ((slice(half, None), "last"), (slice(None, half), "first")):
            mean = float(values[part].mean())
            error = self._standard_error(values, part, target)
            tolerance = KINETIC_TOLERANCE * target + 4 * error
            if abs(mean - target) > tolerance:
                return (
                    f"the kinetic temperature N m^T m / (mass d) averages {mean:.3g} over the "
                    f"{name} {len(values[part])} of {len(values)} kept draws, but a chain in "
                    f"equilibrium at temperature {self.temperature:g} has {target:.3g} "
                    f"(tolerance {tolerance:.2g}; the sample statistic 'kinetic_temperature' "
                    "has its trace). The chain is not in equilibrium and its draws are likely "
                    f"too {'narrow' if mean < target else 'wide'}: "
                    + self._equilibrium_advice(mean < target)
                )
        return None

    def _standard_error(self, values: np.ndarray, part: slice, target: float) -> float:
        """Standard error of the mean kinetic temperature over ``values[part]``.

        The draws are autocorrelated: the kinetic energy forgets its level only through
        the friction, at rate ``friction / mass`` per unit time, so ``part`` holds at most
        ``1 + sum(step sizes) * thin * friction / mass`` independent values, fewer if
        their effective sample size (Geyer's initial monotone sequence, as ArviZ) says so.
        Each independent value spreads at least as a chi-square in d dimensions does,
        ``target * sqrt(2 / d)``, however flat the trace (a trace stuck at a low level
        is flat).
        """
        kept = values[part]
        elapsed = float(np.sum(self._stats["step_size"][part])) * self.thin
        independent = 1 + elapsed * self._decorrelation_rate(part)
        ess = float(_ess(kept[np.newaxis, np.newaxis, :])[0])
        effective = max(min(independent, ess) if math.isfinite(ess) else independent, 1.0)
        spread = max(float(kept.std(ddof=1)), target * math.sqrt(2 / self.dimension))
        return spread / math.sqrt(effective)

    def _decorrelation_rate(self, part: slice) -> float:
        """The rate (per unit time) at which the momenta's energy decorrelates."""
        return self.friction / self.mass

    def _equilibrium_advice(self, cold: bool) -> str:
        if cold:
            return (
                "it is still settling from its start or over-damped; run more warmup_steps, "
                "start nearer the posterior (e.g. from a MAP fit) or lower the friction"
            )
        return (
            "it is still releasing the energy of a far start (run more warmup_steps, or "
            "start nearer the posterior), or minibatch gradient noise heats it (lower the "
            "step_size, raise the friction or use larger batches)"
        )
