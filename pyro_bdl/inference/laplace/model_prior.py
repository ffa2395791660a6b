r"""The model's prior as the Laplace approximation uses it: :class:`ModelPrior`.

Read once from the model's trace (:func:`read_priors`): each latent site with a fixed
Normal prior gives its mean :math:`\mu_0` and precision, which :math:`\delta` (the guide's
``prior_precision``, set by the user or by tuning, :func:`merged_precision`) overrides; a
site with another fixed, real, entry-by-entry independent prior contributes its own
curvature :math:`-\partial^2 \log p(\theta) / \partial\theta^2` at the mode
(:func:`prior_curvature`); and a model without the per-example structure of the GGN (a
constrained site, a hierarchical prior, a prior coupling its entries) is sent to the exact
Hessian of its log joint, or refused by name (:func:`exact_hessian_prior`). The fit and
the evidence read the log prior and its gradient from here. Everything here takes and
returns values; nothing holds a guide.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import pyro.distributions as dist
import torch
from pyro.distributions.util import scale_and_mask

from pyro_bdl._checks import instance, real, site_keys
from pyro_bdl.inference.laplace.curvature import Curvature, Full
from pyro_bdl.inference.laplace.observation import StructureError
from pyro_bdl.inference.sites import LatentSite, LatentSites

__all__ = [
    "ModelPrior",
    "PriorPrecision",
    "read_priors",
    "exact_hessian_prior",
    "merged_precision",
]

PriorPrecision = float | Mapping[str, float | torch.Tensor] | None


@dataclass(frozen=True)
class ModelPrior:
    """The model's priors, as read from its trace.

    :ivar dict loc: :math:`\\mu_0` per site with a fixed Normal prior.
    :ivar dict precision: that prior's precision :math:`1/\\sigma^2` (the default
        :math:`\\delta`), per site.
    :ivar dict others: site -> its ``LatentSite`` (prototype trace), for a fixed,
        real, entry-by-entry independent prior that is not a Normal (its curvature comes
        from the model).
    :ivar str exact_hessian_reason: why the model has no per-example structure, so the
        curvature is the exact Hessian of its log joint, prior included (then the dicts
        are empty); None otherwise.
    """

    loc: dict[str, torch.Tensor] = field(default_factory=dict)
    precision: dict[str, torch.Tensor] = field(default_factory=dict)
    others: dict[str, LatentSite] = field(default_factory=dict)
    exact_hessian_reason: str | None = None


def read_priors(
    sites: LatentSites,
    model,
    args: tuple,
    kwargs: dict,
    curvature: Curvature,
    requested: PriorPrecision,
) -> ModelPrior:
    """Read the priors of ``sites`` (the prototype trace of ``model`` run on ``args``).

    :param curvature: the structure asked for (a model without its structure is sent to
        the exact Hessian only if it is :class:`~.curvature.Full`).
    :param requested: the ``prior_precision`` asked for (an exact-Hessian fit has none).
    """
    fixed = sites.fixed_priors(model, args, kwargs)
    loc, precision, others = {}, {}, {}
    for name, site in sites.items():
        reason = _no_structure(name, site, fixed)
        if reason is not None:
            return exact_hessian_prior(sites, curvature, requested, reason)
        normal = sites.normal_prior(name, fixed) if site.unscaled else None
        if normal is None:  # its curvature by autodiff, at each curvature pass
            others[name] = site
            continue
        loc[name] = normal[0]
        precision[name] = normal[1].reciprocal().square()
    return ModelPrior(loc, precision, others)


def exact_hessian_prior(
    sites: LatentSites, curvature: Curvature, requested: PriorPrecision, reason: str
) -> ModelPrior:
    """The prior of an exact-Hessian fit (it is in the log joint), or a refusal by name."""
    if not isinstance(curvature, Full):
        raise StructureError(
            f"LaplaceGuide(curvature={curvature.name!r}): {reason}, so the "
            "per-example structure of the GGN and Fisher curvatures is not there. "
            "curvature='full' takes the exact Hessian of the log joint instead (as "
            "Pyro's AutoLaplaceApproximation), for models of up to "
            f"Full(max_params=...) latent entries"
        )
    if requested is not None:
        raise ValueError(
            f"prior_precision: {reason}, so LaplaceGuide takes the exact Hessian of the "
            "model's log joint, prior included; there is no separate prior precision to "
            "set: change the prior's scale in the model"
        )
    size = sites.numel
    if size > curvature.max_params:
        raise ValueError(
            f"LaplaceGuide: {reason}, so the curvature is the exact Hessian of the log "
            f"joint, a {size} x {size} matrix, more than max_params="
            f"{curvature.max_params}; pass Full(max_params=...) if the memory is there"
        )
    return ModelPrior(exact_hessian_reason=reason)


def _no_structure(name: str, site, fixed: set[str]) -> str | None:
    """Why a latent site rules out the GGN and Fisher curvatures, or None."""
    if not site.is_real:
        return f"the site {name!r} has the constrained support {site.message['fn'].support}"
    if name not in fixed:
        return f"the prior of {name!r} depends on other latent sites (a hierarchical prior)"
    base = site.message["fn"]
    while isinstance(base, (dist.Independent, dist.ExpandedDistribution, dist.MaskedDistribution)):
        base = base.base_dist
    if base.event_shape:
        return f"the prior of {name!r} ({type(base).__name__}) couples the entries of its event"
    return None


# -- the prior precision delta ------------------------------------------------------


def checked_precision(value: PriorPrecision) -> PriorPrecision:
    """``prior_precision`` as far as it can be checked without the model."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        for name, delta in value.items():
            instance("prior_precision's keys", name, str, "latent site names")
            _check_delta(f"prior_precision[{name!r}]", delta)
        return value
    if torch.is_tensor(value) and value.numel() != 1:
        raise TypeError(
            f"prior_precision must be None, a number or a dict site -> number or tensor; a "
            f"tensor of shape {tuple(value.shape)} belongs in the dict, under its site"
        )
    return real("prior_precision", value, positive=True)


