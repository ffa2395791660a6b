r"""Fitting a Laplace approximation: the MAP stage, the refinement, the mode check.

:func:`fit` is the body of :meth:`LaplaceGuide.fit <.guide.LaplaceGuide.fit>` (whose
docstring gives the method): the values (found by :func:`~pyro_bdl.inference.map.minimise`,
or given and checked), a curvature pass there (:mod:`.curvature_pass`), then, while the
Newton decrement :math:`\lambda = \sqrt{g^\top P^{-1} g / T}`
(:attr:`~.approximation.LaplaceFit.mode_distance`) is above the tolerance, L-BFGS on full
passes in coordinates whitened by the current approximation (:func:`refine`) and a fresh
curvature pass. It returns the last pass's :class:`~.approximation.LaplaceFit`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping

import pyro
import torch
from tqdm.auto import tqdm

from pyro_bdl._checks import instance, integer, real, site_keys
from pyro_bdl.inference.laplace.approximation import LaplaceFit, LaplaceProblem
from pyro_bdl.inference.laplace.curvature_pass import curvature_pass, data_pass
from pyro_bdl.inference.laplace.hessian import HessianBlock, LogJointPass
from pyro_bdl.inference.laplace.jacobians import ModelJacobians
from pyro_bdl.inference.laplace.model_prior import log_joint_gradient, log_prior
from pyro_bdl.inference.laplace.observation import StructureError
from pyro_bdl.inference.map import adam_at_prior_scale, minimise
from pyro_bdl.inference.minibatch import DataPass
from pyro_bdl.priors import normal_parameters

__all__ = ["fit", "refine"]

# L-BFGS passes before the curvature is first refreshed; each round doubles it (a
# fresh curvature whitens far better while the point still moves a lot).
_FIRST_ROUND = 5


def fit(
    model: Callable,
    setup: Callable[[tuple, dict], LaplaceProblem],
    args: tuple,
    kwargs: dict,
    *,
    map: bool | Mapping[str, torch.Tensor],
    num_steps: int,
    optimizer: pyro.optim.PyroOptim | None,
    max_passes: int,
    mode_tolerance: float | None,
    progress: bool,
) -> LaplaceFit:
    """The fit (see :meth:`LaplaceGuide.fit <.guide.LaplaceGuide.fit>`) of ``model`` on
    ``args``; ``setup`` gives the problem from the arguments of the first batch."""
    if not isinstance(map, (bool, Mapping)):
        raise TypeError(
            f"map must be True, False or a dict of site values, got {type(map).__name__}"
        )
    num_steps = integer("num_steps", num_steps, low=0)
    max_passes = integer("max_passes", max_passes, low=0)
    if mode_tolerance is not None:
        mode_tolerance = real("mode_tolerance", mode_tolerance, positive=True)
    instance("progress", progress, bool, "True or False")
    if optimizer is not None:
        instance("optimizer", optimizer, pyro.optim.PyroOptim, "a pyro.optim optimiser")
    batches = DataPass(model, args, kwargs)
    first_args, first_kwargs = batches.batches.peek()
    problem = _with_structure(setup(first_args, first_kwargs), first_args, first_kwargs)
    if map is True:
        values, _ = minimise(
            model,
            args,
            kwargs,
            num_steps,
            optimizer or adam_at_prior_scale(_prior_scales(problem)),
            False,
            problem.init_loc_fn,
            progress,
            jacobian=True,
        )
    elif map is False:
        values = {name: site.message["value"] for name, site in problem.sites.items()}
    else:
        values = _checked_values(problem, map)
    values = {name: value.detach() for name, value in values.items()}
    loc = {name: z.clone() for name, z in problem.sites.unconstrain(values).items()}
    check = mode_tolerance is not None
    result = curvature_pass(problem, loc, batches, progress, gradient=check)
    passes = rounds = 0
    distance = result.mode_distance if check else 0.0
    while check and map is True and passes < max_passes and distance > mode_tolerance:
        budget = min(max_passes - passes, _FIRST_ROUND * 2**rounds)
        rounds += 1
        loc, taken = refine(problem, result, batches, mode_tolerance, budget, progress)
        passes += taken
        # A round whose line search found no decrease has met the precision of the log
        # joint itself: more rounds cannot bring the mode closer.
        if all(torch.equal(result.loc[name], value) for name, value in loc.items()):
            break
        result = curvature_pass(problem, loc, batches, progress, gradient=True)
        distance = result.mode_distance
    if check and distance > mode_tolerance:
        _warn_not_a_mode(result, map, mode_tolerance, num_steps, max_passes)
    _warn_if_adapters_untrained(result.loc)
    if result.exact_hessian_reason is not None:
        _check_positive_definite(result.blocks[0], result.exact_hessian_reason)
    return result


def _with_structure(problem: LaplaceProblem, args: tuple, kwargs: dict) -> LaplaceProblem:
    """Read the likelihood of one run before any pass, so that a model without the GGN's
    structure is refused (or sent to the exact Hessian) before, not after, a MAP search."""
    if problem.prior.exact_hessian_reason is not None:
        return problem
    values = {name: site.message["value"] for name, site in problem.sites.items()}
    try:
        ModelJacobians(problem.model, values)(args, kwargs)
    except StructureError as error:
        return problem.exact(str(error).removeprefix("LaplaceGuide: "))
    return problem


def _prior_scales(problem: LaplaceProblem) -> dict[str, float]:
    """The scale each site's unconstrained value lives on: a Normal prior's standard
    deviation, 1 for any other prior (the scale of the unconstrained space)."""
    scales = {}
    for name, site in problem.sites.items():
        normal = normal_parameters(site.message["fn"], site.message["value"])
        scales[name] = 1.0 if normal is None or not site.is_real else float(normal[1].mean())
    return scales


def _checked_values(problem: LaplaceProblem, values: Mapping) -> dict[str, torch.Tensor]:
    """``fit(map=values)``: one finite tensor per latent site, of the site's shape."""
    sites = problem.sites
    site_keys("fit(map=...)", values, sites, "the model's latent sites")
    missing = [name for name in sites if name not in values]
    if missing:
        raise ValueError(f"fit(map=...): no value for the latent sites {missing[:5]}")
    checked = {}
    for name, site in sites.items():
        like = site.message["value"]
        value = values[name]
        if not torch.is_tensor(value):
            raise TypeError(
                f"fit(map=...): the value of {name!r} must be a tensor, got {type(value).__name__}"
            )
        if value.shape != like.shape:
            raise ValueError(
                f"fit(map=...): the value of {name!r} has shape {tuple(value.shape)}, the "
                f"site has shape {tuple(like.shape)}"
            )
        if not bool(torch.isfinite(value).all()):
            raise ValueError(f"fit(map=...): the value of {name!r} is not finite")
        fn = site.message["fn"]
        if not bool(fn.support.check(value).all()):
            raise ValueError(
                f"fit(map=...): the value of {name!r} is outside the site's support {fn.support}"
            )
        checked[name] = value.to(dtype=like.dtype, device=like.device)
    return checked


