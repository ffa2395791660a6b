r"""Tuning a fitted :class:`~.guide.LaplaceGuide` without refitting its curvature.

The prior precision :math:`\delta` by the Laplace evidence
(:mod:`~pyro_bdl.inference.laplace.evidence`) on the training data or by a grid search
on validation data, and the linearised predictive's link
(:mod:`~pyro_bdl.inference.laplace.predictive`) on validation data: the bodies of
:meth:`LaplaceGuide.optimize_prior_precision
<.guide.LaplaceGuide.optimize_prior_precision>`, :meth:`LaplaceGuide.select_link
<.guide.LaplaceGuide.select_link>` and :meth:`LaplaceGuide.log_marginal_likelihood
<.guide.LaplaceGuide.log_marginal_likelihood>`, whose docstrings give the methods.
"""

from __future__ import annotations

import functools

import torch

from pyro_bdl import distributed
from pyro_bdl._checks import integer, one_of, real
from pyro_bdl.inference.laplace.evidence import log_marginal_likelihood, maximise_evidence
from pyro_bdl.inference.laplace.model_prior import log_prior
from pyro_bdl.inference.laplace.predictive import LINKS, link_probabilities, one_pass

__all__ = ["evidence", "optimize_prior_precision", "select_link"]


def evidence(guide, delta: dict[str, torch.Tensor]) -> torch.Tensor:
    """The guide's Laplace evidence at the prior precision ``delta``."""
    # differentiable in delta, which the prior_precision setter would detach. The
    # priors that are not Normal (none, in an exact-Hessian fit, whose first term is
    # the whole log joint) add their log density at the mode to the likelihood's.
    other = {name: guide._loc[name] for name in guide._other_priors}
    return log_marginal_likelihood(
        guide._log_likelihood + log_prior(guide, other),
        guide._blocks,
        guide._loc,
        guide._prior_loc,
        {**guide._prior_precision, **delta},
    )


def optimize_prior_precision(
    guide,
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
) -> dict[str, torch.Tensor]:
    """Tune the guide's :math:`\\delta` (see ``LaplaceGuide.optimize_prior_precision``)."""
    guide._check_fitted()
    one_of("method", method, ("marglik", "gridsearch"))
    one_of("structure", structure, ("scalar", "layer"))
    sites = list(guide._model_precision)
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
            group: torch.stack([guide._prior_precision[s].mean() for s in members]).mean()
            for group, members in groups.items()
        }
        sizes = {site: value.numel() for site, value in guide._loc.items()}
        tuned = maximise_evidence(
            functools.partial(evidence, guide), groups, init, num_steps, lr, sizes
        )
        guide._prior_precision = {**guide._prior_precision, **tuned}
        return guide.prior_precision
    if not val_args and not val_kwargs:
        raise ValueError(
            "method='gridsearch' needs the validation data: "
            "optimize_prior_precision('gridsearch', val_loader, num_data)"
        )
    one_of("link", link, LINKS)
    like = next(iter(guide._loc.values()))
    grid = torch.logspace(-4, 4, 41) if grid is None else torch.as_tensor(grid)
    grid = grid.to(like).reshape(-1)
    if not bool((grid > 0).all()) or not bool(torch.isfinite(grid).all()):
        raise ValueError(f"grid must hold positive finite prior precisions, got {grid}")
    if structure == "scalar":
        candidates = [{site: value for site in sites} for value in grid]
    else:
        candidates = [
            {site: value * guide._prior_precision[site] for site in sites} for value in grid
        ]
    candidates = [{**guide._prior_precision, **candidate} for candidate in candidates]
    nll = _validation_nll(guide, val_args, val_kwargs, candidates, (link,), num_samples, progress)
    best = candidates[int(nll[:, 0].argmin())]
    guide._prior_precision = {site: delta.detach().clone() for site, delta in best.items()}
    return guide.prior_precision


def select_link(guide, val_args, val_kwargs, *, links, num_samples, progress) -> tuple:
    """The guide's best link on validation data (see ``LaplaceGuide.select_link``)."""
    guide._check_fitted()
    if not val_args and not val_kwargs:
        raise ValueError("select_link needs the validation data: select_link(val_loader, num_data)")
    links = tuple(links)
    if not links:
        raise ValueError("links must name at least one of ('mc', 'probit', 'bridge')")
    for name in links:
        one_of("links", name, LINKS)
    nll = _validation_nll(
        guide, val_args, val_kwargs, [guide._prior_precision], links, num_samples, progress
    )[0]
    scores = {name: float(value) for name, value in zip(links, nll, strict=True)}
    guide.link = links[int(nll.argmin())]
    return guide.link, scores


def _validation_nll(guide, args, kwargs, candidates, links, num_samples, progress):
    """Mean NLL ``(len(candidates), len(links))`` of the linearised predictive.

    One linearisation per batch serves every candidate prior precision and link.
    """
    num_samples = integer("num_samples", num_samples, low=1)
    like = next(iter(guide._loc.values()))
    total = torch.zeros(len(candidates), len(links), dtype=like.dtype, device=like.device)
    count = 0
    generator = torch.Generator(device=like.device).manual_seed(0)
    for batch_args, batch_kwargs in one_pass(args, kwargs, "validation NLL", progress):
        mean, grads, run = guide._linearize(batch_args, batch_kwargs)
        if not run.observation.is_observed:
            raise ValueError("the validation batches must carry labels")
        labels = run.observation.value.long().unsqueeze(-1)
        for i, delta in enumerate(candidates):
            covariance = guide._covariance(grads, delta)
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
