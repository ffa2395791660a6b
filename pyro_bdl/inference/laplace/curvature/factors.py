r"""Kronecker factors: accumulated over batches, eigendecomposed only when asked.

A K-FAC factor :math:`F = \sum_n x_n x_n^\top` (inputs or output gradients of a layer) is
kept in one of two forms:

* :class:`DenseFactor`, the ``d x d`` sum, for sides up to a threshold;
* :class:`SketchFactor`, a streaming Nyström sketch :math:`Y = F \Omega` with a fixed
  ``d x s`` test matrix :math:`\Omega` (orthonormal columns), updated per batch by
  :math:`Y \mathrel{+}= X^\top (X \Omega)` at :math:`2 n d s` operations (a dense factor
  update costs :math:`n d^2`), for wider sides. The ``d x d`` matrix is never formed. After
  the pass, one eigendecomposition of an ``s x s`` matrix and one thin SVD of a ``d x s``
  matrix give the rank-``k`` approximation :math:`\hat F = U \Lambda U^\top` (Tropp et al.
  2017, Algorithm 3, with the shift :math:`\nu` for stability). It is exact when
  :math:`\operatorname{rank} F \le k`, and otherwise
  :math:`\mathbb{E}\|F - \hat F\|_* \le (1 + \frac{k}{s - k - 1}) \|F - [\![F]\!]_k\|_*`,
  :math:`[\![F]\!]_k` the best rank-``k`` approximation (their Theorem 4.1, for the
  Gaussian test matrix; ``s = 2k + 8`` here makes the factor at most 2).

The eigendecompositions are what a fit must not pay for up front: the evidence and prior
tuning need only eigenvalues, sampling and prediction need eigenvectors too, and a fit
needs neither. :class:`Eigensolver` collects the dense factors of a fit and decomposes
them when first asked, all at once, in batches of equal-sized factors
(``torch.linalg.eigvalsh`` when only eigenvalues are asked for, ``torch.linalg.eigh``
otherwise), and caches the result; a factor's sum is released once its eigenvectors are
known.

**References**

- J. A. Tropp, A. Yurtsever, M. Udell, V. Cevher, *Fixed-rank approximation of a
  positive-semidefinite matrix from streaming data*, NeurIPS 2017.
"""

from __future__ import annotations

import math

import torch

__all__ = ["DenseFactor", "SketchFactor", "Eigen", "Eigensolver"]

# The largest stack of factors decomposed in one call (bytes of the stacked copy).
_MAX_STACK_BYTES = 2**28


class DenseFactor:
    """A Kronecker factor accumulated as its full ``d x d`` sum.

    :param int dim: the side ``d``.
    :param torch.Tensor like: dtype and device.
    :param int rank: keep only the top ``rank`` eigenpairs (None: all ``d``).
    """

    def __init__(self, dim: int, like: torch.Tensor, rank: int | None = None):
        self.sum = like.new_zeros(dim, dim)
        self.rank = dim if rank is None else min(rank, dim)

    def update(self, rows: torch.Tensor) -> None:
        """Add :math:`X^\\top X` for rows ``X`` shaped ``(n, d)``."""
        rows = rows.to(self.sum.dtype)
        self.sum.addmm_(rows.mT, rows)

    @property
    def accumulator(self) -> torch.Tensor:
        """The running sum over examples (what data-parallel ranks add up)."""
        return self.sum

    def copy(self) -> DenseFactor:
        twin = DenseFactor.__new__(DenseFactor)
        twin.sum, twin.rank = self.sum.clone(), self.rank
        return twin

    def numel(self) -> int:
        return self.sum.numel()

    def eigen(self, solver: Eigensolver, scale: float) -> Eigen:
        """The factor times ``scale``, to be decomposed by ``solver`` when asked."""
        return solver.add(self.sum, scale, self.rank)


class SketchFactor:
    """A Kronecker factor kept as a streaming Nyström sketch, of rank ``rank`` at the end.

    :param int dim: the side ``d``.
    :param torch.Tensor like: dtype and device.
    :param int rank: the rank ``k`` of the approximation.
    :param int seed: seed of the test matrix (fixed, so a fit is reproducible).
    """

    def __init__(self, dim: int, like: torch.Tensor, rank: int, seed: int = 0):
        self.rank = rank
        size = min(dim, 2 * rank + 8)
        generator = torch.Generator(device=like.device).manual_seed(seed)
        gaussian = torch.randn(dim, size, generator=generator, dtype=like.dtype, device=like.device)
        self.test = torch.linalg.qr(gaussian).Q
        self.sketch = torch.zeros_like(self.test)

    def update(self, rows: torch.Tensor) -> None:
        """Add :math:`X^\\top X \\Omega` for rows ``X`` shaped ``(n, d)``."""
        rows = rows.to(self.sketch.dtype)
        self.sketch.addmm_(rows.mT, rows @ self.test)

    @property
    def accumulator(self) -> torch.Tensor:
        """:math:`Y`, a sum over examples: ranks with the same test matrix add it up."""
        return self.sketch

    def copy(self) -> SketchFactor:
        twin = SketchFactor.__new__(SketchFactor)
        twin.rank, twin.test, twin.sketch = self.rank, self.test, self.sketch.clone()
        return twin

    def numel(self) -> int:
        return self.test.numel() + self.sketch.numel()

    def eigen(self, solver: Eigensolver, scale: float) -> Eigen:
        """The rank-``k`` approximation times ``scale``, computed when first asked."""
        sketch, test, rank = self.sketch, self.test, self.rank
        return solver.add_lazy(lambda: nystrom(sketch, test, rank), sketch.shape[0], rank, scale)


