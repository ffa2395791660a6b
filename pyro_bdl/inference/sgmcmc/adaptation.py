r"""Warm-up adaptation of the SGMCMC kernels: a diagonal mass and a step size.

This is the adaptation of networks (more than ``DENSE_MAX_DIMENSION``, 200, parameters,
or ``dense_mass=False``); a model with fewer parameters gets a dense mass estimated from
the windows' positions and gradients, with the same step-size adaptation
(:mod:`~pyro_bdl.inference.sgmcmc.dense`).

During ``warmup_steps`` a kernel built with ``adapt_mass_matrix=True`` and / or
``adapt_step_size=True`` (Pyro's names and defaults) learns

* a **diagonal mass** :math:`D` from the second moments of its minibatch gradients,
  :math:`D_i = \overline{\hat g_i^2} / (N T)`. The kernels then move in the coordinates
  :math:`D^{1/2}\theta`, in which every direction has curvature about one: by the Fisher
  identity :math:`\mathbb{E}_\pi[(\partial_i \log \pi)^2] = \mathbb{E}_\pi[-\partial_i^2
  \log \pi]`, so :math:`D_i` is the posterior's curvature along :math:`\theta_i` per datum
  (tempered by :math:`T`), plus the gradient noise of the minibatches. This is the
  preconditioner of pSGLD [1] and the scale adaptation of SGHMC [2], which use the
  square root of :math:`\overline{\hat g^2}` (RMSprop's); its first power equalises the
  curvature itself, so a Gaussian of condition number 1,000 along its axes becomes
  isotropic (the square root leaves it at 32);
* a **step size** on a statistic that works with minibatch gradients: the *excess* of
  the chain's stationary position variance over the target's, averaged over the
  principal directions of the posterior. For the discretisations used here it is an
  identity on Gaussian targets, exact with or without gradient noise, direction by
  direction: the relative excess of the position variance equals the relative excess
  of the kinetic temperature :math:`N |u|^2 / (\sigma^2 d)` of the (whitened) momenta
  over its value for a free particle, :math:`T / (1 - \epsilon\alpha / (2\sigma^2))`
  (SGHMC, and SGNHT whose thermostat is held at ``friction`` during warm-up). SGLD is
  SGHMC with :math:`\epsilon\alpha/\sigma^2 = 1`, a fresh momentum each step; the same
  identity then reads :math:`\epsilon\, |D^{-1/2} \hat g|^2 / (2 T N d)`.
  Discretisation error (large steps against stiff directions) and minibatch gradient
  noise (which heats the chain) both raise the statistic; the potential energy, which
  minibatches cannot estimate, is never needed. The step size is tuned until the
  statistic averages ``target_excess`` (10 %), the analogue of NUTS's
  ``target_accept_prob``.

  The excess grows with a direction's curvature, and a diagonal mass equalises the
  curvature along the coordinates only: where the data pin a combination of parameters
  (a network's output near its data) the whitened curvature along it can be many times
  the average, and so can its excess. So the slow windows also find the stiffest
  direction, by the power method on the chain's own whitened gradients
  (:mod:`~pyro_bdl.inference.sgmcmc.stiffness`), and measure how much stiffer than the
  average it is, ``stiffness``; at the end of warm-up the step size is lowered until
  that direction's excess, ``stiffness * target_excess`` at the tuned step, is
  ``target_excess`` (``Adaptation.stiff_factor``): standard deviations about 5 %
  too wide where the curvature is largest, less elsewhere. (Tuning the average to
  ``target_excess / stiffness`` instead would not do for SGHMC: on a network its
  momenta's statistic is dominated by the heat the chain releases as it crosses the
  posterior, and a lower target barely moves the step.)

  The kinetic temperature is a property of the chain's state, not of one step: the
  energy that a chain releases on its way in from a far start heats it for a while,
  and a smaller step would only slow its way in and keep it hot. So the step size does
  not shrink while the potential energy is falling, shrinks no faster than the
  statistic forgets (``friction / mass`` per unit of time), and the momenta are drawn
  afresh from their law at the start of every window (a Gibbs step, which leaves the
  target invariant) to discard what heat is left. (The energy error of a step, which
  NUTS uses, has no such memory, but for a first-order integrator with minibatch
  gradients its mean is minus the power of the force, which a chain on its way in
  makes large and positive: it would call for larger steps just when they are unsafe.)
  The step size moves by a stochastic-approximation step on its logarithm normalised
  by the statistic's spread, not by Pyro's dual averaging, whose raw iterate makes
  excursions that NUTS can reject and an SGMCMC chain cannot.

The schedule is Stan's, as Pyro builds it (:class:`~pyro.infer.mcmc.adaptation.WarmupAdapter`):
a start buffer, slow windows doubling in length, an end buffer.

* In the start buffer, the chain's way in, the mass follows an exponentially weighted
  mean and variance of the last ten or so gradients (refreshed at steps 1, 2, 4, 8, ...);
  in each slow window the mass is fixed and the window's gradients are summed, their
  mean and variance becoming the mass at its end.
* Both estimates are the variance plus the squared mean, the squared mean counted only
  up to the variance (from step 8 on). Near the posterior a window's mean gradient is
  small against its spread, and the estimate is the second moment of the Fisher
  identity. On a chain's way in from a far start it is not: the gradient is a steady
  force, whose square exceeds the curvature by about the squared distance in posterior
  standard deviations, and a chain preconditioned by it moves in at a speed inverse to
  the force, so that the next window sees the same force and the estimate confirms
  itself. (Measured on the 2-d regression of ``test_equilibrium.py``, started about 40
  posterior sds away: with the second moment, and in the start buffer the variance
  floored at a tenth of it, the masses were 800 to 2,500 times the curvature and after
  500 warm-up steps SGNHT's draws sat 13 and 37 sds off; now they end at 1.4 and 10
  times the curvature, and the draws are within 0.04 and 0.2 sds.) The variance of the
  gradients of a moving chain is the curvature it meets as it moves. But a chain that
  has barely moved in a window has gradients of almost no variance, so a coordinate's
  mass falls at most four-fold at a refresh (its steps grow at most two-fold): without
  that bound the same chain diverged at step 8, and Pyro's regression tutorial model
  was thrown into the flat tail of its ``Uniform`` prior on ``sigma``.
* In the end buffer only the step size adapts, and the kept step size is the geometric
  mean of its values there.

An estimate from few gradients is shrunk towards the geometric mean over coordinates on
the log scale, as Stan shrinks its variances (weight ``count / (count + 5)``), but only
upwards: a mass too small makes a stiff, unstable direction; one too large only slows
a direction down. A ``step_size`` given by the user is for the unit mass (as Pyro's is
for its first, identity mass) and becomes the step that moves the same with the first
mass. After warm-up nothing changes: the kept draws come from one kernel's stationary
law.

**References**

[1] C. Li, C. Chen, D. Carlson, L. Carin. Preconditioned stochastic gradient Langevin
dynamics for deep neural networks. AAAI 2016.
[2] J. T. Springenberg, A. Klein, S. Falkner, F. Hutter. Bayesian optimization with
robust Bayesian neural networks. NeurIPS 2016.
[3] M. D. Hoffman, A. Gelman. The No-U-Turn sampler. JMLR 2014 (warm-up windows).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from pyro.infer.mcmc.adaptation import WarmupAdapter

from pyro_bdl import distributed
from pyro_bdl.inference.sgmcmc._buffers import FlatBuffers
from pyro_bdl.inference.sgmcmc.stiffness import StiffDirection

__all__ = ["Adaptation", "DEFAULT_TARGET_EXCESS"]

#: The default relative excess of the position variance that the step size is tuned to.
DEFAULT_TARGET_EXCESS = 0.1
#: Weight of the newest squared gradient in the start buffer's moving average.
_START_WEIGHT = 0.1
#: Change of log(step size) per step, in units of the statistic's own spread.
_RATE = 0.05
#: Least weight of the newest statistic in its running mean square (about 20 steps).
_SPREAD_WEIGHT = 0.05
#: From this step of the start buffer on, its mass is the gradients' variance (before,
#: their second moment sets the scale).
_START_REFRESH = 8
#: The squared mean of a window's gradients counts towards the mass up to this many times
#: their variance (from step _START_REFRESH on): near the posterior the mean is small
#: against the spread and the mass is the second moment (the Fisher identity's); on a
#: chain's way in from a far start the mean is a steady force whose square would swamp
#: the curvature (see the module docstring).
_DRIFT_CAP = 1.0
#: A coordinate's mass falls at most this many times at a refresh: a chain that has
#: barely moved in a window has gradients of almost no variance.
_MAX_DROP = 4.0
#: No coordinate's mass is below this fraction of the geometric mean over coordinates: a
#: gradient that stayed zero through a window (a ReLU unit dead on every batch) tells
#: nothing, and a unit waking up with a tiny mass would take an unbounded step. (A
#: Gaussian of condition number 10,000 along its axes still gets its own scales.)
_TINY = 1e-2
#: Pseudo-observations of the average mass that each coordinate's estimate is shrunk
#: towards, as Stan shrinks its variances: a coordinate whose few gradients happened to
#: vanish (the first one, at a start on a symmetry axis) would take unbounded steps.
_PRIOR_COUNT = 5


class Adaptation:
    """The warm-up adaptation of one chain: its mass, its step size and their schedule.

    A component the kernel's step calls (:mod:`~pyro_bdl.inference.sgmcmc.warmup` makes
    it): :meth:`begin` at the chain's first step, :meth:`observe_gradient` with each
    warm-up step's gradient before its update, :meth:`apply` to take the method's update
    under the mass, :meth:`observe_statistic` with the step's excess (see the module
    docstring) when it has read it, and :meth:`end_step` after the step (which says when
    to draw the momenta afresh); the method's update reads ``step_size`` and
    :attr:`unit_scale` (:math:`D^{-1/2}` per parameter, or None without mass adaptation).
    The dense mass (``DenseAdaptation``, :mod:`~pyro_bdl.inference.sgmcmc.dense`)
    answers the same calls.

    :param list theta: the chain's parameters (shapes, dtypes and devices of the mass).
    :param int warmup_steps: the number of warm-up steps.
    :param step_size: the first step size, or None for ``start`` in the units of the
        first gradient.
    :param bool adapt_step_size: tune the step size.
    :param bool adapt_mass_matrix: learn the diagonal mass.
    :param float target_excess: the excess the step size is tuned to.
    :param float scale: :math:`N T`, the gradient's second moment per unit of mass.
    :param float start: the first step size in mass-adapted units, when none is given.
    :param float step_exponent: the step size scales as mass to this power (1/2 for
        SGHMC, whose time runs as the square root of mass over curvature; 1 for SGLD).
    :param float max_step_size: an upper bound of the step size in mass-adapted units
        (SGHMC keeps ``step_size * friction / mass`` at most 1).
    :param float relaxation: the rate per unit of time at which the statistic forgets
        (SGHMC: ``friction / mass``; SGLD's statistic has no memory: infinity).
    :param bool data_parallel: the chain is one chain across the ranks of a job: the
        ranks take rank 0's mass and step size at every change.
    """

    #: Whether the mass adapted is this class's diagonal one (its buffers, the size of
    #: the model, are then allocated; the dense adaptation keeps its own metric instead).
    _diagonal = True

    def __init__(
        self,
        theta: list[torch.Tensor],
        warmup_steps: int,
        step_size: float | None,
        *,
        adapt_step_size: bool,
        adapt_mass_matrix: bool,
        target_excess: float,
        scale: float,
        start: float,
        step_exponent: float,
        max_step_size: float,
        relaxation: float = math.inf,
        data_parallel: bool = False,
    ):
        self.adapt_step_size = adapt_step_size
        self.adapt_mass_matrix = adapt_mass_matrix
        self.target_excess = target_excess
        self.step_size = step_size
        self._gradient_scale = scale
        self._start = start
        self._exponent = step_exponent
        self._max_step_size = max_step_size  # lowered by each recovery from a divergence
        self._method_max_step_size = max_step_size
        self._units = 1.0  # a step size in these units per step size for the unit mass
        self._relaxation = relaxation
        self._data_parallel = data_parallel
        self._dimension = sum(t.numel() for t in theta)
        self._windows = _windows(warmup_steps)
        self._window = 0
        self._count = 0  # squared gradients in the current window's average
        self._observed = 0  # statistics seen
        self._spread = 0.0  # running mean square of (statistic - target)
        self._log_step = math.nan
        self._final = [0.0, 0]  # sum and number of log step sizes of the last window
        self._trend = _Trend()
        self._mass = self._squares = self._means = None
        #: How much stiffer than the average the stiffest direction found is (see
        #: stiffness.py), measured in the slow windows.
        self.stiffness = 1.0
        self._stiff = StiffDirection(theta) if adapt_step_size else None
        if adapt_mass_matrix and self._diagonal:
            self._mass = FlatBuffers(theta)  # holds D^{-1/2}, the scale of the update
            self._means = FlatBuffers(theta)
            self._squares = FlatBuffers(theta)  # second moments, or sums of squares
            for flat in (*self._mass.flats, *self._means.flats, *self._squares.flats):
                flat.zero_()

    # -- the kernel's calls ----------------------------------------------------------

    @property
    def langevin(self) -> bool:
        """Whether the warm-up step in progress takes Langevin dynamics' step instead of
        the method's (see :mod:`~pyro_bdl.inference.sgmcmc.langevin`): never under a
        diagonal mass, whose estimate reads the gradients alone."""
        return False

    @property
    def unit_scale(self) -> list[torch.Tensor] | None:
        """The :math:`D^{-1/2}` the method's update applies itself (None: a unit mass)."""
        return self.scale

    def begin(
        self,
        gradient_at: Callable[[dict], list[torch.Tensor]],
        params: dict[str, torch.Tensor],
        grads: list[torch.Tensor],
    ) -> None:
        """At the chain's first step, given its gradient ``grads`` at ``params`` and
        ``gradient_at`` (the gradient on the same batch at other values): nothing for a
        diagonal mass."""

    def apply(
        self,
        update: Callable[[list[torch.Tensor], list[torch.Tensor], float], None],
        theta: list[torch.Tensor],
        grads: list[torch.Tensor],
        step_size: float,
        adapting: bool,
    ) -> None:
        """Take the method's ``update(theta, grads, step_size)`` under this mass (the
        diagonal one is applied by the update itself, through :attr:`unit_scale`)."""
        update(theta, grads, step_size)

    def warning(self) -> str | None:
        """A sentence saying the warm-up ended unconverged, or None."""
        return None

    @property
    def gradient_noise(self) -> float | None:
        """The minibatch gradient noise relative to the gradients' signal, or None when it
        cannot be told: a diagonal mass is estimated from the gradients' second moments,
        noise included, so under it the two are not told apart (the dense adaptation
        measures it)."""
        return None

    def inverse_mass_matrix_of(self, params: dict[str, torch.Tensor]) -> dict | None:
        """The adapted inverse mass per site of ``params`` (None when not adapted)."""
        scale = self.scale
        if scale is None:
            return None
        return {name: s.square() for name, s in zip(params, scale)}

    @property
    def scale(self) -> list[torch.Tensor] | None:
        """:math:`D^{-1/2}` shaped like the parameters (None without mass adaptation)."""
        return None if self._mass is None else self._mass.views

    @property
    def inverse_mass(self) -> list[torch.Tensor] | None:
        """:math:`D^{-1}` shaped like the parameters (None without mass adaptation)."""
        return None if self._mass is None else [s.square() for s in self._mass.views]

    # -- the kernel's calls ----------------------------------------------------------

    def observe_gradient(self, grads: list[torch.Tensor]) -> None:
        """Take a warm-up step's gradient, before the kernel's update."""
        first = self._count == 0 and self._window == 0
        if self.adapt_mass_matrix:
            means, squares = self._means.views, self._squares.views
            self._count += 1
            if first:
                # one gradient: its square sets the scale of the first steps
                torch._foreach_copy_(means, grads)
                torch._foreach_addcmul_(squares, grads, grads)
                self._refresh_mass(1, math.inf)
            elif self._window == 0:
                # The start buffer: exponentially weighted first and second moments (their
                # weights sum to one), the mass following them at steps 2, 4, 8, ... In
                # place: a difference g - mean per step, a fresh tensor the size of the
                # model, made this step a fifth dearer than a slow window's on the 1M MLP
                # of benchmarks/sgmcmc_overhead.py.
                weight = max(1.0 / self._count, _START_WEIGHT)
                torch._foreach_lerp_(means, grads, weight)
                torch._foreach_mul_(squares, 1 - weight)
                torch._foreach_addcmul_(squares, grads, grads, value=weight)
                if self._count & (self._count - 1) == 0:
                    cap = math.inf if self._count < _START_REFRESH else _DRIFT_CAP
                    self._refresh_mass(min(self._count, 1 / _START_WEIGHT), cap)
            else:  # the slow windows: sums of the gradients and of their squares
                torch._foreach_add_(means, grads)
                torch._foreach_addcmul_(squares, grads, grads)
        if first:
            self.step_size = self._first_step_size(grads)
            self._log_step = math.log(self.step_size)
        if self._stiff is not None and self._in_slow_window:
            self._stiff.observe(grads, self.scale)  # the mass is fixed there

    @property
    def stiff_factor(self) -> float:
        r"""The factor on the step size that brings the stiffest direction found from its
        excess at the tuned step, ``stiffness * target_excess``, down to
        ``target_excess`` (1 when it is not stiffer than the average).

        On a Gaussian direction of curvature :math:`\lambda` (in the mass's coordinates)
        the excess is :math:`e = x / (c - x)` with SGLD's :math:`x \propto
        \epsilon\lambda` and :math:`c = 2`, and SGHMC's :math:`x \propto
        \epsilon^2\lambda / \sigma^2` and :math:`c = 2(2 - \epsilon\alpha/\sigma^2)`
        (the stationary variance of its discretisation). So :math:`e / (1 + e) = x / c`
        scales as the step size to the power ``1 / step_exponent``; SGHMC's :math:`c`
        grows a little as the step falls, so its excess ends a little below the target.
        """
        found = self.stiffness * self.target_excess
        wanted = min(found, self.target_excess)
        return (_odds(wanted) / _odds(found)) ** self._exponent

    @property
    def average_excess(self) -> float:
        """The excess averaged over directions at the kept step size: ``target_excess``,
        lowered with the step by :attr:`stiff_factor`."""
        scaled = _odds(self.target_excess) * self.stiff_factor ** (1 / self._exponent)
        return scaled / (1 - scaled)

    def observe_statistic(self, excess: float, potential: float) -> None:
        """Take a step's excess (see the module docstring) and its potential energy, and
        tune the step size.

        A stochastic-approximation step on the log step size, normalised by the running
        spread of the statistic. Pyro's dual averaging steps with its raw iterate, whose
        excursions NUTS can afford because it rejects them; an SGMCMC chain cannot
        reject a step too large, so the step size moves by at most a few per cent a step.
        It does not shrink while the potential energy is falling: the energy released on
        the way to the posterior heats the momenta through no fault of the step (and a
        smaller step would only slow the way in, and keep it hot).
        """
        if not self.adapt_step_size or not math.isfinite(excess):
            return
        falling = self._trend.falling(potential)
        if self._window >= len(self._windows):
            return
        error = excess - self.target_excess
        self._observed += 1
        weight = max(1.0 / self._observed, _SPREAD_WEIGHT)
        self._spread += weight * (error * error - self._spread)
        if self._spread > 0 and not (falling and error > 0):
            # The statistic remembers about 1 / (2 step_size friction) steps: the step size
            # shrinks no faster than that, lest it chase a heat the step did not cause.
            memory = min(1.0, 2 * self.step_size * self._relaxation) if error > 0 else 1.0
            self._log_step -= _RATE * memory * error / math.sqrt(self._spread)
        self._log_step = min(self._log_step, math.log(self._max_step_size))
        self.step_size = math.exp(self._log_step)
        if self._window == len(self._windows) - 1:
            self._final[0] += self._log_step
            self._final[1] += 1

    def end_step(self, iteration: int) -> bool:
        """Close the warm-up step ``iteration``; at the end of a window update the mass,
        and return whether another window starts (then draw the momenta afresh)."""
        # (a window whose end a recovery set the adaptation back across ends now)
        if self._window >= len(self._windows) or iteration < self._windows[self._window].end:
            return False
        last = self._window == len(self._windows) - 1
        if self._stiff is not None and self._in_slow_window:
            self.stiffness = self._stiff.ratio()
        if self.adapt_mass_matrix and self._in_slow_window:
            self._end_slow_window()
        if self.adapt_mass_matrix and self._window < len(self._windows) - 1:
            if self._mass is not None:
                for flat in (*self._means.flats, *self._squares.flats):
                    flat.zero_()
            self._count = 0
        langevin = self.langevin
        self._window += 1
        if langevin and not self.langevin:
            # A recovery's ceiling is of the dynamics that diverged: the method's own are
            # stable up to a larger step (SGHMC's to 2 / sqrt(curvature), Langevin's to
            # 2 / curvature), and get their own recoveries. (Kept, posteriordb's arK
            # diverged in the start buffer and SGHMC sampled it at a step of 0.058, not
            # 0.43, with R-hat 1.12.)
            self._max_step_size = self._method_max_step_size
        if last:
            self.finish()
        elif self._data_parallel:
            self._agree()
        return not last

    def finish(self) -> None:
        """End the adaptation: the step size is the geometric mean of the last window's.
        (A warm-up cut short ends here too.)"""
        if self.adapt_step_size and self._final[1] > 0:
            mean = math.exp(self._final[0] / self._final[1])
            self.step_size = min(mean, self._max_step_size)  # (lowered by a recovery)
            self._final = [0.0, 0]
            self.step_size *= self.stiff_factor
        self._window = len(self._windows)
        if self._data_parallel:
            self._agree()

    def recover(self, step_size: float) -> None:
        """After the chain was set back to a sane state (and this adaptation to its state
        then, by :meth:`load_state`) from a divergence at ``step_size``: half that step
        is the largest the step size may take from now on (see
        :mod:`~pyro_bdl.inference.sgmcmc.recovery`). The excess averaged over directions
        did not see the divergence coming, so the adaptation would otherwise grow the
        step back to it."""
        self._max_step_size = min(self._max_step_size, step_size / 2)
        self.step_size = min(self.step_size, self._max_step_size)
        self._log_step = math.log(self.step_size)

    def unit_step_size(self) -> float:
        """The step size in the units of a ``step_size`` given for the unit mass."""
        return self.step_size / self._units

    # -- internals ---------------------------------------------------------------------

    def _end_slow_window(self) -> None:
        """The mass from the slow window's gradients."""
        # the sums become the window's first and second moments
        torch._foreach_mul_(self._means.flats, 1.0 / self._count)
        torch._foreach_mul_(self._squares.flats, 1.0 / self._count)
        self._refresh_mass(self._count, _DRIFT_CAP)

    @property
    def _in_slow_window(self) -> bool:
        """Between the start buffer and the end buffer, where the mass is fixed."""
        return 0 < self._window < len(self._windows) - 1

    def _refresh_mass(self, count: float, cap: float) -> None:
        """:math:`D^{-1/2}` from the gradients' first (``means``) and second (``squares``)
        moments over :math:`N T`: their variance plus their squared mean, counted up to
        ``cap`` times the variance, and falling at most ``_MAX_DROP``-fold: an estimate
        from ``count`` gradients, and where it is below the geometric mean over
        coordinates, shrunk towards it on the log scale (weight ``count / (count + 5)``, as
        Stan shrinks its variances), so that coordinates of very different scales keep
        them."""
        previous = [flat.clone() for flat in self._mass.flats]  # D^{-1/2} so far
        for scale, means, squares in zip(self._mass.flats, self._means.flats, self._squares.flats):
            drift = means.square()
            variance = torch.sub(squares, drift).clamp_min_(0.0).mul_(1 / self._gradient_scale)
            drift.mul_(1 / self._gradient_scale)
            if math.isfinite(cap):
                torch.minimum(drift, variance * cap, out=drift)
            torch.add(variance, drift, out=scale)
        positive = sum((flat > 0).sum() for flat in self._mass.flats)
        logs = sum(_log(flat).mul_(flat > 0).sum() for flat in self._mass.flats)
        # the geometric mean of the positive estimates; a mass of 1 if every gradient was 0
        log_mean = torch.where(positive > 0, logs / positive.clamp_min(1), torch.zeros_like(logs))
        shrink = count / (count + _PRIOR_COUNT)
        for scale, old in zip(self._mass.flats, previous):
            centre = log_mean.to(scale.dtype)
            scale.copy_(_log(scale)).clamp_min_(centre + math.log(_TINY)).sub_(centre)
            # only upwards: a small estimate may be luck (and would make a stiff, unstable
            # direction), a large one is never unsafe
            torch.where(scale < 0, scale * shrink, scale, out=scale)
            scale.add_(centre).mul_(-0.5).exp_()
            limit = torch.where(old > 0, old * _MAX_DROP**0.5, math.inf)
            torch.minimum(scale, limit, out=scale)

    def _first_step_size(self, grads: list[torch.Tensor]) -> float:
        """The first step size in the units of the first mass.

        Without a step size given, ``start`` in mass-adapted units (converted to the
        units of the first gradient's average second moment when the mass is not
        adapted). A given step size is for the unit mass, as Pyro's is for its first
        (identity) mass: with an adapted mass it becomes the step that moves the same,
        ``step_size * mean(D) ** step_exponent`` (one read of the device, once).
        """
        mean = float(sum(g.square().sum(dtype=torch.float64) for g in grads))
        mean /= self._dimension * self._gradient_scale
        scale = mean**self._exponent if mean > 0 and math.isfinite(mean) else 1.0
        self._units = scale if self.adapt_mass_matrix else 1.0
        if self.step_size is None:
            step_size = self._start / (1.0 if self.adapt_mass_matrix else scale)
        else:
            step_size = self.step_size * self._units
        return min(step_size, self._max_step_size)

    def _agree(self) -> None:
        """Every rank takes rank 0's mass and step size."""
        tensors = [] if self._mass is None else list(self._mass.flats)
        step = torch.tensor([self.step_size], dtype=torch.float64)
        distributed.broadcast_([*tensors, step])
        self.step_size = float(step)

    # -- checkpoints -------------------------------------------------------------------

    def state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """The adaptation's state: tensors (mass, squared gradients) and numbers."""
        tensors = {}
        if self._mass is not None:
            for name, buffers in self._buffers().items():
                tensors.update({f"{name}/{i}": flat for i, flat in enumerate(buffers.flats)})
        numbers = {key: getattr(self, key) for key in _STATE}
        numbers["trend"] = list(self._trend.values)
        if self._stiff is not None:
            stiff_tensors, numbers["stiff"] = self._stiff.state()
            tensors.update({f"stiff/{key}": t for key, t in stiff_tensors.items()})
        numbers["start_buffer"] = "second moments"
        numbers["stiffness"] = self.stiffness
        numbers["ceiling"], numbers["units"] = self._max_step_size, self._units
        return tensors, numbers

    def load_state(self, tensors: dict[str, torch.Tensor], numbers: dict) -> None:
        """Restore :meth:`state` (tensors on the CPU are copied to the mass's device)."""
        if self._mass is not None:
            for name, buffers in self._buffers().items():
                for i, flat in enumerate(buffers.flats):
                    flat.copy_(tensors[f"{name}/{i}"])
        for key in _STATE:
            setattr(self, key, numbers[key])
        self._trend.values = list(numbers["trend"])
        # (earlier versions: no recovery had lowered the ceiling)
        self._max_step_size = numbers.get("ceiling", self._max_step_size)
        self._units = numbers.get("units", self._units)
        if self._stiff is not None and "stiff" in numbers:  # (earlier versions: none)
            prefix = "stiff/"
            stiff = {k.removeprefix(prefix): t for k, t in tensors.items() if k.startswith(prefix)}
            self._stiff.load_state(stiff, numbers["stiff"])
            self.stiffness = numbers["stiffness"]
        if self._mass is not None and self._window == 0 and "start_buffer" not in numbers:
            # Checkpoints of earlier versions hold the start buffer's variances; with the
            # same weights the second moment is exactly the variance plus the squared mean.
            torch._foreach_addcmul_(self._squares.flats, self._means.flats, self._means.flats)

    def _buffers(self) -> dict[str, FlatBuffers]:
        return {"scale": self._mass, "means": self._means, "squares": self._squares}


_STATE = ("step_size", "_window", "_count", "_observed", "_spread", "_log_step", "_final")


def _odds(excess: float) -> float:
    """:math:`e / (1 + e)`: for the kernels' discretisations, proportional to the step size
    to the power ``1 / step_exponent`` (see ``Adaptation.stiff_factor``)."""
    return excess / (1 + excess)


def _log(values: torch.Tensor) -> torch.Tensor:
    """The logarithm, -inf-free: zeros become the dtype's smallest normal number's log."""
    return values.clamp_min(torch.finfo(values.dtype).tiny).log()


class _Trend:
    """Whether a chain's potential energy is falling: the mean of its last ``length``
    values is below the mean of the ``length`` before by more than twice the standard
    error of their difference (minibatch potentials are noisy, and in equilibrium the
    potential fluctuates too)."""

    def __init__(self, length: int = 10):
        self.length = length
        self.values: list[float] = []

    def falling(self, value: float) -> bool:
        values = self.values
        values.append(value)
        del values[: -2 * self.length]
        if len(values) < 2 * self.length or not math.isfinite(value):
            return False
        before, after = values[: self.length], values[self.length :]
        mean_before, mean_after = sum(before) / self.length, sum(after) / self.length
        # products, not powers: a diverging chain's potential (1e200) squares to inf
        # where ** raises OverflowError
        spread = sum((v - mean_before) * (v - mean_before) for v in before) + sum(
            (v - mean_after) * (v - mean_after) for v in after
        )
        error = math.sqrt(2 * spread / ((2 * self.length - 2) * self.length))
        return mean_after < mean_before - 2 * error


def _windows(warmup_steps: int) -> list:
    """Stan's warm-up windows as Pyro builds them: start buffer, slow windows, end buffer."""
    adapter = WarmupAdapter(adapt_mass_matrix=True)
    adapter.configure(warmup_steps, initial_step_size=1.0, mass_matrix_shape={("_",): (1,)})
    return adapter.adaptation_schedule
