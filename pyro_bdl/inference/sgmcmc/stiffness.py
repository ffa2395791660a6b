r"""The stiffest direction of a chain's (whitened) target, from the gradients it computes.

A diagonal mass equalises the curvature along the coordinates, not along the directions
the data pin. In a network the stiff directions are combinations of many weights (the
function's value where the data are), so after the diagonal whitening the curvature of
the stiffest direction can be many times the average: on the 2-8-1 MLP of
``tests/inference/sgmcmc/reference_models.py`` (``make_moons``) the largest eigenvalue of
the whitened Hessian is 5 times the average at the posterior mean (13 times at a typical
draw). The variance excess of a discretised chain grows with the curvature direction by
direction (SGLD's :math:`\epsilon\lambda/2`, SGHMC's :math:`\propto\epsilon^2\lambda`, and
the heat of minibatch gradient noise, whose covariance is the Fisher's, also
:math:`\propto\lambda`), so a step size tuned on the excess averaged over directions
leaves the stiffest ones that many times hotter; warm-up therefore ends by lowering the
step until the stiffest direction found is at the target
(``Adaptation.stiff_factor``).

By the Fisher identity the second moment of the gradients is the expected curvature,
:math:`\mathbb{E}_\pi[g g^\top] = \mathbb{E}_\pi[-\nabla^2\log\pi]`, so its leading
eigenvector is the stiffest direction on average over the posterior, and the ratio of
its Rayleigh quotient to the mean eigenvalue (``trace / d``) is how much hotter that
direction runs. ``StiffDirection`` finds it by the power method on the chain's own
(whitened) gradients: each block of gradients multiplies the current direction by their
covariance, :math:`v \leftarrow \sum_t (g_t - \bar g)(g_t - \bar g)^\top v` normalised;
no extra gradient is computed. Near the posterior the mean gradient vanishes and this is
the second moment; on a chain's way in the mean is a steady force, which the second
moment would report as a direction about d times stiffer than the average (measured on
the 1M-weight MLP of ``benchmarks/sgmcmc_overhead.py``: 466,000), so each block is taken
about its own straight line in time, which removes it. The ratio is measured on
gradients the direction was not fitted to (each step's against the direction of the
blocks before it): the top eigenvalue of a sample
second moment is biased upwards, by orders of magnitude when the dimension exceeds the
number of gradients (a million weights, a few hundred steps), while an out-of-sample
Rayleigh quotient is unbiased for whatever direction was found.
"""

from __future__ import annotations

import torch

from pyro_bdl.inference.sgmcmc._buffers import FlatBuffers
from pyro_bdl.inference.sgmcmc.device import norm

__all__ = ["StiffDirection"]

#: Gradients per power-method iteration.
BLOCK = 8
#: One gradient in this many is observed: a sample is enough, and each observation costs
#: about seven passes over the parameters (on the 1M-weight MLP of
#: ``benchmarks/sgmcmc_overhead.py``, one thread: 1.8 ms, 0.44 ms per step, against a
#: 5.1 ms SGD step; a slow-window SGHMC step there is 1.17 times the fixed kernel's,
#: 1.12 without this).
STRIDE = 4


