r"""The equilibrium checks of a finished chain: is the kinetic temperature at its target,
and did the chain stay where its draws are?

In equilibrium the momenta of SGHMC and SGNHT are :math:`\mathcal{N}(0, \sigma^2 T / N)`,
so the sample statistic ``kinetic_temperature``, :math:`N m^\top m / (\sigma^2 d)` over
the :math:`d` parameters at each kept draw, fluctuates around a target the kernel
knows (:math:`T` up to its discretisation) with a relative spread :math:`\sqrt{2/d}`
per draw. When a chain ends, ``kinetic_warning`` compares the mean over the later
and over the earlier half of its kept draws with that target; a distance beyond
``KINETIC_TOLERANCE`` (0.1) plus four standard errors is a warning, saying whether the
draws are likely too narrow (a cold chain) or too wide (a hot one) and what to do.

Every kernel's draws are also checked for an *excursion* (``excursion_warning``): a kept
draw whose potential energy lies more than ``EXCURSION_TOLERANCE`` (20) robust sds
(1.4826 times the median absolute deviation) above the median of the draws' potential
energies: a divergence in HMC's terms, a step too large for a region the chain entered
having flung it into one the posterior all but excludes. A posterior does not put draws
there: on posteriordb's table (``docs/posteriordb.md``) the highest draw of each of the
162 runs judged on their saved draws with the full-batch potential (all but the
pharmacokinetic ODE's and 9 whose draws do not map back to the model) was at most 10.8
robust sds above its median (mostly 4 - 7; regressions whose ``sigma`` gives the
potential a long right tail reach 9 - 11). SGHMC on the ODE, without any other warning,
made one excursion of 50 steps in which ``K_m`` went from about 1 to 1.8e11 and back, 26
robust sds (36 nats) above the median; of the 9 others, run live, SGHMC on the Poisson
GP had one draw 31 robust sds (80 nats) above it, with 13 parameters, and warns (its
summary stayed within the table's tolerances). Only the draws' own energies are used, so
the check is free and holds with minibatches, whose noise widens the spread it is
measured in (it is then less sensitive, never more).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from pyro_bdl.diagnostics import _ess

__all__ = [
    "EXCURSION_TOLERANCE",
    "KINETIC_TOLERANCE",
    "MIN_DRAWS_FOR_CHECK",
    "excursion_warning",
    "kinetic_advice",
    "kinetic_warning",
    "thermostat_advice",
]

#: Relative distance of the mean kinetic temperature from its target that the
#: equilibrium check allows beyond its Monte Carlo error: discretisation (of order
#: ``step_size * curvature``) and minibatch-noise heating smaller than this bias the
#: position variances by similar, small amounts; beyond it the draws are too wide or
#: too narrow by as much.
KINETIC_TOLERANCE = 0.1
#: Fewest kept draws for the equilibrium check (each half's error estimate needs
#: an autocorrelation).
MIN_DRAWS_FOR_CHECK = 40
#: What to do about an excursion.
EXCURSION_ADVICE = (
    "lower the step size (a smaller target_excess, such as 0.05, for an adapted one; a "
    "smaller step_size for a fixed one) and check the traces (bdl.to_arviz)"
)
#: Robust sds of the kept draws' potential energies above their median beyond which a
#: draw is an excursion (correct chains on posteriordb: at most 10.8).
EXCURSION_TOLERANCE = 20.0


def excursion_warning(stats: dict[str, list[float]], temperature: float) -> str | None:
    """A sentence saying the chain made an excursion far above its draws' potential
    energies, or None (also at temperature 0, or with fewer than ``MIN_DRAWS_FOR_CHECK``
    draws).

    :param dict stats: the chain's sample statistics (``potential_energy`` per kept draw).
    :param float temperature: :math:`T`.
    """
    energies = np.asarray(stats["potential_energy"], dtype=float)
    if temperature == 0 or len(energies) < MIN_DRAWS_FOR_CHECK:
        return None
    median = float(np.median(energies))
    spread = 1.4826 * float(np.median(np.abs(energies - median)))
    if not spread > 0:  # (a chain that never moved is the convergence check's)
        return None
    excess = (energies - median) / spread
    far = np.flatnonzero(excess > EXCURSION_TOLERANCE)
    if far.size == 0:
        return None
    return (
        f"{far.size} of the {len(energies)} kept draws (from draw {far[0]}) have a "
        f"potential energy up to {excess[far].max():.3g} robust sds (1.4826 median "
        f"absolute deviations, {spread:.3g}) above the draws' median, more than "
        f"{EXCURSION_TOLERANCE:g}: the chain was flung into a region the posterior all "
        "but excludes, as a diverging trajectory is in HMC, and its draws there are not "
        "the posterior's (the sample statistic 'potential_energy' has its trace); "
        + EXCURSION_ADVICE
    )


def kinetic_warning(
    stats: dict[str, list[float]],
    temperature: float,
    thin: int,
    dimension: int,
    target: Callable[[], float],
    decorrelation_rate: Callable[[slice], float],
    advice: Callable[[bool], str],
) -> str | None:
    """A sentence saying the finished chain's kinetic temperature is off, or None.

    :param dict stats: the chain's sample statistics (``kinetic_temperature`` and
        ``step_size`` per kept draw).
    :param float temperature: :math:`T`; no check at 0, nor with fewer than
        ``MIN_DRAWS_FOR_CHECK`` draws.
    :param int thin: kernel steps per kept draw.
    :param int dimension: :math:`d`.
    :param callable target: the expected kinetic temperature in equilibrium.
    :param callable decorrelation_rate: ``part -> rate`` (per unit time) at which the
        momenta's energy decorrelates over the draws ``part``.
    :param callable advice: ``cold -> what to do``.
    """
    values = np.asarray(stats["kinetic_temperature"], dtype=float)
    if temperature == 0 or len(values) < MIN_DRAWS_FOR_CHECK:
        return None
    expected = target()
    half = len(values) // 2
    # The later half first: a chain that stays off; then the earlier half: a
    # transient that warm-up did not cover (its draws are off too).
    for part, name in ((slice(half, None), "last"), (slice(None, half), "first")):
        mean = float(values[part].mean())
        elapsed = float(np.sum(stats["step_size"][part])) * thin
        independent = 1 + elapsed * decorrelation_rate(part)
        error = _standard_error(values[part], independent, expected, dimension)
        tolerance = KINETIC_TOLERANCE * expected + 4 * error
        if abs(mean - expected) > tolerance:
            return (
                f"the kinetic temperature N m^T m / (mass d) averages {mean:.3g} over the "
                f"{name} {len(values[part])} of {len(values)} kept draws, but a chain in "
                f"equilibrium at temperature {temperature:g} has {expected:.3g} "
                f"(tolerance {tolerance:.2g}; the sample statistic 'kinetic_temperature' "
                "has its trace). The chain is not in equilibrium and its draws are likely "
                f"too {'narrow' if mean < expected else 'wide'}: " + advice(mean < expected)
            )
    return None


def _standard_error(kept: np.ndarray, independent: float, target: float, dimension: int) -> float:
    """Standard error of the mean kinetic temperature over the draws ``kept``.

    The draws are autocorrelated: the kinetic energy forgets its level only through
    the friction, at rate ``friction / mass`` per unit time, so they hold at most
    ``independent = 1 + sum(step sizes) * thin * friction / mass`` independent values,
    fewer if their effective sample size (Geyer's initial monotone sequence, as ArviZ)
    says so. Each independent value spreads at least as a chi-square in d dimensions
    does, ``target * sqrt(2 / d)``, however flat the trace (a trace stuck at a low
    level is flat).
    """
    ess = float(_ess(kept[np.newaxis, np.newaxis, :])[0])
    effective = max(min(independent, ess) if math.isfinite(ess) else independent, 1.0)
    spread = max(float(kept.std(ddof=1)), target * math.sqrt(2 / dimension))
    return spread / math.sqrt(effective)


def kinetic_advice(cold: bool) -> str:
    """What to do about a chain whose momenta are too cold or too hot."""
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


def thermostat_advice(thermostat: float, friction: float, cooling: float) -> str:
    """What to do about a chain kept cold by a thermostat heated above its friction,
    cooling by ``cooling`` per step."""
    return (
        f"the thermostat is at {thermostat:.3g}, above the friction {friction:g} it "
        "relaxes to, and it cools only by step_size * T / N = "
        f"{cooling:.2g} per step (about {(thermostat - friction) / cooling:.3g} more "
        "steps); start nearer the posterior (e.g. from a MAP fit) or give warm-up "
        "enough steps to reach it, so that the refresh at its end discards the heat"
    )