def nystrom(sketch: torch.Tensor, test: torch.Tensor, rank: int) -> tuple:
    """Rank-``rank`` eigenpairs of the PSD :math:`F` from :math:`Y = F \\Omega` (Tropp et al.).

    :return: eigenvectors ``(d, rank)`` and eigenvalues ``(rank,)``, largest first.
    """
    dim = sketch.shape[0]
    norm = torch.linalg.matrix_norm(sketch)
    shift = math.sqrt(dim) * torch.finfo(sketch.dtype).eps * norm
    shifted = sketch + shift * test
    core = test.mT @ shifted
    values, vectors = torch.linalg.eigh((core + core.mT) / 2)
    # E = Y_nu core^{-1/2}: E E^T = Y_nu core^+ Y_nu^T, the shifted Nystrom approximation;
    # directions the sketch did not see (eigenvalue ~ 0) are dropped, not inverted.
    keep = values > values.amax() * sketch.shape[1] * torch.finfo(sketch.dtype).eps
    inverse_root = torch.where(keep, values.clamp(min=torch.finfo(values.dtype).tiny).rsqrt(), 0)
    root = shifted @ (vectors * inverse_root)
    basis, singular, _ = torch.linalg.svd(root, full_matrices=False)
    rank = min(rank, basis.shape[1])
    return basis[:, :rank], (singular[:rank].square() - shift).clamp(min=0)


class Eigen:
    """The eigendecomposition :math:`Q \\operatorname{diag}(\\lambda) Q^\\top` of one factor.

    Given directly (``vectors`` and ``values``) or computed by an :class:`Eigensolver` when
    :attr:`values` or :attr:`vectors` is first read.

    :ivar int dim: the side ``d``.
    :ivar int rank: the number of eigenpairs kept, ``k <= d``.
    """

    def __init__(
        self, vectors=None, values=None, solver=None, matrix=None, scale=1.0, rank=None, dim=None
    ):
        self._vectors, self._values = vectors, values
        self._solver, self.matrix, self.scale = solver, matrix, scale
        self.compute = None  # a function giving (vectors, values), for a sketched factor
        source = vectors if vectors is not None else matrix
        self.dim = source.shape[0] if source is not None else dim
        self.rank = vectors.shape[1] if vectors is not None else (rank or self.dim)

    @property
    def values(self) -> torch.Tensor:
        """:math:`\\lambda`, ``(k,)``, ascending for dense factors."""
        if self._values is None:
            self._solver.solve(vectors=False)
        return self._values

    @property
    def vectors(self) -> torch.Tensor:
        """:math:`Q`, ``(d, k)``."""
        if self._vectors is None:
            self._solver.solve(vectors=True)
        return self._vectors

    def _set(self, values: torch.Tensor, vectors: torch.Tensor | None) -> None:
        values = (values * self.scale).clamp(min=0)
        if vectors is not None:
            # the top k (ascending order); a copy when truncated, so the rest can be freed
            top = vectors[:, -self.rank :]
            self._vectors = top if self.rank == self.dim else top.contiguous()
            self.matrix = None  # the sum is no longer needed
        self._values = values[-self.rank :]


class Eigensolver:
    """Deferred eigendecompositions of a fit's dense factors, batched by size."""

    def __init__(self):
        self._pending: list[Eigen] = []

    def add(self, matrix: torch.Tensor, scale: float, rank: int) -> Eigen:
        """A dense factor ``matrix`` (times ``scale``), its top ``rank`` pairs kept."""
        eigen = Eigen(solver=self, matrix=matrix, scale=scale, rank=rank)
        self._pending.append(eigen)
        return eigen

    def add_lazy(self, compute, dim: int, rank: int, scale: float) -> Eigen:
        """A factor whose ``(vectors, values)`` come from ``compute()`` (times ``scale``)."""
        eigen = Eigen(solver=self, scale=scale, rank=rank, dim=dim)
        eigen.compute = compute
        self._pending.append(eigen)
        return eigen

    def solve(self, vectors: bool) -> None:
        """Decompose every pending factor (eigenvalues only unless ``vectors``)."""
        for eigen in self._pending:
            if eigen.compute is not None:  # a sketch: one small SVD gives both
                computed, values = eigen.compute()  # largest first: reversed to ascending
                eigen._set(values.flip(0), computed.flip(1))
                eigen.compute = None
        todo = [
            e
            for e in self._pending
            if e.matrix is not None and (e._vectors if vectors else e._values) is None
        ]
        groups: dict[tuple, list[Eigen]] = {}
        for eigen in todo:
            matrix = eigen.matrix
            groups.setdefault((matrix.shape, matrix.dtype, matrix.device), []).append(eigen)
        for (shape, dtype, _), members in groups.items():
            per_stack = max(1, _MAX_STACK_BYTES // (shape.numel() * dtype.itemsize))
            for start in range(0, len(members), per_stack):
                chunk = members[start : start + per_stack]
                stacked = torch.stack([eigen.matrix for eigen in chunk])
                if vectors:
                    values, vectors_ = torch.linalg.eigh(stacked)
                    del stacked
                    for k, eigen in enumerate(chunk):
                        eigen._set(values[k], vectors_[k])
                else:
                    values = torch.linalg.eigvalsh(stacked)
                    for k, eigen in enumerate(chunk):
                        eigen._set(values[k], None)
        if vectors:
            self._pending = [e for e in self._pending if e._vectors is None]
