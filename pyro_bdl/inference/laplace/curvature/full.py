r"""Dense curvature over all latent sites, for small models.

:math:`H = \sum_i G_i^\top G_i` with :math:`G_i` the per-example gradients of every
column, flattened and concatenated over sites in the order of the model's trace. The
posterior precision :math:`P = H + \operatorname{diag}(\delta)` is factorised by
Cholesky, :math:`P = L L^\top`: samples are :math:`L^{-\top} z` and the predictive
covariance is :math:`\|L^{-1} J_i^\top\|^2`.
"""

from __future__ import annotations

import math

import torch

from pyro_bdl.inference.laplace.curvature.base import Curvature, Delta, GaussianBlock

__all__ = ["Full", "FullBlock"]


class FullBlock(GaussianBlock):
    """A dense posterior precision over several sites.

    :param dict shapes: site -> shape, in the order of the flattened parameters.
    :param torch.Tensor curvature: :math:`H`, ``(d, d)``.
    """

    def __init__(self, shapes: dict[str, torch.Size], curvature: torch.Tensor):
        self.sites = tuple(shapes)
        self.shapes = dict(shapes)
        self.sizes = [math.prod(shape) for shape in shapes.values()]
        self.curvature = curvature
        self._cached: tuple[torch.Tensor, torch.Tensor] | None = None

    def _flat_delta(self, delta: Delta) -> torch.Tensor:
        return torch.cat(
            [delta[site].expand(shape).reshape(-1) for site, shape in self.shapes.items()]
        )

    def _cholesky(self, delta: Delta) -> torch.Tensor:
        # Sampling and prediction ask again and again at the same prior precision.
        flat = self._flat_delta(delta)
        if self._cached is not None and torch.equal(self._cached[0], flat):
            return self._cached[1]
        cholesky = torch.linalg.cholesky(self.curvature + torch.diag(flat))
        if not flat.requires_grad:
            self._cached = (flat.detach().clone(), cholesky)
        return cholesky

    def _flatten(self, values: dict[str, torch.Tensor], lead: int) -> torch.Tensor:
        return torch.cat(
            [values[site].reshape(*values[site].shape[:lead], -1) for site in self.sites], -1
        )

    def _unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        parts = flat.split(self.sizes, -1)
        return {
            site: part.reshape(flat.shape[:-1] + shape)
            for (site, shape), part in zip(self.shapes.items(), parts)
        }

    def log_det(self, delta):
        return 2 * self._cholesky(delta).diagonal().log().sum()

    def sample(self, noise, delta):
        z = self._flatten(noise, 1)
        x = torch.linalg.solve_triangular(self._cholesky(delta).mT, z.mT, upper=True)
        return self._unflatten(x.mT)

    def quadratic(self, x, delta):
        flat = self._flatten(x, 1)
        precision = self.curvature + torch.diag(self._flat_delta(delta))
        return torch.einsum("sd,de,se->s", flat, precision, flat)

    def output_covariance(self, grads, delta):
        rows = self._flatten({site: grads[site].per_example() for site in self.sites}, 2)
        num_rows, batch, dim = rows.shape
        whitened = torch.linalg.solve_triangular(
            self._cholesky(delta), rows.reshape(-1, dim).mT, upper=False
        ).reshape(dim, num_rows, batch)
        return torch.einsum("pcb,pdb->bcd", whitened, whitened)

    def variance(self, delta):
        return self._unflatten(torch.cholesky_inverse(self._cholesky(delta)).diagonal())

    def restrict(self, site):
        start = sum(self.sizes[: self.sites.index(site)])
        end = start + self.sizes[self.sites.index(site)]
        return FullBlock({site: self.shapes[site]}, self.curvature[start:end, start:end])

    def tensors(self):
        return {"full.curvature": self.curvature}


class Full(Curvature):
    """The dense GGN (or Fisher) over all latent sites together.

    :param str fisher: see :class:`~pyro_bdl.inference.laplace.curvature.base.Curvature`.
    :param int max_params: refuse models with more latent entries than this (the
        curvature takes ``max_params ** 2`` numbers).
    """

    name = "full"

    def __init__(self, fisher: str = "ggn", num_samples: int = 1, max_params: int = 10_000):
        super().__init__(fisher, num_samples)
        self.max_params = max_params

    def begin(self, values):
        super().begin(values)
        size = sum(value.numel() for value in values.values())
        if size > self.max_params:
            raise ValueError(
                f"curvature='full' needs a {size} x {size} matrix for {size} latent entries, "
                f"more than max_params={self.max_params}; use 'kron', 'kron_lowrank' or "
                "'diag_ggn', or pass Full(max_params=...) if the memory is there"
            )
        first = next(iter(values.values()))
        self.sum = first.new_zeros(size, size)

    def update(self, grads):
        # reshape, not flatten(2): a scalar site's gradients are (m, B), with no dim 2
        per_site = [grads[site].per_example() for site in self.values]
        rows = torch.cat([g.reshape(*g.shape[:2], -1) for g in per_site], -1)
        rows = rows.reshape(-1, rows.shape[-1])
        self.sum += rows.mT @ rows

    def blocks(self, scale):
        shapes = {site: value.shape for site, value in self.values.items()}
        return [FullBlock(shapes, self.sum * scale)]

    def accumulators(self):
        return [self.sum]

    def hyperparameters(self):
        return {**super().hyperparameters(), "max_params": self.max_params}
