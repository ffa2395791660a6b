r"""Warm-up adaptation with a dense mass, for models with few parameters.

A diagonal mass cannot sample a posterior whose parameters are strongly correlated: an
uncentred linear regression (posteriordb's kidiq, earnings, nes, sblrc: correlations of
0.99 and more) has directions hundreds of times softer than its coordinates, and a chain
tuned on the stiff ones crosses the soft ones in many thousands of steps. NUTS on these
posteriors uses Stan's ``dense_e`` metric (Pyro's ``full_mass``); so do the kernels here
for models of at most ``DENSE_MAX_DIMENSION`` (200) unconstrained parameters, where a
:math:`d \times d` matrix per step costs nothing beside the model's own gradient. A
network keeps the diagonal mass of :mod:`~pyro_bdl.inference.sgmcmc.adaptation`
unchanged (``dense_mass=False``).

**The metric.** The kernels move in whitened coordinates :math:`z = L^{-1}\theta`, with
:math:`L L^\top = M^{-1} = N \hat\Sigma` the inverse mass: the unit-mass update of each
method runs on :math:`z`, with the gradient :math:`L^\top g`, and the position moves by
:math:`L\,\Delta z`. So SGLD's step is :math:`\theta \leftarrow \theta + \frac{\epsilon}{N}
M^{-1} g + \sqrt{2\epsilon T / N}\, L\xi` and SGHMC's momenta are whitened, as with the
diagonal mass; the step size is in the units of the whitened posterior (curvature about
one per unit of :math:`\epsilon`, whatever N and the scale of the data), as the diagonal
adaptation's is.

**The first metric.** A chain started far from the posterior sees gradients made of a
steady force and, with minibatches, a noise that grows with the distance (the residuals
are large there): their squares, from which the diagonal adaptation takes its first
mass, overstate the curvature by orders of magnitude (issue 33's regression: an inverse
mass 500 times too small, a chain that never arrived). So the first metric is Stan's
identity, scaled: before its first step the kernel measures the largest curvature
:math:`\lambda` of the minibatch potential at the start by the power method on
Hessian-vector products, each the difference of two gradients *on the same batch*
(``CURVATURE_ITERATIONS`` extra gradients, once; free of minibatch noise), and the
inverse mass is :math:`(N / \lambda) I`, under which that direction has curvature one and
the step size ``2 * target_excess`` is stable. A ``step_size`` given is for the unit mass,
as Pyro's is for its first (identity) mass: adaptation starts from the step that moves
the same under the first metric. Why isotropic, when the start's Hessian is measured
anyway: a metric from the whole Hessian there, or from its diagonal, gives each
direction its own width at the start, which made posteriordb's mesquite (weights in
grams) right, but the start is no guide to where the chain goes next: with the whole
Hessian arma11's chains diverged at step 4, with its diagonal hmm_drive_0's diverged
in warm-up, both right under the isotropic metric (``docs/posteriordb.md`` lists what
was tried).

**The dynamics of the start buffer.** Every method takes Langevin dynamics' step there
(SGLD's, :mod:`~pyro_bdl.inference.sgmcmc.langevin`, with its own step-size statistic);
SGHMC and SGNHT take their own from the first slow window on, whose step size is tuned to
them and whose metric comes from their own positions. Warm-up's draws are discarded, so
its dynamics need not be the method's, and the start buffer's estimates need what
Langevin dynamics give: positions that spread along every direction. A Langevin step adds
fresh isotropic noise (:math:`\sqrt{2\epsilon}` in whitened units) to every coordinate,
so within a block of ten steps the positions have spread along the soft directions too;
SGHMC's noise enters through its momenta, which the block's refreshes draw afresh, and
its positions over ten steps are a smooth path along the steady force of the way in
(about a tenth of the spread), so :math:`C` is nearly of rank one and the soft directions
keep the first metric. Measured on posteriordb's kidiq (``kidscore_momiq``, the first
metric :math:`10^{-7}` against the posterior's largest variance 36): with SGHMC's own
steps the metric's largest eigenvalue was :math:`6 \times 10^{-7}` after the start buffer
and 0.017 at the end of warm-up, and the draws sat at the start, 4.2 sds off; with
Langevin steps in the start buffer it reaches the posterior and the draws are within 0.07
sds. On the 43 posteriors at full batch SGHMC and SGNHT went from 54 to 70 of 86 runs
right, and none that was right before is not right after (``docs/posteriordb.md``).
Langevin steps in the slow windows too measured 76 of 86, but the mixture
``low_dim_gauss_mix``, right before, came in so slowly that its draws were 100 sds off
(warned): SGHMC's momenta cross a long way in faster, once the first metric is there.

**The windows' metric.** :math:`\hat\Sigma` is estimated every ``START_BLOCK`` (10) steps
of the start buffer (on the way in the curvature changes as the chain moves: kidiq's
sigma starts at 0.05 against a posterior of 18) and at the end of each slow window, from
the positions and gradients since the last estimate: with :math:`C` the covariance of the
positions and :math:`B = \mathrm{Cov}(\theta, g)` their cross-covariance with the
gradients,

.. math::

    \hat\Sigma = C \,\#\, \left(B^\top C^{-1} B\right)^{-1}, \qquad
    A \,\#\, D = A^{1/2} \left(A^{-1/2} D A^{-1/2}\right)^{1/2} A^{1/2},

the matrix geometric mean (the unique positive-definite :math:`X` with :math:`X A^{-1} X
= D`). Why this, and not Stan's covariance of the positions alone: on a Gaussian
posterior of precision :math:`H` the gradient is :math:`g = -H(\theta - \mu) + n`, with
:math:`n` the minibatch noise, so :math:`B = -C H` *whatever the law of the positions*,
:math:`B^\top C^{-1} B = H C H`, and :math:`C \# (H C H)^{-1} = H^{-1}` exactly. A window's
positions need not have explored the posterior: those of a chain still on its way in,
or crawling along a soft direction, give the right metric, where Stan's estimate is the
spread the chain happened to reach (too narrow along soft directions, recovering over
several doubling windows). :math:`B^\top C^{-1} B` is the covariance of the part of the
gradients that the positions explain (their least-squares prediction from
:math:`\theta`): the minibatch noise of a step is independent of the position the step
starts from (a fresh batch), so it drops out in expectation, where the gradients'
covariance (nutpie's diagonal estimate :math:`\sqrt{\mathrm{var}\,\theta_i /
\mathrm{var}\, g_i}` [1]) would add :math:`(N/B - 1)` times the Fisher information and
shrink the metric, most on the prior-dominated directions. Both covariances are centred,
so the steady force of a chain on its way in drops out, as does the potential's value,
which minibatches cannot estimate. At temperature :math:`T` the positions spread
:math:`T` times as much and :math:`B = -T I` in equilibrium; the estimate is still
:math:`H^{-1}` (the gradient is the untempered log joint's), and the inverse mass is
:math:`N \hat\Sigma`, in the units of the diagonal adaptation's :math:`D^{-1}`.

:math:`C` and :math:`B` are each shrunk towards their values in equilibrium under the
previous metric (``PRIOR_COUNT`` pseudo-steps of :math:`T \Sigma_{\text{prev}}` and of
:math:`-T I`, Stein's identity :math:`\mathbb{E}_\pi[(\theta - \mu) \nabla \log
\pi^\top] = -I`), as Stan shrinks its estimate towards a small multiple of the identity:
along a direction the window did not move, or in a window of fewer steps than
parameters, the estimate stays the previous metric instead of a singular one that
would freeze the direction; and unlike Stan's :math:`10^{-3} I`, the shrinkage sets no
scale that depends on the data's units. One pseudo-step, not Stan's five: along a soft
direction a window's estimate can exceed the previous metric only by about the
pseudo-steps' share, and with five the metric of posteriordb's kidiq grew too slowly to
reach its posterior in 500 warm-up steps.

**Guards.** What the estimate cannot see is a region the window did not visit. An
estimate may raise the metric at most ``MAX_GROWTH`` (100) times along any direction
(``MAX_START_GROWTH``, 10, for the start buffer's 10-step estimates; a larger first step
diverged on posteriordb's arma11), and lower it by any factor (a smaller metric is only
slower). And a warm-up step after the start buffer clips its whitened gradient at
``WARMUP_CLIP`` (10) times its root mean square in equilibrium: a chain that meets a
region far stiffer than its metric (eight schools' log tau, whose curvature grows as
tau squared) is otherwise thrown a hundred sds into a tail, where it spends the window
and the window's estimate is of the tail. Warm-up need not leave the target invariant;
the kept draws' steps are never clipped.

**Has warm-up converged?** The positions of the last slow window are split into halves;
if their means differ by more than ``DRIFT_TOLERANCE`` (3) posterior sds (under the
final metric) along any coordinate, the chain was still on its way in when the metric
was fixed, and the kernel warns at the end of the run, naming the drift, with the advice
to run more warm-up steps (which lengthens the last, doubling window). The tolerance is
wide because a chain in equilibrium but slow (a few independent draws per half window,
as minibatch noise makes SGLD) differs between halves by about one sd; slow mixing after
warm-up is the kept draws' own check (split R-hat and ESS,
:mod:`~pyro_bdl.inference.sgmcmc.convergence`). The kernel also warns when the last
window's estimate was more than ``OUTGROWN_TOLERANCE`` (10) times wider along some
direction than ``MAX_GROWTH`` let the metric become, or wider at all while the chain
drifted: the metric was still catching up with the posterior. This happens when the
chain starts where the posterior is far stiffer than near its mode: on posteriordb's
``earn_height`` (earnings in dollars, ``sigma`` starting near 1 against residuals of
2e4) the first metric is 1e-20 of the posterior's variance along its soft direction, and
the caps let 1,000 warm-up steps widen it at most about 1e17-fold; more warm-up steps
help only slowly (after 5,000 the draws were still drifting, 6 sds off), so the
warning's remedy is a start near the posterior, which made all three kernels right there
and on ``mesquite`` (grams), or data on a unit scale (earnings in thousands of dollars:
right too). On the 126 full-batch and 45 minibatch warm-ups of the posteriordb table
the estimate exceeded the cap more than 10-fold only on those two posteriors (47 - 350
times), and at most 2 times elsewhere.

**References**

[1] A. Seyboldt. nutpie: mass matrix adaptation from draws and gradients
(https://github.com/pymc-devs/nutpie), 2023.
[2] Stan Reference Manual, "HMC algorithm parameters": windowed adaptation, ``dense_e``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

from pyro_bdl import distributed
from pyro_bdl.inference.sgmcmc import langevin
from pyro_bdl.inference.sgmcmc.adaptation import Adaptation
from pyro_bdl.inference.sgmcmc.device import norm

__all__ = [
    "CURVATURE_ITERATIONS",
    "DENSE_MAX_DIMENSION",
    "DenseAdaptation",
    "dense_by_default",
    "largest_curvature",
    "one_device",
]

#: Power-method iterations (extra gradients, once) for the first metric's scale.
CURVATURE_ITERATIONS = 10
#: The most unconstrained parameters for which the mass is dense by default.
DENSE_MAX_DIMENSION = 200
#: Largest factor by which one refresh raises the metric (the inverse mass) along a
#: direction: on the way in, a window's estimate is of the curvature where the chain
#: went. (It may fall by any factor: a smaller metric is only slower, never unstable.)
MAX_GROWTH = 100.0
#: The same for the start buffer's refreshes, each from START_BLOCK steps only.
MAX_START_GROWTH = 10.0
#: A warm-up step's whitened gradient is at most this many times its root mean square in
#: equilibrium.
WARMUP_CLIP = 10.0
#: Steps between the metric's refreshes in the start buffer.
START_BLOCK = 10
#: Pseudo-steps of the previous metric that each window's covariances are shrunk towards.
PRIOR_COUNT = 1
#: Largest difference, in posterior sds, between the means of the halves of the last
#: slow window before the kernel says warm-up had not converged.
DRIFT_TOLERANCE = 3.0
#: Largest factor by which the last slow window's estimate may exceed the growth cap
#: before the kernel says the metric had not caught up with the posterior.
OUTGROWN_TOLERANCE = 10.0
#: Relative floor of the eigenvalues of a covariance: a direction the window never moved
#: along is left to the shrinkage, not inverted.
_EIGEN_FLOOR = 1e-12


def one_device(theta: list[torch.Tensor]) -> bool:
    """Whether the parameters are on one device (a dense mass needs it)."""
    return len({t.device for t in theta}) == 1


def dense_by_default(theta: list[torch.Tensor]) -> bool:
    """Whether the mass is dense by default: at most ``DENSE_MAX_DIMENSION`` parameters,
    on one device."""
    return one_device(theta) and sum(t.numel() for t in theta) <= DENSE_MAX_DIMENSION


def largest_curvature(
    gradient_at: Callable[[dict], list[torch.Tensor]],
    params: dict[str, torch.Tensor],
    grads: list[torch.Tensor],
) -> float:
    """The largest curvature of the minibatch potential at the chain's start, for
    :meth:`DenseAdaptation.start`: the power method on Hessian-vector products, each a
    difference of two gradients on the same batch (so free of minibatch noise), from a
    fixed direction.

    :param gradient_at: the gradient of the log joint on the start's batch at other values
        of the sites (``name -> unconstrained value``).
    :param dict params: the sites' unconstrained values at the start.
    :param list grads: the gradient there.
    """
    theta = list(params.values())
    generator = torch.Generator().manual_seed(0)
    direction = [torch.randn(t.shape, generator=generator, dtype=t.dtype).to(t) for t in theta]
    largest = max(float(t.detach().abs().max()) for t in theta)
    # the coarsest dtype's precision sets the difference's step
    shift = max(torch.finfo(t.dtype).eps for t in theta) ** 0.5 * (1 + largest)
    curvature = 0.0
    for _ in range(CURVATURE_ITERATIONS):
        length = float(norm(direction))
        if not 0 < length < math.inf:
            break
        with torch.no_grad():
            moved = {
                name: (t + (shift / length) * v).requires_grad_(True)
                for (name, t), v in zip(params.items(), direction)
            }
        shifted = gradient_at(moved)
        # H v / |v| of the potential -log p
        direction = [(g - s) / shift for g, s in zip(grads, shifted)]
        curvature = float(norm(direction))
    return curvature if 0 < curvature < math.inf else 1.0


class DenseAdaptation(Adaptation):
    """The warm-up adaptation with a dense mass :math:`M^{-1} = L L^\\top` (see the module
    docstring); the step size's adaptation is :class:`Adaptation`'s.

    The kernel runs its unit-mass update on the whitened gradient :meth:`whiten` gives,
    into the zeroed buffers of :meth:`displacement`, and :meth:`move` then adds
    :math:`L\\,\\Delta z` to the parameters.

    :param list theta: the chain's parameters, whose positions the windows read.
    :param int num_data: N (the inverse mass is :math:`N \\hat\\Sigma`).
    :param float temperature: T.
    :param kwargs: as :class:`Adaptation`'s (``adapt_mass_matrix`` must be True).
    """

    # no diagonal buffers: the update runs with the unit mass on whitened coordinates
    _diagonal = False

    def __init__(
        self,
        theta: list[torch.Tensor],
        warmup_steps: int,
        step_size,
        *,
        num_data: int,
        temperature: float,
        **kwargs,
    ):
        super().__init__(theta, warmup_steps, step_size, **kwargs)
        self._theta = theta
        self._num_data = num_data
        self._temperature = temperature
        self._delta = [torch.zeros_like(t) for t in theta]
        dimension = self._dimension
        #: L, the Cholesky factor of the inverse mass (None before :meth:`start`)
        self.factor: torch.Tensor | None = None
        # the metric is kept in the widest of the parameters' dtypes
        dtype = functools.reduce(torch.promote_types, [t.dtype for t in theta])
        zeros = {"dtype": dtype, "device": theta[0].device}
        # the window's sums: positions, their outer products, gradients, theirs
        self._sums = {
            "theta": torch.zeros(dimension, **zeros),
            "theta2": torch.zeros(dimension, dimension, **zeros),
            "grad": torch.zeros(dimension, **zeros),
            "cross": torch.zeros(dimension, dimension, **zeros),
            "halves": torch.zeros(2, dimension, **zeros),
        }
        #: The largest drift between the halves of the last slow window, in posterior sds.
        self.drift = 0.0
        #: How many times wider along some direction the last refresh's estimate was than
        #: the growth cap let the metric become (above 1: the metric was still catching up).
        self.outgrown = 0.0
        # under the final metric (the end buffer's and the kept draws' steps): the sums
        # of the window's, and of the squared whitened gradients and their number, for
        # gradient_noise
        self._fixed = {key: torch.zeros_like(value) for key, value in self._sums.items()}
        del self._fixed["halves"]
        self._fixed["heat"] = torch.zeros(2, **zeros)
        self._refreshed = False  # the metric changed in the step in progress

    # -- the kernel's calls ----------------------------------------------------------

    def start(self, curvature: float) -> None:
        """Set the first metric and step size from the largest curvature of the minibatch
        potential at the chain's start (the kernel measures it with a few same-batch
        gradients): an isotropic mass under which that direction has curvature one, and
        the step size ``start`` (or the given one, converted from the unit mass)."""
        variance = self._num_data / curvature  # N / lambda: the inverse mass
        like = self._sums["theta"]
        self.factor = math.sqrt(variance) * torch.eye(
            self._dimension, dtype=like.dtype, device=like.device
        )
        self._units = 1 / variance**self._exponent
        if self.step_size is None:
            step_size = self._start
        else:  # the same move as the given step with the unit mass
            step_size = self.step_size / variance**self._exponent
        self.step_size = min(step_size, self._max_step_size)
        self._log_step = math.log(self.step_size)
        if self._data_parallel:
            self._agree()

    @property
    def langevin(self) -> bool:
        """Langevin dynamics in the start buffer (see the module docstring)."""
        return self._window == 0

    def whiten(self, grads: list[torch.Tensor], clip: bool = False) -> list[torch.Tensor]:
        """:math:`L^\\top g`, shaped like the parameters; with ``clip`` (warm-up steps after
        the start buffer, where the chain is on its way in and the gradients are large) its
        norm at most ``WARMUP_CLIP`` times its root mean square in equilibrium,
        :math:`\\sqrt{N T d}`: warm-up need not keep the target, and a chain that meets a
        region far stiffer than its metric (eight schools' log tau, where the likelihood's
        curvature grows as tau squared) is thrown a hundred sds into a tail, where it
        spends the window and corrupts the metric."""
        whitened = self.factor.T @ self._flat(grads)
        if clip and self._window > 0:  # the start buffer's chain is on its way in
            limit = WARMUP_CLIP * math.sqrt(self._num_data * self._temperature * self._dimension)
            whitened = whitened * (limit / whitened.norm()).clamp(max=1.0)
        return self._unflat(whitened)

    def displacement(self) -> list[torch.Tensor]:
        """Zeroed buffers shaped like the parameters, for the update's :math:`\\Delta z`."""
        torch._foreach_zero_(self._delta)
        return self._delta

    def move(self, theta: list[torch.Tensor]) -> None:
        """:math:`\\theta \\leftarrow \\theta + L\\,\\Delta z`."""
        torch._foreach_add_(theta, self._unflat(self.factor @ self._flat(self._delta)))

    def observe_gradient(self, grads: list[torch.Tensor]) -> None:
        if self._window >= len(self._windows) - 1:
            return  # the metric is fixed in the end buffer
        self._count += 1
        sums = self._sums
        position = self._add_moments(sums, grads)
        if self._window == len(self._windows) - 2:  # the last slow window's halves
            window = self._windows[self._window]
            half = int(self._count > (window.end - window.start + 1) // 2)
            sums["halves"][half].add_(position)
        if self._window == 0 and self._count == START_BLOCK:
            self._refresh_metric()  # on the way in, the curvature changes as the chain moves
            self._zero()
            self._refreshed = True
        if self._stiff is not None and self._in_slow_window:
            self._stiff.observe(self.whiten(grads), None)

    def _add_moments(self, sums: dict, grads: list[torch.Tensor]) -> torch.Tensor:
        """Add the position, the gradient and their products to ``sums``; return the
        flat position."""
        position, gradient = self._flat(self._theta).detach(), self._flat(grads)
        sums["theta"].add_(position)
        sums["theta2"].addr_(position, position)
        sums["grad"].add_(gradient)
        sums["cross"].addr_(position, gradient)
        return position

    def end_step(self, iteration: int) -> bool:
        window, refreshed = self._window, self._refreshed
        more = super().end_step(iteration)
        if self._window != window:
            self._zero()  # each window's sums are its own
        self._refreshed = False
        # fresh momenta after a change of metric in the start buffer too: whitened momenta
        # kept would move the chain as far as the metric grew
        return more or refreshed

    def begin(self, gradient_at, params, grads) -> None:
        self.start(largest_curvature(gradient_at, params, grads))

    def apply(self, update, theta, grads, step_size, adapting) -> None:
        # the unit-mass update of z = L^{-1} theta, then theta += L (z' - z)
        whitened = self.whiten(grads, clip=adapting)
        if self._window >= len(self._windows) - 1:  # the metric is final
            self._observe_noise(grads, whitened)
        update(self.displacement(), whitened, step_size)
        self.move(theta)

    def _observe_noise(self, grads: list[torch.Tensor], whitened: list[torch.Tensor]) -> None:
        """Add a step under the final metric to the sums of :attr:`gradient_noise`."""
        fixed = self._fixed
        self._add_moments(fixed, grads)
        fixed["heat"][0] += langevin.squared_norm(whitened)
        fixed["heat"][1] += 1

    @property
    def gradient_noise(self) -> float | None:
        r"""The minibatch gradient noise relative to the gradients' signal, measured over
        the steps under the final metric, the end buffer's and the kept draws' (None
        before two of them): the whitened covariance of the gradients that the positions
        do not explain, :math:`\mathrm{tr}\, L^\top (\mathrm{Cov}(\hat g) - B^\top C^{-1}
        B) L / (N T d)`, with :math:`C` and :math:`B` the positions' covariance and their
        cross-covariance with the gradients, as for the metric.

        The minibatch noise of a step is independent of the position it starts from, so
        it is what the positions do not explain; on a Gaussian posterior the exact
        gradient is explained whatever the law of the positions (:math:`B = -CH`), so a
        chain that mixes slowly, or has not arrived, measures the noise as well as one in
        equilibrium. The explained part is :math:`N T d` under the final metric in
        equilibrium, which the noise is measured against: full batches give about 0,
        batches of :math:`B` of :math:`N` data about :math:`N / B - 1` where the
        per-datum gradients spread as the Fisher information."""
        fixed = self._fixed
        count = int(fixed["heat"][1])
        if count < 2:
            return None
        positions = _covariance(fixed["theta"], fixed["theta"], fixed["theta2"], count)
        cross = _covariance(fixed["theta"], fixed["grad"], fixed["cross"], count)
        explained = cross.T @ torch.linalg.pinv(positions, hermitian=True) @ cross
        mean = self.factor.T @ (fixed["grad"] / count)
        total = float(fixed["heat"][0]) / count - float(mean @ mean)
        explained = float((self.factor.T @ explained @ self.factor).trace())
        return (total - explained) / (self._num_data * self._temperature * self._dimension)

    def warning(self) -> str | None:
        drifted = self.drift > DRIFT_TOLERANCE  # (a NaN drift is no finding)
        if not (drifted or self.outgrown > OUTGROWN_TOLERANCE):
            return None
        # a chain still drifting while the metric is held back by its cap is still
        # catching up with the posterior's width
        outgrown = self.outgrown > (1 if drifted else OUTGROWN_TOLERANCE)
        found = []
        if drifted:
            found.append(
                f"the means of the halves of its last window differ by {self.drift:.2g} "
                f"posterior sds (more than {DRIFT_TOLERANCE:g})"
            )
        if outgrown:
            found.append(
                f"its last window's estimate of the posterior's covariance was "
                f"{self.outgrown:.2g} times wider along some direction than the mass may "
                f"widen in one window (at most {MAX_GROWTH:g}-fold)"
            )
        head = f"warm-up had not converged when it fixed the dense mass: {' and '.join(found)}"
        if not outgrown:
            return f"{head}; run more warmup_steps (the last window doubles with them)"
        # More warm-up barely helps here: each window widens the metric at most
        # MAX_GROWTH-fold; on posteriordb's earn_height the draws after 5,000 warm-up steps
        # were still drifting, where a start near the posterior was right after 1,000.
        return (
            f"{head}: the chain started where the posterior is far stiffer than near its "
            "mode, as when the parameters are on the data's scale (1e2 - 1e5: dollars, "
            "grams) and the chain starts near 0 and 1, and more warmup_steps widen the "
            "mass only slowly; start the chain near the posterior (init_params, e.g. a "
            "mode from an optimiser or a rough estimate), or rescale the data to about "
            "unit scale"
        )

    def inverse_mass_matrix_of(self, params: dict[str, torch.Tensor]) -> dict:
        # keyed by the tuple of every site's name, as Pyro's HMC keys a full_mass group
        return {tuple(params): self.inverse_mass_matrix}

    @property
    def inverse_mass_matrix(self) -> torch.Tensor:
        """:math:`M^{-1} = L L^\\top`, the dense inverse mass (:math:`d \\times d`)."""
        return self.factor @ self.factor.T

    # -- internals ---------------------------------------------------------------------

    def _flat(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """One vector in the metric's dtype."""
        return torch.cat([t.reshape(-1) for t in tensors]).to(self._sums["theta"].dtype)

    def _unflat(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """A vector back to tensors shaped (and typed) like the parameters."""
        pieces = flat.split([t.numel() for t in self._theta])
        return [piece.view_as(t).to(t.dtype) for piece, t in zip(pieces, self._theta)]

    def _end_slow_window(self) -> None:
        if self._window == len(self._windows) - 2:
            self.drift = self._drift(self._refresh_metric() * self._temperature)
        else:
            self._refresh_metric()

    def _zero(self) -> None:
        for value in self._sums.values():
            value.zero_()
        self._count = 0

    def _refresh_metric(self) -> torch.Tensor:
        r"""The dense metric from the positions and gradients since the last refresh; returns
        :math:`\hat\Sigma`."""
        count, sums = self._count, self._sums
        temperature = self._temperature
        previous = self.inverse_mass_matrix / self._num_data  # Sigma so far
        weight = PRIOR_COUNT / (count + PRIOR_COUNT)
        eye = torch.eye(self._dimension, dtype=previous.dtype, device=previous.device)
        # C and B = Cov(theta, g), each shrunk towards its value in equilibrium under the
        # previous metric: T Sigma and -T I (Stein's identity)
        positions = _covariance(sums["theta"], sums["theta"], sums["theta2"], count)
        positions = (1 - weight) * positions + weight * temperature * previous
        cross = _covariance(sums["theta"], sums["grad"], sums["cross"], count)
        cross = (1 - weight) * cross - weight * temperature * eye
        # the covariance of the gradients that the positions explain, B^T C^{-1} B
        gradients = cross.T @ torch.linalg.solve(positions, cross)
        sigma = _geometric_mean(positions, _inverse((gradients + gradients.T) / 2))
        # at most MAX_GROWTH (MAX_START_GROWTH) times the previous metric along any
        # direction
        root, inverse_root = _powers(previous, 0.5, -0.5)
        values, vectors = torch.linalg.eigh(inverse_root @ sigma @ inverse_root)
        if not bool(torch.isfinite(values).all()):
            return previous  # keep the metric
        cap = MAX_START_GROWTH if self._window == 0 else MAX_GROWTH
        self.outgrown = float(values.max()) / cap
        values = values.clamp(max=cap)
        relative = (vectors * values) @ vectors.T
        sigma = root @ relative @ root
        # a square root of N Sigma (the symmetric one: defined whatever rounding does)
        self.factor = root @ (vectors * values.sqrt()) @ vectors.T * math.sqrt(self._num_data)
        if self._data_parallel:
            distributed.broadcast_([self.factor])
        return sigma

    def _drift(self, covariance: torch.Tensor) -> float:
        """The largest difference between the means of the halves of the last slow window
        in sds of ``covariance``."""
        count = self._count
        first, second = count // 2, count - count // 2
        if first == 0 or second == 0:
            return 0.0
        halves = self._sums["halves"]
        difference = halves[1] / second - halves[0] / first
        return float((difference.abs() / covariance.diagonal().sqrt()).max())

    def _agree(self) -> None:
        super()._agree()
        if self.factor is not None:
            distributed.broadcast_([self.factor])

    # -- checkpoints -------------------------------------------------------------------

    def state(self) -> tuple[dict[str, torch.Tensor], dict]:
        tensors, numbers = super().state()
        tensors.update({f"dense/{key}": value for key, value in self._sums.items()})
        tensors.update({f"dense/fixed/{key}": value for key, value in self._fixed.items()})
        if self.factor is not None:
            tensors["dense/factor"] = self.factor
        numbers["dense"] = {"drift": self.drift, "outgrown": self.outgrown}
        return tensors, numbers

    def load_state(self, tensors: dict[str, torch.Tensor], numbers: dict) -> None:
        super().load_state(tensors, numbers)
        for key, value in self._sums.items():
            value.copy_(tensors[f"dense/{key}"])
        factor = tensors.get("dense/factor")
        self.factor = None if factor is None else factor.to(self._sums["theta"]).clone()
        self.drift = numbers["dense"]["drift"]
        self.outgrown = numbers["dense"].get("outgrown", 0.0)  # (earlier versions: none)
        for key, value in self._fixed.items():
            saved = tensors.get(f"dense/fixed/{key}")  # (earlier versions: none)
            if saved is not None:
                value.copy_(saved)


def _covariance(first: torch.Tensor, second: torch.Tensor, outer: torch.Tensor, count: int):
    """The covariance of two vectors from their sums and the sum of their outer products."""
    return outer / count - torch.outer(first / count, second / count)


def _powers(matrix: torch.Tensor, *exponents: float) -> list[torch.Tensor]:
    """A symmetric positive semi-definite matrix to each power, from one eigendecomposition,
    its eigenvalues floored at ``_EIGEN_FLOOR`` times the largest."""
    values, vectors = torch.linalg.eigh(matrix)
    values = values.clamp_min(_EIGEN_FLOOR * values.max().clamp_min(0)).clamp_min(
        torch.finfo(values.dtype).tiny
    )
    return [(vectors * values.pow(exponent)) @ vectors.T for exponent in exponents]


def _inverse(matrix: torch.Tensor) -> torch.Tensor:
    (inverse,) = _powers(matrix, -1.0)
    return inverse


def _geometric_mean(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """:math:`A \\# B = A^{1/2} (A^{-1/2} B A^{-1/2})^{1/2} A^{1/2}`."""
    root, inverse_root = _powers(a, 0.5, -0.5)
    (middle,) = _powers(inverse_root @ b @ inverse_root, 0.5)
    mean = root @ middle @ root
    return (mean + mean.T) / 2
