r"""K-FAC whose large factors are kept at rank ``k`` by incremental SVD.

A LoRA layer is wide on one side and narrow on the other (``d x r``), so one of its
two K-FAC factors is ``d x d`` (Laplace-LoRA blog, "Kronecker-Factored Approximate
Curvature", point 3). Every factor wider than ``k`` is kept as
:math:`F \approx U \operatorname{diag}(s) U^\top` with :math:`U \in \mathbb{R}^{d \times k}`:
a batch with rows :math:`X` (inputs or output gradients) updates it by the thin SVD of
:math:`[\,U \operatorname{diag}(\sqrt{s}),\ X^\top\,] = W \Sigma Z^\top`, keeping the top
``k`` columns of :math:`W` and :math:`\Sigma^2`. The ``d x d`` factor is never formed:
the state is :math:`O(k\, d)` per factor, :math:`O(k (d_\text{in} + d_\text{out}))` per
layer. Narrow factors stay exact. At ``k >= d`` this equals :mod:`.kron` exactly; below,
the precision's eigenvalues outside the kept subspace are the prior's :math:`\delta`
(see :class:`~.kron.KronBlock`: sampling is then a Woodbury-like low-rank update).

The scaling with :math:`N` is the same as for the dense factors (the ``bayesian-lora``
package scales its full-rank and low-rank factors differently; we do not).

**References**

- M. Brand, *Incremental singular value decomposition of uncertain data with missing
  values*, ECCV 2002.
- A. X. Yang, M. Robeyns, X. Wang, L. Aitchison, *Bayesian low-rank adaptation for
  large language models*, ICLR 2024.
"""

from __future__ import annotations

import torch

from pyro_bdl.inference.laplace.curvature.kron import Kron, _DenseFactor

__all__ = ["KronLowRank"]


class _LowRankFactor:
    """A Kronecker factor kept as ``U diag(s) U^T`` of rank at most ``rank``."""

    def __init__(self, rank: int):
        self.rank = rank
        self.basis: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def update(self, rows: torch.Tensor) -> None:
        columns = rows.mT
        if self.basis is not None:
            columns = torch.cat([self.basis * self.values.sqrt(), columns], 1)
        basis, singular, _ = torch.linalg.svd(columns, full_matrices=False)
        self.basis = basis[:, : self.rank].contiguous()
        self.values = singular[: self.rank].square()

    def eigen(self, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        return self.basis, self.values * scale

    def numel(self) -> int:
        return 0 if self.basis is None else self.basis.numel() + self.values.numel()

    def accumulators(self) -> list[torch.Tensor]:
        raise NotImplementedError(
            "kron_lowrank keeps its wide factors by incremental SVD, which is not a sum over "
            "examples and so cannot be added up across ranks; fit data-parallel with 'kron'"
        )


class KronLowRank(Kron):
    """K-FAC with every factor wider than ``rank`` kept at rank ``rank``.

    Example::

        guide = LaplaceGuide(model, curvature=KronLowRank(rank=16))
        guide = LaplaceGuide(model, curvature="kron_lowrank")      # rank 16

    :param int rank: the rank ``k`` of the large factors.
    :param str fisher: see :class:`~pyro_bdl.inference.laplace.curvature.kron.Kron`.
    :param int num_samples: labels drawn per example for ``fisher="mc"``.
    """

    name = "kron_lowrank"

    def __init__(self, rank: int = 16, fisher: str = "ggn", num_samples: int = 1):
        super().__init__(fisher, num_samples)
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"rank must be a positive int, got {rank!r}")
        self.rank = rank

    def _factor(self, dim, like):
        return _LowRankFactor(self.rank) if dim > self.rank else _DenseFactor(dim, like)

    def hyperparameters(self):
        return {**super().hyperparameters(), "rank": self.rank}

    def __repr__(self) -> str:
        return f"KronLowRank(rank={self.rank}, fisher={self.fisher!r})"
