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
second moment, :math:`v \leftarrow \sum_t g_t (g_t^\top v)` normalised; no extra gradient
is computed. The ratio is measured on gradients the direction was not fitted to (each
step's against the direction of the blocks before it): the top eigenvalue of a sample
second moment is biased upwards, by orders of magnitude when the dimension exceeds the
number of gradients (a million weights, a few hundred steps), while an out-of-sample
Rayleigh quotient is unbiased for whatever direction was found.
"""

from __future__ import annotations

import torch

from pyro_bdl.inference.sgmcmc._buffers import FlatBuffers

__all__ = ["StiffDirection"]

#: Gradients per power-method iteration.
BLOCK = 8
#: One gradient in this many is observed: a sample is enough, and each observation costs
#: about five passes over the parameters (on the 1M-weight MLP of
#: ``benchmarks/sgmcmc_overhead.py``, one thread: 0.85 ms, 0.21 ms per step, against a
#: 5.4 ms SGD step).
STRIDE = 4


class StiffDirection:
    """The power method on the second moment of a chain's whitened gradients, and how
    much stiffer than average the direction it finds is.

    :param list theta: the chain's parameters (shapes, dtypes and devices).
    """

    def __init__(self, theta: list[torch.Tensor]):
        self._dimension = sum(t.numel() for t in theta)
        self._direction = FlatBuffers(theta)
        self._next = FlatBuffers(theta)  # the current block's sum of g (g . direction)
        self._gradient = FlatBuffers(theta)  # the whitened gradient observed
        for flat in (*self._direction.flats, *self._next.flats):
            flat.zero_()
        device = theta[0].device
        # sums over the measurement of (g . direction)^2 and |g|^2, on the device
        self._along = torch.zeros((), dtype=torch.float64, device=device)
        self._total = torch.zeros((), dtype=torch.float64, device=device)
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
        self._along += projection.square()
        self._total += _dot(gradient, gradient)
        for block_sum, flat in zip(self._next.flats, gradient):
            block_sum.addcmul_(flat, projection.to(flat))
        self.in_block += 1
        if self.in_block == BLOCK:
            torch._foreach_copy_(self._direction.flats, self._next.flats)
            self._normalise(self._direction)
            for flat in self._next.flats:
                flat.zero_()
            self.in_block = 0

    def ratio(self) -> float:
        """The mean of :math:`(g^\\top v)^2` over the mean of :math:`|g|^2 / d` since the
        last call (at least 1: the stiffest direction is never softer than the average;
        1 when nothing was measured), and start a new measurement. One read of the device."""
        along, total = (float(x) for x in torch.stack([self._along, self._total]).tolist())
        self._along.zero_()
        self._total.zero_()
        return max(1.0, along * self._dimension / total) if total > 0 else 1.0

    def _normalise(self, buffers: FlatBuffers) -> None:
        norm = torch.stack([n.double() for n in torch._foreach_norm(buffers.flats)]).norm()
        scale = 1 / norm.clamp_min(torch.finfo(torch.float64).tiny)
        for flat in buffers.flats:
            flat.mul_(scale.to(flat.dtype))

    # -- checkpoints -------------------------------------------------------------------

    def state(self) -> tuple[dict[str, torch.Tensor], dict]:
        tensors = {f"direction/{i}": f for i, f in enumerate(self._direction.flats)}
        tensors.update({f"next/{i}": f for i, f in enumerate(self._next.flats)})
        tensors.update(along=self._along, total=self._total)
        return tensors, {"started": self.started, "seen": self.seen, "in_block": self.in_block}

    def load_state(self, tensors: dict[str, torch.Tensor], numbers: dict) -> None:
        for name, buffers in (("direction", self._direction), ("next", self._next)):
            for i, flat in enumerate(buffers.flats):
                flat.copy_(tensors[f"{name}/{i}"])
        self._along.copy_(tensors["along"])
        self._total.copy_(tensors["total"])
        self.started, self.seen, self.in_block = (
            numbers[k] for k in ("started", "seen", "in_block")
        )


def _dot(a: list[torch.Tensor], b: list[torch.Tensor]) -> torch.Tensor:
    """The inner product of two lists of flat tensors as one vector (float64)."""
    return sum(torch.dot(x, y).double() for x, y in zip(a, b))
