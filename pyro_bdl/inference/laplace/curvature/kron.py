r"""K-FAC: a Kronecker-factored curvature per linear layer.

For a weight :math:`W \in \mathbb{R}^{d_\text{out} \times d_\text{in}}` used by
``linear`` calls with inputs :math:`a` and output gradients :math:`b` (one per column of
the likelihood's Hessian root, Laplace-LoRA eq. 9),

.. math::

    H_W \approx A \otimes B, \qquad
    A = \frac{1}{n_\text{rows}} \sum_{i,t} a_{i,t} a_{i,t}^\top, \qquad
    B = \frac{N}{n_\text{seen}} \sum_{c,i,t} b_{c,i,t} b_{c,i,t}^\top,

with :math:`(A \otimes B)\operatorname{vec}(W) = \operatorname{vec}(B W A)`. Positions
:math:`t` that share the weight (tokens of a sequence, time steps, repeated calls) are
treated as extra examples: the "expand" convention of Eschenhagen et al. (2023), which
is exact for a linear layer whose positions reach the loss independently, and which
curvlinops and laplace-torch use. Positions are all positions the layer saw, padding
included; :math:`n_\text{rows}` counts them. LoRA's A and B are separate layers, as in
Laplace-LoRA. A convolution is a linear map of its unfolded input patches, so
its kernel gets the same factors (KFC, Grosse and Martens 2016, in the expand convention
curvlinops uses for convolutions). Sites that are not such weights (biases, norms,
embeddings, plain sample sites) get a diagonal block (:class:`~.diagonal.DiagonalBlock`).

Layers that read the same input (LoRA's query and value A) share one input factor. A
factor whose side exceeds ``max_dense`` (1024 by default: a Llama's 2048- to 8192-wide
hidden states, the lm_head's vocabulary-sized output factor) is never formed densely: it
is kept as a streaming sketch of rank ``rank`` (see :mod:`.factors`), as Laplace-LoRA
keeps the large factor of each LoRA layer low rank at 7B. Dense, the 4096-wide factors of
a Llama-2-7B's q and v adapters take 6.4 GB, more than a third of LoRA training's peak,
and the fit could not stay within 1.3 times it; directions a sketch leaves out keep the
prior's precision, so their variance errs on the wide side. Factors up to 1024 wide
(BERT, RoBERTa-large, MiniLM) are exact.

A fit only accumulates; the eigendecompositions are computed when the
evidence (eigenvalues only) or sampling and prediction (eigenvectors too) first ask, in
batches of equal-sized factors, and cached.

With eigendecompositions :math:`A = Q_A \Lambda_A Q_A^\top` and
:math:`B = Q_B \Lambda_B Q_B^\top` (possibly truncated to :math:`k_A, k_B` columns, see
:mod:`.kron_lowrank`) and a scalar prior precision :math:`\delta`, the posterior
precision :math:`P = A \otimes B + \delta I` has eigenvalues
:math:`\lambda_{B,o} \lambda_{A,i} + \delta` on :math:`Q_A \otimes Q_B` and
:math:`\delta` on its orthogonal complement, so for :math:`\tilde X = Q_B^\top X Q_A`

.. math::

    P^{p} X = Q_B \big[\tilde X \circ ((\lambda_B \lambda_A^\top + \delta)^{p}
              - \delta^{p})\big] Q_A^\top + \delta^{p} X,

which gives sampling (:math:`p = -1/2`, Woodbury-like for truncated factors), the
predictive covariance (:math:`p = -1`) and
:math:`\log\det P = \sum \log(\lambda_B \lambda_A^\top + \delta) +
(d_\text{in} d_\text{out} - k_A k_B) \log \delta` without ever forming a
:math:`d \times d` matrix.

**References**

- J. Martens, R. Grosse, *Optimizing neural networks with Kronecker-factored approximate
  curvature*, ICML 2015.
- H. Ritter, A. Botev, D. Barber, *A scalable Laplace approximation for neural
  networks*, ICLR 2018.
- R. Eschenhagen et al., *Kronecker-factored approximate curvature for modern neural
  network architectures*, NeurIPS 2023.
"""

from __future__ import annotations

import math

import torch

from pyro_bdl import distributed
from pyro_bdl._checks import integer
from pyro_bdl.inference.laplace.curvature.base import Curvature, Delta, GaussianBlock
from pyro_bdl.inference.laplace.curvature.diagonal import DiagonalBlock
from pyro_bdl.inference.laplace.curvature.factors import (
    DenseFactor,
    Eigen,
    Eigensolver,
    SketchFactor,
)
from pyro_bdl.inference.laplace.jacobians import LinearGradient

