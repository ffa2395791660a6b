r"""The pass over the data that turns a point into a Laplace approximation.

At a point :math:`\theta` one pass over the model's batches accumulates the curvature
:math:`H` of the log likelihood (see :mod:`~pyro_bdl.inference.laplace.curvature`), the
log likelihood and, for the mode check, the log joint's gradient; a model without the
GGN's structure gets the exact Hessian of its log joint instead
(:mod:`~pyro_bdl.inference.laplace.hessian`). What the pass gives is one
:class:`~.approximation.LaplaceFit` at the point: the blocks, the evidence's log
likelihood, ``num_data``, the gradient, and the model linearised at the point
(:class:`~.jacobians.ModelJacobians`), which the linearised predictive reuses (which
sites' factored gradients passed their check is learnt once).
"""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from pyro_bdl import distributed
from pyro_bdl.inference.laplace.approximation import LaplaceFit, LaplaceProblem
from pyro_bdl.inference.laplace.hessian import HessianBlock, LogJointPass
from pyro_bdl.inference.laplace.jacobians import ModelJacobians
from pyro_bdl.inference.laplace.model_prior import log_joint_gradient, prior_curvature
from pyro_bdl.inference.minibatch import DataPass

__all__ = ["curvature_pass", "data_pass"]


def curvature_pass(
    problem: LaplaceProblem,
    loc: dict[str, torch.Tensor],
    batches: DataPass,
    progress: bool,
    gradient: bool,
) -> LaplaceFit:
    """The Laplace approximation of ``problem`` at ``loc`` (unconstrained values), with
    the log joint's gradient there if asked (an exact-Hessian fit always has it)."""
    if problem.prior.exact_hessian_reason is not None:
        return _exact_pass(problem, loc, batches, progress)
    curvature = problem.curvature
    curvature.begin(loc)
    delta = {**problem.prior_precision(), **prior_curvature(problem.prior, loc)}
    log_likelihood, score, num_data, seen, jacobians = data_pass(
        problem.model, batches, loc, curvature, gradient, progress
    )
    blocks = tuple(curvature.blocks(num_data / seen))
    for block in blocks:
        try:
            block.check_prior(delta)
        except ValueError as error:
            other = next((name for name in block.sites if name in problem.prior.others), None)
            if other is None:
                raise
            fn = problem.prior.others[other].prior_name
            raise ValueError(
                f"{error}. The prior of {other!r} is a {fn}, not a Normal: its curvature "
                "differs from entry to entry, which K-FAC cannot hold; use "
                "curvature='diag_ggn' or 'full'"
            ) from None
    return LaplaceFit(
        loc=loc,
        blocks=blocks,
        prior_precision=delta,
        prior=problem.prior,
        log_likelihood=log_likelihood,
        num_data=num_data,
        temperature=problem.temperature,
        gradient=None if score is None else log_joint_gradient(problem.prior, score, loc),
        jacobians=jacobians,
    )


def _exact_pass(problem, loc, batches, progress) -> LaplaceFit:
    """The exact Hessian of the log joint at ``loc`` (see :mod:`.hessian`)."""
    log_joint = LogJointPass(problem.model, problem.sites, batches)
    value, grad, hessian = log_joint(problem.sites.pack(loc), order=2, progress=progress)
    shapes = {name: site.unconstrained_shape for name, site in problem.sites.items()}
    return LaplaceFit(
        loc=loc,
        blocks=(HessianBlock(shapes, -hessian),),
        prior_precision={},
        prior=problem.prior,
        log_likelihood=value,  # the whole log joint: the evidence's other terms
        num_data=log_joint.num_data,
        temperature=problem.temperature,
        gradient=problem.sites.unpack(grad),
    )


def data_pass(model, batches, values, curvature, gradient, progress):
    r"""One pass over the data at ``values``.

    Feeds each batch's per-example gradients to ``curvature`` (if given) and sums the
    log likelihood and, if ``gradient``, its gradient; both are scaled by
    :math:`N / n_\text{seen}`, the one scaling every structure shares (1 after a full
    pass over ``N`` examples).

    :return: (log likelihood, its gradient per site or None, N, the number of
        examples seen, the ModelJacobians).
    """
    jacobians = ModelJacobians(model, values)
    log_likelihood, seen, num_data = 0.0, 0, None
    score = [torch.zeros_like(v) for v in jacobians.values.values()] if gradient else None
    bar = tqdm(
        batches,
        total=batches.runs,
        desc=f"Laplace {curvature.name}" if curvature else "log joint",
        disable=not progress,
        leave=False,
    )
    for args, kwargs, context in bar:
        with context:
            batch_log_likelihood, batch_num_data, examples = _batch(
                jacobians, args, kwargs, curvature, score
            )
        if batches.plate is not None:  # a subsample plate's chunk: the indices not seen
            examples = batches.plate.kept
        if num_data is not None and batch_num_data != num_data:
            raise ValueError(
                f"the observed site's num_data changed between batches ({num_data} then "
                f"{batch_num_data}); pass num_data=<size of the training set> to "
                "bdl.observe"
            )
        num_data = batch_num_data
        log_likelihood = log_likelihood + batch_log_likelihood
        seen += examples
    # data-parallel (torchrun): every rank passed over its shard; add the passes up
    if curvature is not None:
        curvature.synchronise()
    seen, log_likelihood = distributed.sum_across_ranks(seen, log_likelihood)
    if score is not None:
        distributed.all_reduce_(score)
    # One scaling for every structure: the pass's sums stand for N examples.
    scale = num_data / seen
    if score is not None:
        score = {name: total * scale for name, total in zip(jacobians.values, score)}
    return log_likelihood * scale, score, num_data, seen, jacobians


def _batch(jacobians, args, kwargs, curvature, score) -> tuple[torch.Tensor, int, int]:
    """One batch of :func:`data_pass`: its log likelihood, ``num_data`` and size.

    Adds the batch's curvature to ``curvature`` (if given) and its log likelihood's
    gradient to ``score`` (if given). The run and its graph live only in this call:
    held into the next batch's forward, they would double the activations' memory.
    """
    run = jacobians(args, kwargs)
    observation = run.observation
    log_likelihood = observation.log_likelihood()
    if score is not None:  # first: the curvature's backward frees the run's graph
        leaves = list(jacobians.values.values())
        grads = torch.autograd.grad(
            log_likelihood, leaves, allow_unused=True, retain_graph=curvature is not None
        )
        for total, grad in zip(score, grads):
            if grad is not None:
                total += grad
    if curvature is not None:
        columns = observation.columns(curvature.fisher, curvature.num_samples)
        curvature.update(run.gradients(columns))
    return log_likelihood.detach(), observation.num_data, observation.num_examples