class StiffDirection:
    """The power method on the covariance of a chain's whitened gradients (within
    blocks, about each block's straight line in time), and how much stiffer than average
    the direction it finds is.

    :param list theta: the chain's parameters (shapes, dtypes and devices).
    """

    def __init__(self, theta: list[torch.Tensor]):
        self._dimension = sum(t.numel() for t in theta)
        self._direction = FlatBuffers(theta)
        self._next = FlatBuffers(theta)  # the current block's sum of g (g . direction)
        self._block = FlatBuffers(theta)  # the current block's sum of g
        self._slope = FlatBuffers(theta)  # the current block's sum of c_t g_t (see _end_block)
        self._gradient = FlatBuffers(theta)  # the whitened gradient observed
        for buffers in self._buffers().values():
            for flat in buffers.flats:
                flat.zero_()
        device = theta[0].device
        # the current block's sums of g . direction, of its square, of |g|^2 and of
        # c_t g . direction; the measurement's sums of the blocks' detrended
        # (g . direction)^2 and |g|^2
        self._sums = torch.zeros(6, dtype=torch.float64, device=device)
        self.started = False
        self.seen = 0  # gradients offered
        self.in_block = 0  # gradients observed in the current block

    def observe(self, grads: list[torch.Tensor], scale: list[torch.Tensor] | None) -> None:
        """Offer a gradient and the mass's :math:`D^{-1/2}` (None: the unit mass). One in
        ``STRIDE`` is whitened, measured along the current direction and added to the
        next power-method iteration."""
        self.seen += 1
        if self.seen % STRIDE:
            return
        torch._foreach_copy_(self._gradient.views, grads)
        if scale is not None:
            torch._foreach_mul_(self._gradient.views, scale)
        gradient = self._gradient.flats
        if not self.started:  # the first gradient is the first direction, not measured
            torch._foreach_copy_(self._direction.flats, gradient)
            self._normalise(self._direction)
            self.started = True
            return
        projection = _dot(gradient, self._direction.flats)
        time = self.in_block - (BLOCK - 1) / 2
        self._sums[:4] += torch.stack(
            [projection, projection.square(), _dot(gradient, gradient), time * projection]
        )
        for block_sum, flat in zip(self._next.flats, gradient):
            block_sum.addcmul_(flat, projection.to(flat))
        torch._foreach_add_(self._block.flats, gradient)
        torch._foreach_add_(self._slope.flats, gradient, alpha=time)
        self.in_block += 1
        if self.in_block == BLOCK:
            self._end_block()

    def _end_block(self) -> None:
        """Measure the block and take the power method's step, both on the gradients'
        residuals from a straight line in time over the block: on a chain's way in the
        gradient is a steady force, changing as the chain moves, whose direction would
        otherwise be "the stiffest" with a ratio near d. With the centred times c_t, the
        residuals r_t = g_t - S_0 / n - c_t S_1 / C (S_0 = sum g_t, S_1 = sum c_t g_t,
        C = sum c_t^2) give sum r_t (r_t . v) = sum g_t (g_t . v) - S_0 (S_0 . v) / n -
        S_1 (S_1 . v) / C, and likewise for (r_t . v)^2 and |r_t|^2."""
        n = BLOCK
        spread = n * (n * n - 1) / 12  # C
        along_mean, squares, norms, along_slope = self._sums[:4]  # S_0 . v, ..., S_1 . v
        self._sums[4] += squares - along_mean.square() / n - along_slope.square() / spread
        self._sums[5] += (
            norms
            - _dot(self._block.flats, self._block.flats) / n
            - _dot(self._slope.flats, self._slope.flats) / spread
        )
        for block_sum, mean, slope in zip(self._next.flats, self._block.flats, self._slope.flats):
            block_sum.sub_(mean * (along_mean / n).to(mean))
            block_sum.sub_(slope * (along_slope / spread).to(slope))
        torch._foreach_copy_(self._direction.flats, self._next.flats)
        self._normalise(self._direction)
        for flat in (*self._next.flats, *self._block.flats, *self._slope.flats):
            flat.zero_()
        self._sums[:4] = 0
        self.in_block = 0

    def ratio(self) -> float:
        r"""The variance of :math:`g^\top v` over the mean variance :math:`\mathrm{tr}/d`
        of the gradients (their residuals from each block's straight line), over the
        blocks completed since the last call (at least 1: the stiffest direction is
        never softer than the average; 1 when nothing was measured), and start a new
        measurement. One read of the device."""
        along, total = self._sums[4:].tolist()
        self._sums[4:] = 0
        return max(1.0, along * self._dimension / total) if total > 0 else 1.0

    def _normalise(self, buffers: FlatBuffers) -> None:
        scale = 1 / norm(buffers.flats).double().clamp_min(torch.finfo(torch.float64).tiny)
        for flat in buffers.flats:
            flat.mul_(scale.to(flat.dtype))

    # -- checkpoints -------------------------------------------------------------------

    def state(self) -> tuple[dict[str, torch.Tensor], dict]:
        tensors = {"sums": self._sums}
        for name, buffers in self._buffers().items():
            tensors.update({f"{name}/{i}": f for i, f in enumerate(buffers.flats)})
        return tensors, {"started": self.started, "seen": self.seen, "in_block": self.in_block}

    def load_state(self, tensors: dict[str, torch.Tensor], numbers: dict) -> None:
        for name, buffers in self._buffers().items():
            for i, flat in enumerate(buffers.flats):
                flat.copy_(tensors[f"{name}/{i}"])
        self._sums.copy_(tensors["sums"])
        self.started, self.seen = numbers["started"], numbers["seen"]
        self.in_block = numbers["in_block"]

    def _buffers(self) -> dict[str, FlatBuffers]:
        return {
            "direction": self._direction,
            "next": self._next,
            "block": self._block,
            "slope": self._slope,
        }


def _dot(a: list[torch.Tensor], b: list[torch.Tensor]) -> torch.Tensor:
    """The inner product of two lists of flat tensors as one vector (float64)."""
    return sum(torch.dot(x, y).double() for x, y in zip(a, b))