__all__ = ["Kron", "KronBlock"]


class KronBlock(GaussianBlock):
    """Posterior precision :math:`A \\otimes B + \\delta I` of one linear weight.

    :param str site: the weight's site, shaped ``(d_out, d_in)``.
    :param input_factor: :math:`(Q_A, \\lambda_A)`, ``(d_in, k_A)`` and ``(k_A,)``, or an
        :class:`~.factors.Eigen` computed when first needed.
    :param output_factor: :math:`(Q_B, \\lambda_B)`, ``(d_out, k_B)`` and ``(k_B,)``, or an
        :class:`~.factors.Eigen`.
    :param shape: the site's shape if it is not ``(d_out, d_in)``: a convolution kernel
        ``(d_out, C_in, *kernel)`` with ``d_in = C_in * prod(kernel)``.
    """

    def __init__(self, site: str, input_factor, output_factor, shape=None):
        self.sites = (site,)
        self.site = site
        self.input_factor = _eigen(input_factor)
        self.output_factor = _eigen(output_factor)
        self.matrix_shape = (self.output_factor.dim, self.input_factor.dim)
        self.shape = torch.Size(shape or self.matrix_shape)
        self.shapes = {site: self.shape}
        self.complement = math.prod(self.shape) - self.input_factor.rank * self.output_factor.rank

    @property
    def input_vectors(self) -> torch.Tensor:
        return self.input_factor.vectors

    @property
    def input_values(self) -> torch.Tensor:
        return self.input_factor.values

    @property
    def output_vectors(self) -> torch.Tensor:
        return self.output_factor.vectors

    @property
    def output_values(self) -> torch.Tensor:
        return self.output_factor.values

    @property
    def eigenvalues(self) -> torch.Tensor:
        """:math:`\\lambda_B \\lambda_A^\\top`, ``(k_B, k_A)``."""
        return self.output_values[:, None] * self.input_values[None, :]

    def _delta(self, delta: Delta) -> torch.Tensor:
        value = delta[self.site]
        if value.numel() != 1:
            raise ValueError(
                f"K-FAC needs one prior precision per layer; {self.site!r} has "
                f"{value.numel()} different ones (a prior whose scale varies within the "
                "tensor); pass prior_precision=<float> to LaplaceGuide"
            )
        return value.reshape(())

    def _matrix(self, x: torch.Tensor) -> torch.Tensor:
        """``(..., *shape)`` as ``(..., d_out, d_in)``."""
        return x.reshape(*x.shape[: x.dim() - len(self.shape)], *self.matrix_shape)

    def _project(self, x: torch.Tensor) -> torch.Tensor:
        return self.output_vectors.mT @ self._matrix(x) @ self.input_vectors

    def _power(self, x: torch.Tensor, delta: torch.Tensor, power: float) -> torch.Tensor:
        weights = (self.eigenvalues + delta) ** power
        if self.complement:
            weights = weights - delta**power
        result = self.output_vectors @ (self._project(x) * weights) @ self.input_vectors.mT
        if self.complement:
            result = result + delta**power * self._matrix(x)
        return result.reshape(x.shape)

    def check_prior(self, delta):
        self._delta(delta)

    def log_det(self, delta):
        delta = self._delta(delta)
        return (self.eigenvalues + delta).log().sum() + self.complement * delta.log()

    def sample(self, noise, delta):
        return {self.site: self._power(noise[self.site], self._delta(delta), -0.5)}

    def quadratic(self, x, delta):
        x = x[self.site]
        inside = (self._project(x).square() * self.eigenvalues).flatten(1).sum(1)
        return inside + self._delta(delta) * x.square().flatten(1).sum(1)

    def output_covariance(self, grads, delta):
        delta = self._delta(delta)
        grad = grads[self.site]
        weights = (self.eigenvalues + delta).reciprocal()
        if self.complement:
            weights = weights - delta.reciprocal()
        factored = isinstance(grad, LinearGradient) and grad.inputs is not None
        if factored and grad.inputs.shape[1] == 1:
            # one position: project a and b, never form the d_out x d_in Jacobian rows
            a, b = grad.inputs[:, 0], grad.output_grads[:, :, 0]  # (B, d_in), (m, B, d_out)
            a_projected = a @ self.input_vectors
            b_projected = b @ self.output_vectors
            # sum_pq w_pq (b_c Q_B)_p (b_d Q_B)_p (a Q_A)_q^2
            inside = _gram(b_projected * (a_projected.square() @ weights.mT), b_projected)
            if not self.complement:
                return inside
            return inside + _gram(b * a.square().sum(-1, keepdim=True), b) / delta
        if factored and _project_first(grad, self.input_factor.rank, self.output_factor.rank):
            # project a and b before summing over positions: (b Q_B)^T (a Q_A) per example
            a_projected = grad.inputs @ self.input_vectors  # (B, T, k_A)
            b_projected = grad.output_grads @ self.output_vectors  # (m, B, T, k_B)
            projected = b_projected.mT @ a_projected  # (m, B, k_B, k_A)
            rows = grad.output_grads.mT @ grad.inputs if self.complement else None
        elif factored:  # each example's Jacobian row b^T a first, then its projection
            rows = grad.output_grads.mT @ grad.inputs  # (m, B, d_out, d_in)
            projected = self.output_vectors.mT @ rows @ self.input_vectors
        else:
            rows = self._matrix(grad.per_example())
            projected = self.output_vectors.mT @ rows @ self.input_vectors
        inside = _gram(projected * weights, projected)
        if not self.complement:
            return inside
        return inside + _gram(rows, rows) / delta

    def variance(self, delta):
        delta = self._delta(delta)
        weights = (self.eigenvalues + delta).reciprocal()
        if self.complement:
            weights = weights - delta.reciprocal()
        inside = self.output_vectors.square() @ weights @ self.input_vectors.square().mT
        inside = inside + delta.reciprocal() if self.complement else inside
        return {self.site: inside.reshape(self.shape)}

    def restrict(self, site):
        return self

    def tensors(self):
        return {
            f"{self.site}.kron_input_eigenvalues": self.input_values,
            f"{self.site}.kron_input_eigenvectors": self.input_vectors,
            f"{self.site}.kron_output_eigenvalues": self.output_values,
            f"{self.site}.kron_output_eigenvectors": self.output_vectors,
        }


