r"""K-FAC whose factors wider than ``k`` are kept at rank ``k`` by a streaming sketch.

A LoRA layer is wide on one side and narrow on the other (``d x r``), so one of its
two K-FAC factors is ``d x d`` (Laplace-LoRA blog, "Kronecker-Factored Approximate
Curvature", point 3). Every factor wider than ``k`` is kept as
:math:`F \approx U \operatorname{diag}(\lambda) U^\top` with
:math:`U \in \mathbb{R}^{d \times k}`, from a Nyström sketch :math:`Y = F \Omega` with
``s = 2k + 8`` columns that each batch with rows :math:`X` (inputs or output gradients)
updates by :math:`Y \mathrel{+}= X^\top (X \Omega)`, and one thin SVD at the end (see
:mod:`.factors`: exact when the factor has rank at most ``k``, within
:math:`1 + k / (s - k - 1) \le 2` times the best rank-``k`` error in trace norm in
expectation otherwise). The ``d x d`` factor is never formed: the state is
:math:`O(k\, d)` per factor. Narrow factors stay exact. At ``k >= d`` this equals
:mod:`.kron` exactly; below, the precision's eigenvalues outside the kept subspace are
the prior's :math:`\delta` (see :class:`~.kron.KronBlock`: sampling is then a
Woodbury-like low-rank update).

The scaling with :math:`N` is the same as for the dense factors (the ``bayesian-lora``
package scales its full-rank and low-rank factors differently; we do not).

**References**

- J. A. Tropp, A. Yurtsever, M. Udell, V. Cevher, *Fixed-rank approximation of a
  positive-semidefinite matrix from streaming data*, NeurIPS 2017.
- A. X. Yang, M. Robeyns, X. Wang, L. Aitchison, *Bayesian low-rank adaptation for
  large language models*, ICLR 2024.
"""

from __future__ import annotations

from pyro_bdl._checks import integer
from pyro_bdl.inference.laplace.curvature.kron import Kron

__all__ = ["KronLowRank"]


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
        rank = integer("rank", rank, low=1)
        super().__init__(fisher, num_samples, max_dense=rank, rank=rank)

    def hyperparameters(self):
        hyperparameters = super().hyperparameters()
        del hyperparameters["max_dense"]
        return hyperparameters

    def __repr__(self) -> str:
        return f"KronLowRank(rank={self.rank}, fisher={self.fisher!r})"
