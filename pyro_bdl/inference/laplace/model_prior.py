r"""The model's prior as a :class:`~.guide.LaplaceGuide` holds it: the prior-precision state.

Read once from the model's trace (:func:`read_priors`): each latent site with a fixed
Normal prior gives its mean :math:`\mu_0` and precision, which :math:`\delta` (the guide's
``prior_precision``, set by the user or by tuning) overrides; a site with another
fixed, real, entry-by-entry independent prior contributes its own curvature
:math:`-\partial^2 \log p(\theta) / \partial\theta^2` at the mode (:func:`prior_curvature`);
and a model without the per-example structure of the GGN (a constrained site, a
hierarchical prior, a prior coupling its entries) is sent to the exact Hessian of its log
joint, or refused by name (:func:`use_exact_hessian`). The fit and the evidence read the
log prior and its gradient from here.
"""

from __future__ import annotations

from collections.abc import Mapping

import pyro.distributions as dist
import torch
from pyro.distributions.util import scale_and_mask

from pyro_bdl._checks import instance, real, site_keys
from pyro_bdl.inference.laplace.curvature import Full
from pyro_bdl.inference.laplace.observation import StructureError

__all__ = ["PriorPrecision", "read_priors", "set_prior_precision", "resolve"]

PriorPrecision = float | Mapping[str, float | torch.Tensor] | None


def read_priors(guide, args: tuple, kwargs: dict) -> None:
    """Read the priors of the guide's sites (its prototype trace run on ``args``)."""
    fixed = guide.sites.fixed_priors(guide.model, args, kwargs)
    guide.exact_hessian_reason = None
    guide._prior_loc, guide._model_precision, guide._other_priors = {}, {}, {}
    for name, site in guide.sites.items():
        reason = _no_structure(name, site, fixed)
        if reason is not None:
            use_exact_hessian(guide, reason)
            return
        normal = guide.sites.normal_prior(name, fixed) if site.unscaled else None
        if normal is None:  # its curvature by autodiff, at each curvature pass
            guide._other_priors[name] = site.message
            continue
        guide._prior_loc[name] = normal[0]
        guide._model_precision[name] = normal[1].reciprocal().square()
    guide._prior_precision = {}
    guide.prior_precision = guide._prior_precision_arg


def use_exact_hessian(guide, reason: str) -> None:
    """Take the exact Hessian of the log joint, or refuse the model by name."""
    if not isinstance(guide.curvature, Full):
        raise StructureError(
            f"LaplaceGuide(curvature={guide.curvature.name!r}): {reason}, so the "
            "per-example structure of the GGN and Fisher curvatures is not there. "
            "curvature='full' takes the exact Hessian of the log joint instead (as "
            "Pyro's AutoLaplaceApproximation), for models of up to "
            f"Full(max_params=...) latent entries"
        )
    if guide._prior_precision_arg is not None:
        raise ValueError(
            f"prior_precision: {reason}, so LaplaceGuide takes the exact Hessian of the "
            "model's log joint, prior included; there is no separate prior precision to "
            "set: change the prior's scale in the model"
        )
    size = guide.sites.numel
    if size > guide.curvature.max_params:
        raise ValueError(
            f"LaplaceGuide: {reason}, so the curvature is the exact Hessian of the log "
            f"joint, a {size} x {size} matrix, more than max_params="
            f"{guide.curvature.max_params}; pass Full(max_params=...) if the memory is there"
        )
    guide.exact_hessian_reason = reason
    guide._prior_loc, guide._model_precision, guide._other_priors = {}, {}, {}
    guide._prior_precision = {}


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