def _whiten(fit: LaplaceFit, start, offsets) -> dict[str, torch.Tensor]:
    r""":math:`\theta_0 + R u` with :math:`R R^\top = P^{-1}`, differentiable in ``u``."""
    steps = fit.offsets({name: offset.unsqueeze(0) for name, offset in offsets.items()})
    return {name: start[name] + steps[name][0] for name in start}


def refine(
    problem: LaplaceProblem, fit: LaplaceFit, batches, tolerance, budget, progress
) -> tuple[dict[str, torch.Tensor], int]:
    """L-BFGS on the log joint in coordinates whitened by ``fit``; returns the point
    reached and the passes taken."""
    start = {name: value.detach() for name, value in fit.loc.items()}
    offsets = {name: torch.zeros_like(value, requires_grad=True) for name, value in start.items()}
    # A long memory pays on these small non-convex problems; keep it under ~1e8 numbers.
    size = sum(value.numel() for value in start.values())
    history = max(5, min(100, 50_000_000 // size))
    lbfgs = torch.optim.LBFGS(
        list(offsets.values()),
        lr=1.0,
        max_iter=budget,
        max_eval=budget,
        tolerance_grad=0.0,
        history_size=history,
        line_search_fn="strong_wolfe",
    )
    bar = tqdm(total=budget, desc="MAP (L-BFGS, full passes)", disable=not progress, leave=False)
    passes = 0

    def closure():
        nonlocal passes
        passes += 1
        bar.update()
        lbfgs.zero_grad()
        values = _whiten(fit, start, offsets)
        detached = {name: value.detach() for name, value in values.items()}
        log_joint, gradient = _log_joint(problem, batches, detached)
        torch.autograd.backward(list(values.values()), [-gradient[name] for name in values])
        # In these coordinates the gradient's norm is the Newton decrement at T = 1.
        # LBFGS stops when the gradient it sees is zero: report zero once it is small.
        squared = sum(offset.grad.square().sum() for offset in offsets.values())
        if math.sqrt(float(squared) / fit.temperature) <= tolerance / 2:
            for offset in offsets.values():
                offset.grad.zero_()
        bar.set_postfix(log_joint=f"{float(log_joint):.6g}", refresh=False)
        return -log_joint

    lbfgs.step(closure)
    bar.close()
    with torch.no_grad():
        loc = {name: value.detach().clone() for name, value in _whiten(fit, start, offsets).items()}
    return loc, passes


def _log_joint(problem: LaplaceProblem, batches, values) -> tuple[torch.Tensor, dict]:
    """The log joint over a pass at unconstrained ``values``, and its gradient."""
    if problem.prior.exact_hessian_reason is not None:
        value, grad, _ = LogJointPass(problem.model, problem.sites, batches)(
            problem.sites.pack(values), order=1
        )
        return value, problem.sites.unpack(grad)
    log_likelihood, score, *_ = data_pass(problem.model, batches, values, None, True, False)
    prior = problem.prior
    return log_likelihood + log_prior(prior, values), log_joint_gradient(prior, score, values)


def _warn_not_a_mode(fit: LaplaceFit, map, tolerance, num_steps, max_passes) -> None:
    norm = math.sqrt(sum(float(g.square().sum()) for g in fit.gradient.values()))
    if map is True:
        fix = (
            f"raise max_passes (now {max_passes}) or num_steps (now {num_steps}), or "
            "pass map=<the values of a converged fit>"
        )
    else:
        given = (
            "the module's current weights (map=False)"
            if map is False
            else "the values passed as map="
        )
        fix = (
            f"{given} are not a MAP of this model (a checkpoint fitted with another prior "
            "or weight decay, or not converged): refine them with map=True, num_steps=0 "
            "(L-BFGS from them), or pass converged values"
        )
    warnings.warn(
        f"LaplaceGuide.fit: the point is not a mode of the log joint: its gradient has "
        f"norm {norm:.4g}, which puts the mode {fit.mode_distance:.3g} posterior "
        f"standard deviations away (Newton decrement sqrt(g' P^-1 g / T), above "
        f"mode_tolerance={tolerance}); the mean, curvature and evidence are those of "
        f"another point. To fix: {fix}. mode_tolerance=None skips this check",
        stacklevel=4,  # LaplaceGuide.fit's caller
    )


def _warn_if_adapters_untrained(values: Mapping[str, torch.Tensor]) -> None:
    """Warn when every LoRA pair among the sites has the update ``B @ A = 0``: the adapters
    of a fresh LoRA model (``B = 0``), or the ``A = B = 0`` mode that a MAP search from
    there falls into. The approximation is then of the pretrained network, whose new head
    predicts about the same for every input: a silent no-op."""
    updates = [
        values[name.replace("lora_A", "lora_B")] @ value
        for name, value in values.items()
        if "lora_A" in name and name.replace("lora_A", "lora_B") in values and value.dim() == 2
    ]
    # A fine-tuned adapter's update is 1e-4 to 1e-1 per entry; these are 0 or ~1e-14.
    if updates and all(float(update.abs().max()) < 1e-8 for update in updates):
        warnings.warn(
            f"LaplaceGuide.fit: the LoRA adapters are still at their initialisation (B @ A = 0 "
            f"in all {len(updates)} adapted layers), so this is the Laplace approximation of the "
            "pretrained network, which predicts about the same for every input. Fine-tune "
            "first (e.g. pyro_bdl.inference.baselines.map_estimate), then fit(..., map=False) "
            "at the fine-tuned weights (or map=<their values>)",
            stacklevel=4,  # LaplaceGuide.fit's caller
        )


def _check_positive_definite(block: HessianBlock, reason: str) -> None:
    eigenvalues = torch.linalg.eigvalsh(block.hessian)
    if not bool(eigenvalues[0] > 0):
        raise ValueError(
            f"LaplaceGuide: the negative Hessian of the log joint at the fitted point is not "
            f"positive definite (smallest eigenvalue {float(eigenvalues[0]):.3g}), so the point "
            "is not a mode and there is no Laplace approximation there (the exact Hessian "
            f"is used because {reason}). Fit the mode with map=True (more num_steps or "
            "max_passes), or check the posterior has one (a funnel, such as the centred "
            "eight schools, has none)"
        )
