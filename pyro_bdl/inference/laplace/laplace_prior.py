r"""A fitted Laplace posterior as the prior of the next fit.

In episodal continual learning the posterior after episode :math:`n-1` is the prior of
episode :math:`n`, :math:`p(\theta \mid y_{1:n}) \propto p(\theta \mid y_{1:n-1})\,
p(y_n \mid \theta)` (posteriors paper, eq. 1 and section 5.2: the single quadratic
penalty of Huszár's amendment to EWC). :class:`LaplacePrior` implements the prior
protocol of :mod:`pyro_bdl.priors`: each lifted tensor gets the Gaussian
:math:`\mathcal{N}(\theta_\text{MAP}, T P^{-1})` of its block of the posterior precision.
A diagonal structure gives an independent ``Normal``, so the next episode's
:class:`~pyro_bdl.inference.laplace.LaplaceGuide` can use it in turn; K-FAC and dense
blocks give a :class:`BlockNormal`. A ``"full"`` posterior over several tensors keeps
each tensor's block of the precision (the per-tensor protocol cannot express the
cross-tensor terms).

Example::

    guide = LaplaceGuide(model, curvature="diag_ef").fit(loader_1, n_1)
    net.prior = guide.as_prior()          # episode 2 is penalised towards episode 1
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pyro.distributions as dist
import torch
from pyro.distributions import constraints

from pyro_bdl._checks import site_keys
from pyro_bdl.inference.laplace.curvature.base import GaussianBlock
from pyro_bdl.inference.laplace.curvature.diagonal import DiagonalBlock

__all__ = ["LaplacePrior", "BlockNormal"]


class BlockNormal(dist.TorchDistribution):
    """:math:`\\mathcal{N}(\\mu, T P^{-1})` over one tensor, with :math:`P` a curvature block.

    :param torch.Tensor loc: :math:`\\mu`; the event shape.
    :param GaussianBlock block: a block over this one site.
    :param dict delta: the prior precision the block's :math:`P` adds.
    :param float temperature: :math:`T`.
    """

    arg_constraints = {}
    has_rsample = True

    def __init__(self, loc, block: GaussianBlock, delta, temperature: float = 1.0):
        self.loc = loc
        self.block = block
        self.site = block.sites[0]
        # The block computes where it was fitted; the weights may have moved since.
        self._device = next(iter(block.tensors().values())).device
        self.delta = {site: value.to(self._device) for site, value in delta.items()}
        self.temperature = temperature
        log_det = block.log_det(self.delta).to(loc.device)
        self._log_normaliser = 0.5 * (log_det - loc.numel() * math.log(2 * math.pi * temperature))
        super().__init__(batch_shape=torch.Size(), event_shape=loc.shape, validate_args=False)

    @constraints.dependent_property
    def support(self):
        return constraints.independent(constraints.real, self.loc.dim())

    @property
    def mean(self):
        return self.loc

    @property
    def variance(self):
        return self.block.variance(self.delta)[self.site].to(self.loc) * self.temperature

    def rsample(self, sample_shape=()):
        sample_shape = torch.Size(sample_shape)
        noise = torch.randn(
            sample_shape.numel(), *self.loc.shape, dtype=self.loc.dtype, device=self._device
        )
        draws = self.block.sample({self.site: noise}, self.delta)[self.site].to(self.loc.device)
        return self.loc + math.sqrt(self.temperature) * draws.reshape(sample_shape + self.loc.shape)

    def log_prob(self, value):
        batch = value.shape[: value.dim() - self.loc.dim()]
        x = (value - self.loc).reshape(-1, *self.loc.shape).to(self._device)
        quadratic = self.block.quadratic({self.site: x}, self.delta).to(value.device)
        quadratic = quadratic / self.temperature
        return (self._log_normaliser - 0.5 * quadratic).reshape(batch)

    def expand(self, batch_shape, _instance=None):
        if torch.Size(batch_shape) != torch.Size():
            raise NotImplementedError("BlockNormal is the prior of one weight tensor")
        return self


class LaplacePrior:
    """The prior protocol (``distribution(name, param)``) over a fitted Laplace posterior.

    Made by :meth:`LaplaceGuide.as_prior`.

    :param dict loc: site -> :math:`\\theta_\\text{MAP}`.
    :param dict blocks: site -> the block of the posterior precision of that site.
    :param dict delta: site -> the prior precision inside those blocks.
    :param float temperature: :math:`T`, the covariance is :math:`T P^{-1}`.
    :param str prefix: the ``prefix`` given to :func:`pyro_bdl.lift` (site names are
        ``prefix + parameter name``).
    """

    def __init__(self, loc, blocks, delta, temperature: float = 1.0, prefix: str = ""):
        self.loc = loc
        self.blocks = blocks
        self.delta = delta
        self.temperature = temperature
        self.prefix = prefix

    def check_names(self, names: Sequence[str]) -> None:
        """Refuse a lift whose random weights, with this prior's ``prefix``, are not the
        posterior's sites (:func:`~pyro_bdl.lift` calls it): part of the posterior would
        be silently unused, or a weight would have no prior."""
        sites = [self.prefix + name for name in names]
        what = "the sites of the lifted random weights under this prefix"
        site_keys(f"as_prior(prefix={self.prefix!r})", self.loc, sites, what)
        missing = [site for site in sites if site not in self.loc]
        if missing:
            raise ValueError(
                f"as_prior(prefix={self.prefix!r}): the posterior has no value for the lifted "
                f"sites {missing[:5]}; it covers {list(self.loc)[:5]}: lift the same tensors, "
                "with the same prefix, as when the posterior was fitted"
            )

    def distribution(self, name: str, param: torch.Tensor) -> dist.TorchDistribution:
        site = self.prefix + name
        if site not in self.loc:
            raise KeyError(
                f"LaplacePrior has no posterior for {name!r} (site {site!r}); it covers "
                f"{list(self.loc)[:5]}; lift the same tensors, with the same prefix= as "
                "when the posterior was fitted"
            )
        loc = self.loc[site].to(dtype=param.dtype, device=param.device)
        if loc.shape != param.shape:
            raise ValueError(
                f"LaplacePrior: {site!r} was fitted with shape {tuple(loc.shape)}, the "
                f"parameter now has shape {tuple(param.shape)}"
            )
        block = self.blocks[site]
        if isinstance(block, DiagonalBlock):
            scale = (self.temperature * block.variance(self.delta)[site]).sqrt().to(loc)
            return dist.Normal(loc, scale.expand(loc.shape)).to_event(loc.dim())
        return BlockNormal(loc, block, self.delta, self.temperature)

    def __repr__(self) -> str:
        return f"LaplacePrior({len(self.loc)} tensors, temperature={self.temperature})"