def set_prior_precision(guide, value: PriorPrecision) -> None:
    """Check ``value`` against the model's sites and set it (``guide.prior_precision = ...``)."""
    value = checked_precision(value)
    precision = dict(guide._model_precision)
    if value is not None and not precision:
        reason = guide.exact_hessian_reason
        raise ValueError(
            "prior_precision: no latent site of this model has a Normal prior with fixed "
            "parameters whose precision it could set (the model's own priors enter the "
            f"curvature{': ' + reason if reason else ''}"
            "); change the priors' scales in the model"
        )
    if isinstance(value, Mapping):
        others = [name for name in value if name in guide._other_priors]
        if others:
            fn = guide.sites[others[0]].prior_name
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
        like = guide.sites[name].message["value"]
        delta = delta.to(dtype=like.dtype, device=like.device)
        try:
            fits = torch.broadcast_shapes(delta.shape, like.shape) == like.shape
        except RuntimeError:
            fits = False
        if not fits:
            raise ValueError(
                f"prior_precision of {name!r} has shape {tuple(delta.shape)}, which does "
                f"not broadcast to the site's shape {tuple(like.shape)}"
            )
        if not bool((delta > 0).all()) or not bool(torch.isfinite(delta).all()):
            raise ValueError(
                f"prior_precision of {name!r} must be positive and finite, got {delta}"
            )
        if delta.numel() > 1 and bool((delta == delta.flatten()[0]).all()):
            delta = delta.flatten()[0]
        checked[name] = delta.detach()
    guide._prior_precision = {**guide._prior_precision, **checked}


def resolve(guide, prior_precision: PriorPrecision) -> dict[str, torch.Tensor]:
    """The guide's :math:`\\delta`, or ``prior_precision`` checked as the setter would."""
    guide._check_fitted()
    if prior_precision is None:
        return guide._prior_precision
    saved = guide._prior_precision
    guide.prior_precision = prior_precision
    resolved, guide._prior_precision = guide._prior_precision, saved
    return resolved


# -- the log prior, its gradient and curvature ----------------------------------------


def site_log_density(message: dict, value: torch.Tensor) -> torch.Tensor:
    """A site's log density at ``value``, scaled and masked as the model has it."""
    log_prob = message["fn"].log_prob(value)
    return scale_and_mask(log_prob, message["scale"], message["mask"]).sum()


def prior_curvature(guide, values) -> dict[str, torch.Tensor]:
    """:math:`-\\partial^2 \\log p / \\partial\\theta^2` entry by entry, for the priors
    that are not Normal (independent entries: the gradient of the summed first
    derivatives is the diagonal), checked positive."""
    curvatures = {}
    for name, message in guide._other_priors.items():
        x = values[name].detach().requires_grad_()
        with torch.enable_grad():
            log_prior = site_log_density(message, x)
            (grad,) = torch.autograd.grad(log_prior, x, create_graph=True)
            (second,) = torch.autograd.grad(grad.sum(), x, allow_unused=True)
        curvature = torch.zeros_like(x) if second is None else -second.detach()
        if not bool((curvature > 0).all()):
            raise ValueError(
                f"LaplaceGuide: the log prior of {name!r} ({guide.sites[name].prior_name}) "
                "is not strictly concave at the fitted point (curvature "
                f"{float(curvature.min()):.3g} somewhere), so the Laplace precision is not "
                "positive definite there; give the site a log-concave prior"
            )
        curvatures[name] = curvature
    return curvatures


def log_joint_gradient(guide, score, values) -> dict[str, torch.Tensor]:
    """The log joint's gradient: the likelihood's (``score``) plus the prior's."""
    gradient = {}
    for name, value in values.items():
        if name in guide._other_priors:
            x = value.detach().requires_grad_()
            with torch.enable_grad():
                log_prior = site_log_density(guide._other_priors[name], x)
                (prior_score,) = torch.autograd.grad(log_prior, x)
            gradient[name] = score[name] + prior_score
        else:
            prior_score = guide._model_precision[name] * (value - guide._prior_loc[name])
            gradient[name] = score[name] - prior_score
    return gradient


def log_prior(guide, values) -> torch.Tensor:
    """The model's log prior of ``values``; its normal part up to a constant."""
    total = 0.0
    for name, value in values.items():
        if name in guide._other_priors:
            total = total + site_log_density(guide._other_priors[name], value.detach())
        else:
            squares = (value - guide._prior_loc[name]).square()
            total = total - 0.5 * (guide._model_precision[name] * squares).sum()
    return total
