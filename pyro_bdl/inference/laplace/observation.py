r"""The likelihood of one minibatch, read from the model's observed site.

Every curvature of :class:`~pyro_bdl.inference.laplace.LaplaceGuide` is a sum over
examples of :math:`J_i^\top V_i V_i^\top J_i`, where :math:`J_i` is the Jacobian of the
likelihood's natural parameter :math:`f(x_i)` with respect to the weights and the few
columns :math:`V_i` depend only on the likelihood :math:`p(y \mid f)`:

* ``"ggn"``: :math:`V_i V_i^\top = H_i = -\nabla_f^2 \log p(y_i \mid f)`, the generalised
  Gauss-Newton matrix, equal to the conditional Fisher for these exponential families
  (posteriors paper, Appendix A.1); one column per output dimension and rank of
  :math:`H` (``C - 1`` for a ``C``-class categorical, whose Hessian annihilates the
  all-ones vector);
* ``"ef"``: :math:`V_i = \nabla_f \log p(y_i \mid f)`, the empirical Fisher, one column;
* ``"mc"``: :math:`V_{i,s} = \nabla_f \log p(\hat y_s \mid f) / \sqrt{S}` with
  :math:`\hat y_s \sim p(y \mid f(x_i))`, the Monte Carlo Fisher, ``S`` columns.

The observed site is the one :func:`pyro_bdl.observe` makes, or any ``pyro.sample(...,
obs=...)`` of the same families: a ``Categorical`` or ``Bernoulli`` with ``logits``, or a
``Normal`` whose scale does not depend on the weights, possibly wrapped in
``Independent`` and masked. Its first batch dimension is the example; further batch
dimensions (tokens) are summed within an example, and masked entries (padding, the
site's ``poutine.mask``) contribute nothing. A scale the model puts on the site
(``poutine.scale``) beyond its plates' :math:`N / B` weights each example's term. A
model without this structure raises :class:`StructureError`.

``torch.distributions.Categorical`` stores its logits normalised (minus their
log-sum-exp). That shift changes neither the GGN (the categorical Hessian annihilates
the shift direction), nor the empirical or Monte Carlo Fisher, so the stored logits are
the natural parameter we differentiate.
"""

from __future__ import annotations

import math

import pyro.distributions as dist
import torch
from pyro.distributions.torch_distribution import MaskedDistribution

__all__ = ["Observation", "FISHERS", "StructureError"]

FISHERS = ("ggn", "ef", "mc")

# Exact GGN columns are one backward pass each; beyond this many per batch (a language
# model's vocabulary times its tokens) the Monte Carlo Fisher is the only practical one.
MAX_GGN_COLUMNS = 1024


class StructureError(ValueError):
    """The model lacks the per-example structure that the GGN and Fisher curvatures need."""


class Observation:
    """The likelihood :math:`p(y \\mid f)` of the observed site of one model run.

    :param dict site: the observed site's Pyro message (``fn``, ``value``, plates).
    :ivar torch.Tensor natural: :math:`f`, shaped ``(B, *positions, K)`` (``K = 1`` for
        Bernoulli and Normal), part of the autograd graph of the model run.
    :ivar int num_examples: the minibatch size ``B``.
    :ivar int num_data: the data-set size ``N`` of the site's plate.
    """

    def __init__(self, site: dict):
        self.name = site["name"]
        base, mask = _unwrap(site["fn"])
        self.value = site["value"]
        if not base.batch_shape:  # one observation outside any plate: one example
            base = base.expand(torch.Size([1]))
            self.value = self.value.unsqueeze(0)
        family = next((f for cls, f in _FAMILIES.items() if isinstance(base, cls)), None)
        if family is None:
            raise StructureError(
                f"LaplaceGuide: the observed site {self.name!r} has a {type(base).__name__} "
                "likelihood; supported are Categorical(logits=...), Bernoulli(logits=...) "
                "and Normal(loc, scale) with a scale that does not depend on the weights"
            )
        self.family = family
        self.base = base
        self.natural = self.family.natural(base, self.name)
        batch_shape = base.batch_shape
        if site["mask"] is not None:  # poutine.mask, or the chunks of a subsample plate
            site_mask = torch.as_tensor(site["mask"], device=self.value.device).bool()
            mask = site_mask if mask is None else mask & site_mask
        self.mask = None if mask is None else mask.expand(batch_shape)
        self.num_examples = batch_shape[0]
        subsampled = [f for f in site["cond_indep_stack"] if f.full_size not in (None, f.size)]
        sizes = [frame.full_size for frame in site["cond_indep_stack"] if frame.full_size]
        self.num_data = sizes[0] if sizes else self.num_examples
        self.scale = _own_scale(site["scale"], subsampled, batch_shape)
        self.is_observed = site["is_observed"]

    def log_likelihood(self) -> torch.Tensor:
        """:math:`\\sum_i \\log p(y_i \\mid f(x_i))` over the batch (masked, weighted by
        the site's own scale, not by its plates' :math:`N / B`)."""
        log_prob = self.base.log_prob(self.value)
        if self.scale is not None:
            log_prob = log_prob * self.scale
        if self.mask is not None:
            log_prob = torch.where(self.mask, log_prob, torch.zeros_like(log_prob))
        return log_prob.sum()

    def columns(self, fisher: str, num_samples: int = 1) -> torch.Tensor:
        """The columns :math:`V` whose outer products make the curvature.

        :param str fisher: ``"ggn"``, ``"ef"`` or ``"mc"``.
        :param int num_samples: labels drawn per example for ``"mc"``.
        :return: ``(m, *natural.shape)``, one cotangent of ``natural`` per column.
        """
        with torch.no_grad():
            f = self.natural.detach()
            if fisher == "ef":
                columns = self.family.score(self.base, f, self.value).unsqueeze(0)
            elif fisher == "mc":
                draws = [
                    self.family.score(self.base, f, self.base.sample()) for _ in range(num_samples)
                ]
                columns = torch.stack(draws) / math.sqrt(num_samples)
            elif fisher == "ggn":
                columns = self._ggn_columns(f)
            else:
                raise ValueError(f"fisher must be one of {FISHERS}, got {fisher!r}")
            if self.mask is not None:
                columns = columns * self.mask.unsqueeze(-1).to(columns.dtype)
            if self.scale is not None:  # each term weighted: its curvature too
                columns = columns * self.scale.sqrt().unsqueeze(-1)
            return columns

    def _ggn_columns(self, f: torch.Tensor) -> torch.Tensor:
        # H_i is block diagonal over positions: column (e, j) is the j-th column of
        # the square root of H at position e, and zero at every other position.
        root = self.family.hessian_root(self.base, f)  # (B, *positions, K, r)
        batch, positions, (outputs, rank) = root.shape[0], root.shape[1:-2], root.shape[-2:]
        num_positions = math.prod(positions)
        if num_positions * rank > MAX_GGN_COLUMNS:
            raise ValueError(
                f"LaplaceGuide: the exact GGN of {self.name!r} needs {num_positions * rank} "
                f"backward passes per batch ({num_positions} positions x {rank}); use the "
                "Monte Carlo Fisher instead, e.g. curvature=Kron(fisher='mc')"
            )
        root = root.reshape(batch, num_positions, outputs, rank)
        eye = torch.eye(num_positions, dtype=f.dtype, device=f.device)
        columns = torch.einsum("ep,bpkj->ejbpk", eye, root)
        return columns.reshape(num_positions * rank, *f.shape)


