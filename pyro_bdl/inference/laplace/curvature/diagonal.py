r"""Diagonal curvature: :math:`\operatorname{diag}\big(\sum_i J_i^\top V_i V_i^\top J_i\big)`.

With ``fisher="ggn"`` this is the diagonal GGN (``"diag_ggn"``), with ``fisher="ef"``
the diagonal empirical Fisher :math:`\sum_i (\nabla_\theta \log p(y_i \mid \theta))^2`
(``"diag_ef"``), the two diagonal Laplace approximations of the posteriors paper
(section 2, Appendix A.1). The posterior precision is :math:`h + \delta` per entry.
"""

from __future__ import annotations

import torch

from pyro_bdl.inference.laplace.curvature.base import Curvature, Delta, GaussianBlock

__all__ = ["Diagonal", "DiagonalBlock"]


class DiagonalBlock(GaussianBlock):
    """Posterior precision :math:`h + \\delta` of one site, entry by entry.

    :param str site: the site.
    :param torch.Tensor curvature: :math:`h`, shaped like the site.
    """

    def __init__(self, site: str, curvature: torch.Tensor):
        self.sites = (site,)
        self.shapes = {site: curvature.shape}
        self.site = site
        self.curvature = curvature

    def _precision(self, delta: Delta) -> torch.Tensor:
        return self.curvature + delta[self.site]

    def log_det(self, delta):
        return self._precision(delta).log().sum()

    def sample(self, noise, delta):
        return {self.site: noise[self.site] * self._precision(delta).rsqrt()}

    def quadratic(self, x, delta):
        squares = x[self.site].square() * self._precision(delta)
        return squares.reshape(len(squares), -1).sum(1)  # a 0-d site's x is (S,)

    def output_covariance(self, grads, delta):
        return grads[self.site].gram(self._precision(delta).reciprocal())

    def variance(self, delta):
        return {self.site: self._precision(delta).reciprocal()}

    def restrict(self, site):
        return self

    def tensors(self):
        return {f"{self.site}.curvature_diagonal": self.curvature}


class Diagonal(Curvature):
    """The diagonal of the GGN (``fisher="ggn"``) or of a Fisher, per entry.

    Example::

        guide = LaplaceGuide(model, curvature="diag_ggn")
        guide = LaplaceGuide(model, curvature=Diagonal(fisher="ef"))   # = "diag_ef"
    """

    @property
    def name(self) -> str:
        return f"diag_{self.fisher}"

    def begin(self, values):
        super().begin(values)
        self.sums = {site: torch.zeros_like(value) for site, value in values.items()}

    def update(self, grads):
        for site, grad in grads.items():
            self.sums[site] += grad.sum_of_squares()

    def blocks(self, scale):
        return [DiagonalBlock(site, total * scale) for site, total in self.sums.items()]

    def accumulators(self):
        return list(self.sums.values())