def _project_first(grad: LinearGradient, k_in: int, k_out: int) -> bool:
    """Whether projecting a and b (before summing positions) costs less than rows first.

    Projecting first costs :math:`B T (d_\\text{in} k_A + m d_\\text{out} k_B + m k_B k_A)`;
    forming each example's ``d_out x d_in`` row first costs :math:`m B d_\\text{out}
    d_\\text{in} (T + k_B) + m B k_B d_\\text{in} k_A`. LoRA layers (a narrow side, many
    tokens) take the second, a wide layer on a few positions the first.
    """
    columns, batch, positions, d_out = grad.output_grads.shape
    d_in = grad.inputs.shape[-1]
    first = batch * positions * (d_in * k_in + columns * (d_out * k_out + k_out * k_in))
    rows = columns * batch * (d_out * d_in * (positions + k_out) + k_out * d_in * k_in)
    return first < rows


def _gram(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """:math:`\\sum_p x_{c,b,p}\\, y_{d,b,p}`, ``(B, m, m)``, for ``x``, ``y`` ``(m, B, ...)``."""
    return x.flatten(2).transpose(0, 1) @ y.flatten(2).permute(1, 2, 0)


def _eigen(factor) -> Eigen:
    return factor if isinstance(factor, Eigen) else Eigen(vectors=factor[0], values=factor[1])


class Kron(Curvature):
    """K-FAC per linear weight, a diagonal for every other site.

    Example::

        guide = LaplaceGuide(model, curvature="kron")
        guide = LaplaceGuide(model, curvature=Kron(fisher="mc"))   # for a language model

    :param str fisher: which curvature the factors approximate (``"ggn"``: the type-2
        K-FAC of Laplace-LoRA's GGN; ``"mc"``, ``"ef"``).
    :param int num_samples: labels drawn per example for ``fisher="mc"``.
    :param int max_dense: the widest factor kept as a dense ``d x d`` matrix; wider ones
        (a Llama's hidden states, an lm_head's vocabulary) are sketched at rank ``rank``.
        Raise it for exact factors of a wider model where memory allows.
    :param int rank: the rank of the factors wider than ``max_dense``.
    """

    name = "kron"

    def __init__(
        self,
        fisher: str = "ggn",
        num_samples: int = 1,
        *,
        max_dense: int = 1024,
        rank: int = 64,
    ):
        super().__init__(fisher, num_samples)
        self.max_dense = integer("max_dense", max_dense, low=1)
        self.rank = integer("rank", rank, low=1)

    def begin(self, values):
        super().begin(values)
        self.inputs: dict[str, DenseFactor | SketchFactor] = {}
        self.outputs: dict[str, DenseFactor | SketchFactor] = {}
        self.rows: dict[str, int] = {}
        self.diagonals: dict[str, torch.Tensor] = {}
        self._numbers: dict[str, int] = {}

    def _factor(self, dim: int, like: torch.Tensor) -> DenseFactor | SketchFactor:
        if dim <= self.max_dense:
            return DenseFactor(dim, like)
        return SketchFactor(dim, like, self.rank, seed=len(self.inputs) + len(self.outputs))

    def update(self, grads):
        inputs = {}
        for site, grad in grads.items():
            factored = isinstance(grad, LinearGradient) and grad.inputs is not None
            if factored != (site in self.outputs) and site in self.rows:
                raise RuntimeError(f"site {site!r} changed from factored to dense between batches")
            if not factored:
                self.diagonals[site] = self.diagonals.get(site, 0) + grad.sum_of_squares()
                self.rows[site] = 0
                continue
            d_in, d_out = grad.inputs.shape[-1], grad.output_grads.shape[-1]
            if site not in self.outputs:
                self.outputs[site] = self._factor(d_out, self.values[site])
                self.rows[site] = 0
            self.outputs[site].update(grad.output_grads.reshape(-1, d_out))
            inputs[site] = grad.inputs.reshape(-1, d_in)
            self.rows[site] += inputs[site].shape[0]
        self._update_inputs(inputs)

    def _update_inputs(self, inputs: dict[str, torch.Tensor]) -> None:
        """Add each batch's input Gram once per distinct input, shared by its readers.

        Layers reading the same tensor (LoRA's query and value A) keep one factor; one
        whose input stops being shared gets its own copy of the sum so far.
        """
        groups: dict[tuple, list[str]] = {}
        for site, a in inputs.items():
            groups.setdefault((a.data_ptr(), a.shape, a.stride(), a.dtype), []).append(site)
        readers: dict[int, list[str]] = {}
        for site, factor in self.inputs.items():
            readers.setdefault(id(factor), []).append(site)
        for sites in groups.values():
            a = inputs[sites[0]]
            new = [site for site in sites if site not in self.inputs]
            if new:
                factor = self._factor(a.shape[1], self.values[new[0]])
                self.inputs.update(dict.fromkeys(new, factor))
                readers[id(factor)] = new
            updated = set()
            for site in sites:
                factor = self.inputs[site]
                if id(factor) in updated:
                    continue
                sharing = readers[id(factor)]
                if not set(sharing) <= set(sites):  # some readers read another input now
                    factor = factor.copy()
                    moved = [other for other in sharing if other in sites]
                    self.inputs.update(dict.fromkeys(moved, factor))
                    readers[id(factor)] = moved
                factor.update(a)
                updated.add(id(factor))

    def blocks(self, scale):
        # Shared input factors are decomposed once; every dense factor waits for the first
        # question that needs its eigendecomposition, then all go in batches.
        solver, eigens, blocks = Eigensolver(), {}, []
        self._numbers = self.memory()

        def eigen(factor, factor_scale):
            if id(factor) not in eigens:
                eigens[id(factor)] = factor.eigen(solver, factor_scale)
            return eigens[id(factor)]

        for site in self.values:
            if site in self.outputs:
                input_factor = eigen(self.inputs[site], 1 / max(self.rows[site], 1))
                output_factor = eigen(self.outputs[site], scale)
                shape = self.values[site].shape
                blocks.append(KronBlock(site, input_factor, output_factor, shape))
            else:
                blocks.append(DiagonalBlock(site, self.diagonals[site] * scale))
        # The blocks own the sums now (released once eigendecomposed).
        self.inputs, self.outputs = {}, {}
        return blocks

    def accumulators(self):
        # each factor once: layers sharing an input share its sum
        factors = {id(f): f for f in (*self.inputs.values(), *self.outputs.values())}
        return [f.accumulator for f in factors.values()] + [
            total for total in self.diagonals.values() if torch.is_tensor(total)
        ]

    def synchronise(self):
        if not distributed.is_distributed():
            return
        # the positions each layer saw are a count over examples too
        sites = list(self.rows)
        rows = torch.tensor([float(self.rows[site]) for site in sites], dtype=torch.float64)
        distributed.all_reduce_([*self.accumulators(), rows])
        self.rows = {site: round(count) for site, count in zip(sites, rows.tolist())}

    def memory(self) -> dict[str, int]:
        """Numbers held per factored site during accumulation (inputs + outputs factor)."""
        if not self.outputs:
            return dict(self._numbers)
        return {site: self.inputs[site].numel() + b.numel() for site, b in self.outputs.items()}

    def hyperparameters(self):
        return {**super().hyperparameters(), "max_dense": self.max_dense, "rank": self.rank}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(fisher={self.fisher!r}, max_dense={self.max_dense})"
