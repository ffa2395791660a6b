r"""Tuning a :class:`~.approximation.LaplaceFit` without refitting its curvature.

The prior precision :math:`\delta` by the Laplace evidence
(:mod:`~pyro_bdl.inference.laplace.evidence`) on the training data or by a grid search
on validation data, and the linearised predictive's link
(:mod:`~pyro_bdl.inference.laplace.predictive`) on validation data. Each takes a fit and
returns a new one (the bodies of :meth:`LaplaceGuide.optimize_prior_precision
<.guide.LaplaceGuide.optimize_prior_precision>`, :meth:`LaplaceGuide.select_link
<.guide.LaplaceGuide.select_link>` and :meth:`LaplaceGuide.log_marginal_likelihood
<.guide.LaplaceGuide.log_marginal_likelihood>`, whose docstrings give the methods).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from pyro_bdl import distributed
from pyro_bdl._checks import integer, one_of, real
from pyro_bdl.inference.laplace.approximation import LaplaceFit
from pyro_bdl.inference.laplace.evidence import log_marginal_likelihood, maximise_evidence
from pyro_bdl.inference.laplace.model_prior import log_prior
from pyro_bdl.inference.laplace.predictive import LINKS, linearize, link_probabilities, one_pass

__all__ = ["evidence", "optimize_prior_precision", "select_link"]


def evidence(fit: LaplaceFit, delta: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """The Laplace evidence of ``fit`` at the prior precision ``delta`` (default: its own),
    differentiable in ``delta``."""
    # The priors that are not Normal (none, in an exact-Hessian fit, whose first term is
    # the whole log joint) add their log density at the mode to the likelihood's.
    other = {name: fit.loc[name] for name in fit.prior.others}
    return log_marginal_likelihood(
        fit.log_likelihood + log_prior(fit.prior, other),
        list(fit.blocks),
        fit.loc,
        fit.prior.loc,
        {**fit.prior_precision, **(delta or {})},
    )


def optimize_prior_precision(
    fit: LaplaceFit,
    method,
    val_args,
    val_kwargs,
    *,
    structure,
    num_steps,
    lr,
    grid,
    link,
    num_samples,
    progress,
) -> LaplaceFit:
    """``fit`` at the tuned :math:`\\delta` (see ``LaplaceGuide.optimize_prior_precision``)."""
    one_of("method", method, ("marglik", "gridsearch"))
    one_of("structure", structure, ("scalar", "layer"))
    sites = list(fit.prior.precision)
    if not sites:
        raise ValueError(
            "optimize_prior_precision: no latent site of this model has a Normal prior "
            "with fixed parameters, so there is no prior precision to tune (the priors' "
            "curvature comes from the model); tune the prior's scale in the model"
        )
    if method == "marglik":
        if val_args or val_kwargs:
            raise ValueError("method='marglik' uses the training data only; drop val_args")
        num_steps = integer("num_steps", num_steps, low=1)
        lr = real("lr", lr, positive=True)
        groups = {"all": sites} if structure == "scalar" else {s: [s] for s in sites}
        init = {
            group: torch.stack([fit.prior_precision[s].mean() for s in members]).mean()
            for group, members in groups.items()
        }
        sizes = {site: value.numel() for site, value in fit.loc.items()}
        tuned = maximise_evidence(
            functools.partial(evidence, fit), groups, init, num_steps, lr, sizes
        )
        return _at(fit, tuned)
    if not val_args and not val_kwargs:
        raise ValueError(
            "method='gridsearch' needs the validation data: "
            "optimize_prior_precision('gridsearch', val_loader, num_data)"
        )
    one_of("link", link, LINKS)
    like = next(iter(fit.loc.values()))
    grid = torch.logspace(-4, 4, 41) if grid is None else torch.as_tensor(grid)
    grid = grid.to(like).reshape(-1)
    if not bool((grid > 0).all()) or not bool(torch.isfinite(grid).all()):
        raise ValueError(f"grid must hold positive finite prior precisions, got {grid}")
    if structure == "scalar":
        candidates = [{site: value for site in sites} for value in grid]
    else:
        candidates = [{site: value * fit.prior_precision[site] for site in sites} for value in grid]
    candidates = [{**fit.prior_precision, **candidate} for candidate in candidates]
    nll = _validation_nll(fit, val_args, val_kwargs, candidates, (link,), num_samples, progress)
    best = candidates[int(nll[:, 0].argmin())]
    return _at(fit, {site: delta.detach().clone() for site, delta in best.items()})


def _at(fit: LaplaceFit, delta: dict[str, torch.Tensor]) -> LaplaceFit:
    """``fit`` with these prior precisions (tuned from its own: already checked)."""
    return dataclasses.replace(fit, prior_precision={**fit.prior_precision, **delta})


def select_link(
    fit: LaplaceFit, val_args, val_kwargs, *, links, num_samples, progress
) -> tuple[LaplaceFit, dict[str, float]]:
    """``fit`` with the best link on validation data, and the mean validation NLL of each
    candidate (see ``LaplaceGuide.select_link``)."""
    if not val_args and not val_kwargs:
        raise ValueError("select_link needs the validation data: select_link(val_loader, num_data)")
    links = tuple(links)
    if not links:
        raise ValueError("links must name at least one of ('mc', 'probit', 'bridge')")
    for name in links:
        one_of("links", name, LINKS)
    nll = _validation_nll(
        fit, val_args, val_kwargs, [fit.prior_precision], links, num_samples, progress
    )[0]
    scores = {name: float(value) for name, value in zip(links, nll, strict=True)}
    return fit.with_link(links[int(nll.argmin())]), scores


def _validation_nll(fit: LaplaceFit, args, kwargs, candidates, links, num_samples, progress):
    """Mean NLL ``(len(candidates), len(links))`` of the linearised predictive.

    One linearisation per batch serves every candidate prior precision and link.
    """
    num_samples = integer("num_samples", num_samples, low=1)
    like = next(iter(fit.loc.values()))
    total = torch.zeros(len(candidates), len(links), dtype=like.dtype, device=like.device)
    count = 0
    generator = torch.Generator(device=like.device).manual_seed(0)
    for batch_args, batch_kwargs in one_pass(args, kwargs, "validation NLL", progress):
        mean, grads, run = linearize(fit, batch_args, batch_kwargs)
        if not run.observation.is_observed:
            raise ValueError("the validation batches must carry labels")
        labels = run.observation.value.long().unsqueeze(-1)
        for i, delta in enumerate(candidates):
            covariance = fit.output_covariance(grads, delta)
            for j, name in enumerate(links):
                probs = link_probabilities(
                    name, mean, covariance, num_samples, generator, contrasts=False
                )
                probs = probs.mean(0) if name == "mc" else probs
                picked = probs.gather(-1, labels).squeeze(-1)
                total[i, j] -= picked.clamp(min=torch.finfo(probs.dtype).tiny).log().sum()
        count += len(labels)
    # data-parallel: every rank's validation shard
    count = torch.tensor(float(count), dtype=like.dtype, device=like.device)
    distributed.all_reduce_([total, count])
    return total / count