def _own_scale(scale, subsampled, batch_shape) -> torch.Tensor | None:
    """The site's scale less its subsampled plates' :math:`N / B`: None if it is 1,
    else a tensor broadcast to the batch shape (the ``poutine.scale`` of the model)."""
    own = scale / math.prod(f.full_size / f.size for f in subsampled)
    if not torch.is_tensor(own) and own == 1.0:
        return None
    return torch.as_tensor(own).expand(batch_shape)


def _unwrap(distribution) -> tuple[dist.TorchDistribution, torch.Tensor | None]:
    mask = None
    while True:
        if isinstance(distribution, dist.Independent):
            distribution = distribution.base_dist
        elif isinstance(distribution, MaskedDistribution):
            part = torch.as_tensor(distribution._mask).bool()
            mask = part if mask is None else mask & part
            distribution = distribution.base_dist
        else:
            return distribution, mask


class _Categorical:
    @staticmethod
    def natural(base, name):
        if base._param is not base.__dict__.get("logits"):
            raise StructureError(
                f"LaplaceGuide: build the likelihood of {name!r} as Categorical(logits=...); "
                "the curvature is taken with respect to the logits"
            )
        return base.logits

    @staticmethod
    def score(base, f, y):
        probs = torch.softmax(f, -1)
        # not one_hot, whose range check of the labels is a device sync per batch
        classes = torch.arange(f.shape[-1], device=f.device)
        return (y.long().unsqueeze(-1) == classes).to(f.dtype) - probs

    @staticmethod
    def hessian_root(base, f):
        probs = torch.softmax(f, -1)
        hessian = torch.diag_embed(probs) - probs.unsqueeze(-1) * probs.unsqueeze(-2)
        eigenvalues, eigenvectors = torch.linalg.eigh(hessian)
        # The smallest eigenvalue is 0 (eigenvector 1): C - 1 columns suffice.
        return eigenvectors[..., 1:] * eigenvalues[..., 1:].clamp(min=0).sqrt().unsqueeze(-2)


class _Bernoulli:
    @staticmethod
    def natural(base, name):
        if base._param is not base.__dict__.get("logits"):
            raise StructureError(
                f"LaplaceGuide: build the likelihood of {name!r} as Bernoulli(logits=...); "
                "the curvature is taken with respect to the logits"
            )
        return base.logits.unsqueeze(-1)

    @staticmethod
    def score(base, f, y):
        return y.unsqueeze(-1).to(f.dtype) - torch.sigmoid(f)

    @staticmethod
    def hessian_root(base, f):
        probs = torch.sigmoid(f)
        return (probs * (1 - probs)).sqrt().unsqueeze(-1)


class _Normal:
    @staticmethod
    def natural(base, name):
        if base.scale.requires_grad:
            raise StructureError(
                f"LaplaceGuide: the Normal likelihood of {name!r} has a scale that depends on "
                "the weights; the GGN needs a fixed observation noise (pass a constant scale)"
            )
        return base.loc.unsqueeze(-1)

    @staticmethod
    def score(base, f, y):
        return (y.unsqueeze(-1) - f) / base.scale.unsqueeze(-1).square()

    @staticmethod
    def hessian_root(base, f):
        return (1 / base.scale).expand(f.shape[:-1]).reshape(*f.shape, 1)


_FAMILIES = {
    torch.distributions.Categorical: _Categorical,
    torch.distributions.Bernoulli: _Bernoulli,
    torch.distributions.Normal: _Normal,
}
