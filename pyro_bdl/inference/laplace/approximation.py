r"""The Laplace approximation as values: what a fit is of, and what it found.

:class:`LaplaceProblem` is what a fit approximates: the model, its latent sites and
priors, the curvature structure asked for, the temperature and the prior precision asked
for. :class:`LaplaceFit` is what the fit found, one frozen record (as posteriors'
``DiagLaplaceState`` and the new guide Pyro's ``AutoLaplaceApproximation`` returns): the
mode, the curvature blocks, the prior precision, the log likelihood, the model linearised
at the mode and the predictive's link. The fit (:mod:`.fitting`, :mod:`.curvature_pass`)
makes one, the predictive (:mod:`.predictive`) and the evidence read one, tuning
(:mod:`.tuning`) returns a new one, and :class:`~pyro_bdl.inference.LaplaceGuide` holds the current
one; none of them changes a fit in place.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pyro_bdl.inference.laplace.curvature import Curvature, GaussianBlock
from pyro_bdl.inference.laplace.jacobians import DenseGradient, ModelJacobians
from pyro_bdl.inference.laplace.model_prior import (
    ModelPrior,
    PriorPrecision,
    exact_hessian_prior,
    merged_precision,
)
from pyro_bdl.inference.sites import LatentSites

__all__ = ["LaplaceProblem", "LaplaceFit"]


@dataclass(frozen=True)
class LaplaceProblem:
    """What a Laplace fit approximates.

    :ivar callable model: the Pyro model.
    :ivar sites: its latent sites (:class:`~pyro_bdl.inference.sites.LatentSites`).
    :ivar prior: its priors (:class:`~pyro_bdl.inference.laplace.model_prior.ModelPrior`).
    :ivar curvature: the structure asked for (:class:`~pyro_bdl.inference.Curvature`).
    :ivar float temperature: :math:`T`.
    :ivar requested: the ``prior_precision`` asked for (None: the model's).
    :ivar callable init_loc_fn: where a MAP search starts.
    """

    model: Callable
    sites: LatentSites
    prior: ModelPrior
    curvature: Curvature
    temperature: float
    requested: PriorPrecision
    init_loc_fn: Callable

    def __post_init__(self):
        self.prior_precision()  # an unsuitable request is refused now, before the fit

    def prior_precision(self) -> dict[str, torch.Tensor]:
        r""":math:`\delta` of the Normal sites, as asked (the model's own by default)."""
        values = {name: site.message["value"] for name, site in self.sites.items()}
        return merged_precision(self.prior, values, {}, self.requested)

    def exact(self, reason: str) -> LaplaceProblem:
        """The problem of the exact Hessian of the log joint (or a refusal by name)."""
        prior = exact_hessian_prior(self.sites, self.curvature, self.requested, reason)
        return dataclasses.replace(self, prior=prior)


@dataclass(frozen=True)
class LaplaceFit:
    r"""A fitted Laplace approximation :math:`\mathcal{N}(\theta_\text{MAP}, T P^{-1})`,
    :math:`P = H + \operatorname{diag}(\delta)`, as one frozen value.

    Its fields are never changed: :meth:`with_prior_precision` and :meth:`with_link` (and
    the tuning they serve) return a new fit. A :class:`~pyro_bdl.inference.LaplaceGuide`
    holds its current fit as :attr:`~pyro_bdl.inference.LaplaceGuide.laplace_fit`.

    Example::

        guide.fit(train_loader, num_data)
        fit = guide.laplace_fit
        fit.loc                     # the MAP, per site (unconstrained)
        fit.variance()              # the marginal variances of T P^-1
        wider = fit.with_prior_precision(0.5)      # a new fit; `fit` is unchanged

    :ivar dict loc: :math:`\theta_\text{MAP}` per site, unconstrained.
    :ivar tuple blocks: the curvature :math:`H` as blocks of the posterior precision
        (:class:`~pyro_bdl.inference.laplace.curvature.GaussianBlock`), scaled to the
        whole data set.
    :ivar dict prior_precision: :math:`\delta` per site with a Normal prior, and the
        prior's own curvature at the mode for a site with another prior (empty for an
        exact-Hessian fit, whose prior is in its Hessian).
    :ivar prior: the model's priors (:class:`~pyro_bdl.inference.laplace.model_prior.ModelPrior`).
    :ivar log_likelihood: :math:`\log p(\mathcal{D} \mid \theta_\text{MAP})` over the data
        set (an exact-Hessian fit: the whole log joint).
    :ivar int num_data: :math:`N`.
    :ivar float temperature: :math:`T`.
    :ivar dict gradient: the log joint's gradient at the point per site, or None (the fit
        skipped the mode check).
    :ivar jacobians: the model linearised at the mode
        (a ``ModelJacobians``), which the linearised predictive runs;
        None for an exact-Hessian fit.
    :ivar str link: the linearised predictive's default link.
    """

    loc: dict[str, torch.Tensor]
    blocks: tuple[GaussianBlock, ...]
    prior_precision: dict[str, torch.Tensor]
    prior: ModelPrior
    log_likelihood: torch.Tensor
    num_data: int
    temperature: float
    gradient: dict[str, torch.Tensor] | None = None
    jacobians: ModelJacobians | None = None
    link: str = "mc"

    @property
    def exact_hessian_reason(self) -> str | None:
        """Why the curvature is the exact Hessian of the log joint (None: the structure's)."""
        return self.prior.exact_hessian_reason

    def with_prior_precision(self, value: PriorPrecision) -> LaplaceFit:
        r"""This fit at another :math:`\delta` (None: the model's own), checked."""
        delta = merged_precision(self.prior, self.loc, self.prior_precision, value)
        return dataclasses.replace(self, prior_precision=delta)

    def with_link(self, link: str) -> LaplaceFit:
        """This fit with another default link."""
        return dataclasses.replace(self, link=link)

    def with_temperature(self, temperature: float) -> LaplaceFit:
        r"""This fit tempered at :math:`T` instead: :math:`\Sigma = T P^{-1}`."""
        return dataclasses.replace(self, temperature=temperature)

    def resolve(self, value: PriorPrecision) -> dict[str, torch.Tensor]:
        r""":math:`\delta` per site: this fit's, or with the Normal sites' set to ``value``
        (checked)."""
        if value is None:
            return self.prior_precision
        return merged_precision(self.prior, self.loc, self.prior_precision, value)

    def require_structure(self, what: str) -> None:
        """Refuse ``what`` for an exact-Hessian fit, which has no network structure."""
        if self.exact_hessian_reason is not None:
            raise ValueError(
                f"LaplaceGuide: {what} needs the GGN structure of a network's weights, and this "
                f"fit is the exact Hessian of the model's log joint because "
                f"{self.exact_hessian_reason}; draw from the posterior with "
                "Predictive(model, guide=guide) instead"
            )

    # -- the Gaussian ----------------------------------------------------------------

    def offsets(self, noise: dict[str, torch.Tensor], delta=None) -> dict[str, torch.Tensor]:
        r""":math:`R z` (:math:`R R^\top = P^{-1}`) for standard normal ``noise`` shaped
        ``(S, *site_shape)``, block by block, at :math:`\delta` (default: the fit's)."""
        delta = self.prior_precision if delta is None else delta
        result = {}
        for block in self.blocks:
            result.update(block.sample({name: noise[name] for name in block.sites}, delta))
        return result

    def draws(self, noise: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        r""":math:`\theta_\text{MAP} + \sqrt{T} R z`, unconstrained, for noise shaped
        ``(S, *site_shape)``."""
        root_t = math.sqrt(self.temperature)
        offsets = self.offsets(noise)
        return {name: self.loc[name] + root_t * offsets[name] for name in self.loc}

    def variance(self) -> dict[str, torch.Tensor]:
        r"""The diagonal of :math:`T P^{-1}` per site (of the unconstrained value)."""
        result = {}
        for block in self.blocks:
            for name, variance in block.variance(self.prior_precision).items():
                result[name] = self.temperature * variance.expand(self.loc[name].shape)
        return result

    def output_covariance(self, grads, delta=None) -> torch.Tensor:
        r""":math:`T J P^{-1} J^\top` per example from Jacobian rows ``grads``, ``(B, K, K)``,
        at :math:`\delta` (default: the fit's)."""
        return self.temperature * self._precision_form(grads, delta)

    def _precision_form(self, grads, delta=None) -> torch.Tensor:
        r""":math:`J P^{-1} J^\top`, block by block."""
        delta = self.prior_precision if delta is None else delta
        return sum(block.output_covariance(grads, delta) for block in self.blocks)

    @property
    def mode_distance(self) -> float | None:
        r"""The Newton decrement :math:`\sqrt{g^\top P^{-1} g / T}` of the point: how far
        the mode of the quadratic model is, in posterior standard deviations; None when
        the fit took no gradient."""
        if self.gradient is None:
            return None
        grads = {name: DenseGradient(g[None, None]) for name, g in self.gradient.items()}
        squared = self._precision_form(grads).sum()
        return math.sqrt(max(float(squared), 0.0) / self.temperature)
