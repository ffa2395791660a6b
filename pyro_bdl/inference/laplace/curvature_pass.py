r"""The pass over the data that turns a point into a Laplace approximation.

At the guide's point :math:`\theta` (its ``_loc``) one pass over the model's batches
accumulates the curvature :math:`H` of the log likelihood (see
:mod:`~pyro_bdl.inference.laplace.curvature`), the log likelihood and, for the mode check,
the log joint's gradient; a model without the GGN's structure gets the exact Hessian of
its log joint instead (:mod:`~pyro_bdl.inference.laplace.hessian`). What the pass leaves
is one explicit :class:`CurvaturePass`, which the guide adopts as its fitted state:
the blocks, the evidence's log likelihood, ``num_data``, the gradient, and the model
linearised at the point (:class:`~.jacobians.ModelJacobians`), which the linearised
predictive reuses (which sites' factored gradients passed their check is learnt once).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from pyro_bdl import distributed
from pyro_bdl.inference.laplace.hessian import HessianBlock, LogJointPass
from pyro_bdl.inference.laplace.jacobians import ModelJacobians
from pyro_bdl.inference.laplace.model_prior import (
    log_joint_gradient,
    prior_curvature,
    use_exact_hessian,
)
from pyro_bdl.inference.laplace.observation import StructureError
from pyro_bdl.inference.minibatch import DataPass

__all__ = ["CurvaturePass", "accumulate", "data_pass"]


@dataclass
class CurvaturePass:
    """What a curvature pass at a point gives the guide.

    :ivar list blocks: the curvature blocks (scaled to the whole data set).
    :ivar log_likelihood: the log likelihood at the point (an exact-Hessian fit: the
        whole log joint).
    :ivar int num_data: :math:`N`.
    :ivar dict gradient: the log joint's gradient per site, or None (not asked).
    :ivar jacobians: the model linearised at the point, for the linearised predictive
        (None for an exact-Hessian fit, which has no such structure).
    """

    blocks: list
    log_likelihood: torch.Tensor
    num_data: int
    gradient: dict[str, torch.Tensor] | None
    jacobians: ModelJacobians | None

    def adopt(self, guide) -> None:
        """Make this the guide's fitted state."""
        guide._blocks = self.blocks
        guide._log_likelihood = self.log_likelihood
        guide.num_data = self.num_data
        guide._gradient = self.gradient
        guide._jacobians = self.jacobians


def accumulate(guide, model: Callable, batches: DataPass, progress: bool, gradient: bool):
    """The curvature pass at ``guide._loc`` (with the log joint's gradient if asked)."""
    if guide.exact_hessian_reason is None:
        try:
            _accumulate_structured(guide, model, batches, progress, gradient)
            return
        except StructureError as error:  # learnt from the first batch's likelihood
            use_exact_hessian(guide, str(error).removeprefix("LaplaceGuide: "))
    _accumulate_exact(guide, model, batches, progress)


def _accumulate_structured(guide, model, batches, progress, gradient) -> None:
    curvature = guide.curvature
    curvature.begin(guide._loc)
    guide._prior_precision.update(prior_curvature(guide, guide._loc))
    log_likelihood, score, num_data, seen, jacobians = data_pass(
        model, batches, guide._loc, curvature, gradient, progress
    )
    result = CurvaturePass(
        curvature.blocks(num_data / seen), log_likelihood, num_data, None, jacobians
    )
    result.adopt(guide)
    for block in result.blocks:
        try:
            block.check_prior(guide._prior_precision)
        except ValueError as error:
            other = next((name for name in block.sites if name in guide._other_priors), None)
            if other is None:
                raise
            fn = guide.sites[other].prior_name
            raise ValueError(
                f"{error}. The prior of {other!r} is a {fn}, not a Normal: its curvature "
                "differs from entry to entry, which K-FAC cannot hold; use "
                "curvature='diag_ggn' or 'full'"
            ) from None
    guide._gradient = None if score is None else log_joint_gradient(guide, score, guide._loc)


def _accumulate_exact(guide, model, batches, progress) -> None:
    """The exact Hessian of the log joint at ``guide._loc`` (see :mod:`.hessian`)."""
    log_joint = LogJointPass(model, guide.sites, batches)
    value, grad, hessian = log_joint(guide.sites.pack(guide._loc), order=2, progress=progress)
    shapes = {name: site.unconstrained_shape for name, site in guide.sites.items()}
    # the log likelihood is the whole log joint: the evidence's other terms
    blocks = [HessianBlock(shapes, -hessian)]
    CurvaturePass(blocks, value, log_joint.num_data, guide.sites.unpack(grad), None).adopt(guide)


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
