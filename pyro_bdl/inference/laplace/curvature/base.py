r"""The one curvature interface behind every Laplace structure.

A :class:`Curvature` accumulates, over one pass of the data, the curvature
:math:`H = \sum_{i=1}^N J_i^\top V_i V_i^\top J_i` of the log likelihood (the GGN or a
Fisher, see :mod:`~pyro_bdl.inference.laplace.observation`) in its own structure, and
turns it into :class:`GaussianBlock`\ s of the posterior precision

.. math:: P = H + \operatorname{diag}(\delta), \qquad \Sigma = T P^{-1},

where :math:`\delta` is the prior precision and :math:`T` the temperature. Scaling with
the data-set size is explicit and the same for every structure: each batch adds its
examples' unscaled sum, and after the pass the sum is multiplied by
:math:`N / n_\text{seen}` (1 after a full pass over ``N`` examples).

A block covers one or more latent sites and answers everything the guide asks of the
Gaussian, given the prior precisions ``delta`` (site -> tensor broadcastable to the
site): its log determinant (evidence), a square root of the covariance (sampling), a
quadratic form (log density), :math:`J P^{-1} J^\top` from per-example Jacobians
(linearised predictive), marginal variances, and the tensors to export.
"""

from __future__ import annotations

import torch

from pyro_bdl import distributed
from pyro_bdl._checks import integer, one_of
from pyro_bdl.inference.laplace.jacobians import SiteGradient
from pyro_bdl.inference.laplace.observation import FISHERS

__all__ = ["Curvature", "GaussianBlock"]

Delta = dict[str, torch.Tensor]


class GaussianBlock:
    """A block of the posterior precision over the latent sites ``sites``.

    :ivar tuple sites: the sites it covers, in the order of its parameters.
    :ivar dict shapes: site -> shape.
    """

    sites: tuple[str, ...]
    shapes: dict[str, torch.Size]

    def log_det(self, delta: Delta) -> torch.Tensor:
        """:math:`\\log\\det P` of the block."""
        raise NotImplementedError

    def check_prior(self, delta: Delta) -> None:
        """Raise a ``ValueError`` if the prior precisions ``delta`` do not suit the block.

        Structures that take any prior need not override it; it must not compute the
        block's decomposition (a fit ends with this check, before anyone asks for one).
        """

    def sample(self, noise: dict[str, torch.Tensor], delta: Delta) -> dict[str, torch.Tensor]:
        """:math:`R z` for standard normal ``noise`` shaped ``(S, *site_shape)``.

        :math:`R` is a square root of the covariance, :math:`R R^\\top = P^{-1}`, so the
        draws are :math:`\\mathcal{N}(0, P^{-1})` and their quadratic form is
        :math:`\\|z\\|^2`.
        """
        raise NotImplementedError

    def quadratic(self, x: dict[str, torch.Tensor], delta: Delta) -> torch.Tensor:
        """:math:`x^\\top P x` for ``x`` shaped ``(S, *site_shape)``; returns ``(S,)``."""
        raise NotImplementedError

    def output_covariance(self, grads: dict[str, SiteGradient], delta: Delta) -> torch.Tensor:
        """:math:`J_i P^{-1} J_i^\\top` per example from the Jacobian rows ``grads``.

        :return: ``(B, K, K)`` for ``K`` Jacobian rows (gradient columns) per example.
        """
        raise NotImplementedError

    def variance(self, delta: Delta) -> dict[str, torch.Tensor]:
        """The diagonal of :math:`P^{-1}`, per site."""
        raise NotImplementedError

    def restrict(self, site: str) -> GaussianBlock:
        """The block of :math:`P` belonging to one site (cross-site terms dropped)."""
        raise NotImplementedError

    def tensors(self) -> dict[str, torch.Tensor]:
        """The curvature's tensors, named ``"<site>.<what>"``, for export."""
        raise NotImplementedError


class Curvature:
    """Accumulates the log-likelihood curvature of the latent sites over batches.

    Subclasses implement :meth:`update` and :meth:`blocks`; they inherit the choice of
    ``fisher`` (which columns :math:`V` the likelihood gives).

    :param str fisher: ``"ggn"`` (exact generalised Gauss-Newton), ``"ef"`` (empirical
        Fisher) or ``"mc"`` (Monte Carlo Fisher).
    :param int num_samples: labels drawn per example for ``fisher="mc"``.
    """

    name = "curvature"

    def __init__(self, fisher: str = "ggn", num_samples: int = 1):
        self.fisher = one_of("fisher", fisher, FISHERS)
        self.num_samples = integer("num_samples", num_samples, low=1)

    def begin(self, values: dict[str, torch.Tensor]) -> None:
        """Start a pass for latent sites at ``values`` (name -> MAP value)."""
        self.values = values

    def update(self, grads: dict[str, SiteGradient]) -> None:
        """Add one batch, given its per-example gradients of every column."""
        raise NotImplementedError

    def blocks(self, scale: float) -> list[GaussianBlock]:
        """The accumulated curvature times ``scale`` (:math:`N / n_\\text{seen}`)."""
        raise NotImplementedError

    def accumulators(self) -> list[torch.Tensor]:
        """The tensors the pass has summed over examples (a structure's running sums)."""
        raise NotImplementedError

    def synchronise(self) -> None:
        """Add up the passes of every rank of a data-parallel fit (torch.distributed).

        Every accumulator is a sum over examples, so the ranks' sums add up to the sums over
        the global batch; a no-op in a single process.
        """
        if distributed.is_distributed():
            distributed.all_reduce_(self.accumulators())

    def hyperparameters(self) -> dict:
        """The structure's settings, JSON-serialisable."""
        return {"curvature": self.name, "fisher": self.fisher, "fisher_samples": self.num_samples}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(fisher={self.fisher!r})"