def _check_delta(name: str, delta: object) -> None:
    if not (torch.is_tensor(delta) and delta.numel() > 1):
        real(name, delta, positive=True)
    elif not delta.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {delta.dtype}")
    elif not bool((delta > 0).all()) or not bool(torch.isfinite(delta).all()):
        raise ValueError(f"{name} must be positive and finite in every entry")


def merged_precision(
    prior: ModelPrior,
    like: Mapping[str, torch.Tensor],
    current: Mapping[str, torch.Tensor],
    value: PriorPrecision,
) -> dict[str, torch.Tensor]:
    """``current`` with the Normal sites' :math:`\\delta` set to ``value`` (None: the
    model's own), checked against the sites (``like``: a tensor of each site's shape)."""
    value = checked_precision(value)
    precision = dict(prior.precision)
    if value is not None and not precision:
        reason = prior.exact_hessian_reason
        raise ValueError(
            "prior_precision: no latent site of this model has a Normal prior with fixed "
            "parameters whose precision it could set (the model's own priors enter the "
            f"curvature{': ' + reason if reason else ''}"
            "); change the priors' scales in the model"
        )
    if isinstance(value, Mapping):
        others = [name for name in value if name in prior.others]
        if others:
            fn = prior.others[others[0]].prior_name
            raise ValueError(
                f"prior_precision names {others[0]!r}, whose prior is a {fn}, not a Normal: "
                "its curvature comes from the model; set the Normal sites' precision only"
            )
        site_keys("prior_precision", value, precision, "the model's latent sites")
        precision.update({name: torch.as_tensor(v) for name, v in value.items()})
    elif value is not None:
        precision = {name: torch.as_tensor(value) for name in precision}
    checked = {}
    for name, delta in precision.items():
        delta = delta.to(dtype=like[name].dtype, device=like[name].device)
        try:
            fits = torch.broadcast_shapes(delta.shape, like[name].shape) == like[name].shape
        except RuntimeError:
            fits = False
        if not fits:
            raise ValueError(
                f"prior_precision of {name!r} has shape {tuple(delta.shape)}, which does "
                f"not broadcast to the site's shape {tuple(like[name].shape)}"
            )
        if not bool((delta > 0).all()) or not bool(torch.isfinite(delta).all()):
            raise ValueError(
                f"prior_precision of {name!r} must be positive and finite, got {delta}"
            )
        if delta.numel() > 1 and bool((delta == delta.flatten()[0]).all()):
            delta = delta.flatten()[0]
        checked[name] = delta.detach()
    return {**current, **checked}


# -- the log prior, its gradient and curvature ----------------------------------------


def site_log_density(message: dict, value: torch.Tensor) -> torch.Tensor:
    """A site's log density at ``value``, scaled and masked as the model has it."""
    log_prob = message["fn"].log_prob(value)
    return scale_and_mask(log_prob, message["scale"], message["mask"]).sum()


def prior_curvature(prior: ModelPrior, values) -> dict[str, torch.Tensor]:
    """:math:`-\\partial^2 \\log p / \\partial\\theta^2` entry by entry, for the priors
    that are not Normal (independent entries: the gradient of the summed first
    derivatives is the diagonal), checked positive."""
    curvatures = {}
    for name, site in prior.others.items():
        x = values[name].detach().requires_grad_()
        with torch.enable_grad():
            log_prior = site_log_density(site.message, x)
            (grad,) = torch.autograd.grad(log_prior, x, create_graph=True)
            (second,) = torch.autograd.grad(grad.sum(), x, allow_unused=True)
        curvature = torch.zeros_like(x) if second is None else -second.detach()
        if not bool((curvature > 0).all()):
            raise ValueError(
                f"LaplaceGuide: the log prior of {name!r} ({site.prior_name}) "
                "is not strictly concave at the fitted point (curvature "
                f"{float(curvature.min()):.3g} somewhere), so the Laplace precision is not "
                "positive definite there; give the site a log-concave prior"
            )
        curvatures[name] = curvature
    return curvatures


def log_joint_gradient(prior: ModelPrior, score, values) -> dict[str, torch.Tensor]:
    """The log joint's gradient: the likelihood's (``score``) plus the prior's."""
    gradient = {}
    for name, value in values.items():
        if name in prior.others:
            x = value.detach().requires_grad_()
            with torch.enable_grad():
                log_prior = site_log_density(prior.others[name].message, x)
                (prior_score,) = torch.autograd.grad(log_prior, x)
            gradient[name] = score[name] + prior_score
        else:
            prior_score = prior.precision[name] * (value - prior.loc[name])
            gradient[name] = score[name] - prior_score
    return gradient


def log_prior(prior: ModelPrior, values) -> torch.Tensor:
    """The model's log prior of ``values``; its normal part up to a constant."""
    total = 0.0
    for name, value in values.items():
        if name in prior.others:
            total = total + site_log_density(prior.others[name].message, value.detach())
        else:
            squares = (value - prior.loc[name]).square()
            total = total - 0.5 * (prior.precision[name] * squares).sum()
    return total
