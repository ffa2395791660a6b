r"""The exact Hessian of a model's log joint, for models without per-example structure.

Every curvature of :mod:`~pyro_bdl.inference.laplace.curvature` is a sum over examples
of :math:`J_i^\top V_i V_i^\top J_i` through one likelihood's natural parameter, with a
Gaussian (or elementwise) prior beside it. A model may have none of that: a latent scale
of the likelihood (the regression tutorial's ``sigma``), a hierarchical prior (eight
schools' ``theta ~ Normal(mu, tau)``), a constrained site, several likelihood terms.
For these ``LaplaceGuide(curvature="full")`` does what Pyro's
``AutoLaplaceApproximation`` does: it takes the Hessian of the log joint

.. math::

    \Phi(z) = \log p(\mathcal{D}, x) + \log\Big|\frac{\partial x}{\partial z}\Big|,
    \qquad x = T(z),

in the unconstrained space of :mod:`~pyro_bdl.inference.sites`, and the posterior
precision is :math:`P = -\nabla^2 \Phi(z^*)` at the mode. :class:`LogJointPass` computes
:math:`\Phi` and its derivatives over one pass of the data (DataLoader batches or the
chunks of the model's own subsample plate, see
:class:`~pyro_bdl.inference.minibatch.DataPass`):
each run's log density is Pyro's, site scales and masks included, the likelihood of a
subsampled plate divided by the plate's scale :math:`N / B` so that the runs add up to
the whole data set once, and every other term (priors, the Jacobian, a global
observation) averaged over the runs. The Hessian takes one backward pass per entry of
:math:`z` and per run, so this is for small models (``Full(max_params=...)``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from tqdm.auto import tqdm

from pyro_bdl import distributed
from pyro_bdl.inference.laplace.curvature.full import FullBlock
from pyro_bdl.inference.log_joint import LogJoint
from pyro_bdl.inference.minibatch import DataPass
from pyro_bdl.inference.sites import LatentSites

__all__ = ["LogJointPass", "HessianBlock"]

# Hessian rows computed in one batched double-backward pass (bounds its memory).
_ROWS_PER_BACKWARD = 256


class HessianBlock(FullBlock):
    """A dense posterior precision that is the whole negative Hessian :math:`-\\nabla^2\\Phi`.

    The prior is inside :math:`\\Phi`, so there is no prior precision to add: ``delta`` is
    ignored by every method. Away from a mode (while the fit still moves) the Hessian may
    be indefinite; the block then holds it with its eigenvalues replaced by their
    absolute values (floored at ``1e-8`` of the largest), a metric that whitens the
    search for the mode as the Hessian does near it (the saddle-free Newton metric,
    Dauphin et al. 2014). At a mode the two are the same matrix; the attribute
    ``hessian`` keeps the true one.

    :param dict shapes: site -> unconstrained shape.
    :param torch.Tensor hessian: :math:`-\\nabla^2\\Phi`, ``(d, d)``.
    """

    def __init__(self, shapes, hessian: torch.Tensor):
        self.hessian = hessian
        eigenvalues, eigenvectors = torch.linalg.eigh(hessian)
        if bool(eigenvalues[0] > 0):
            metric = hessian
        else:
            floor = 1e-8 * eigenvalues.abs().max().clamp(min=torch.finfo(hessian.dtype).tiny)
            magnitudes = eigenvalues.abs().clamp(min=floor)
            metric = (eigenvectors * magnitudes) @ eigenvectors.mT
        super().__init__(shapes, metric)

    def _flat_delta(self, delta):
        return self.curvature.new_zeros(self.curvature.shape[0])

    def tensors(self):
        return {"full.hessian": self.hessian}


class _PassTerms(LogJoint):
    """The log joint of one run, split into the subsampled likelihood and the rest."""

    def __init__(self, values: dict[str, torch.Tensor]):
        super().__init__(values)
        self.subsampled: torch.Tensor | float = 0.0
        self.other: torch.Tensor | float = 0.0
        self.num_data: int | None = None
        self.batch_size: int | None = None

    def _add(self, msg: dict, log_prob: torch.Tensor) -> None:
        frames = [
            f for f in msg["cond_indep_stack"] if f.full_size is not None and f.full_size != f.size
        ]
        if msg["name"] in self._latent or not frames:
            self.other = self.other + log_prob
            return
        factor = math.prod(f.full_size / f.size for f in frames)
        self.subsampled = self.subsampled + log_prob / factor
        if self.num_data is None:
            self.num_data, self.batch_size = frames[0].full_size, frames[0].size


class LogJointPass:
    """:math:`\\Phi` over one pass of the data, with its gradient and Hessian if asked.

    Example::

        log_joint = LogJointPass(model, sites, DataPass(model, args, kwargs))
        value, grad, hessian = log_joint(sites.pack(z), order=2)

    :param callable model: the Pyro model.
    :param LatentSites sites: its latent sites.
    :param DataPass data: the pass over its data.
    """

    def __init__(self, model: Callable, sites: LatentSites, data: DataPass):
        self.model, self.sites, self.data = model, sites, data
        #: the data-set size the likelihood is scaled to (None: no subsampled likelihood)
        self.num_data: int | None = None

    def __call__(self, flat: torch.Tensor, order: int = 0, progress: bool = False):
        """:math:`\\Phi`, and its gradient (``order >= 1``) and Hessian (``order == 2``) in
        the flat unconstrained vector ``flat``; None for the ones not asked.

        :param bool progress: show a progress bar over the pass.
        """
        runs = self.data.runs * distributed.world_size()
        totals = [torch.zeros((), dtype=flat.dtype, device=flat.device)]
        if order >= 1:
            totals.append(torch.zeros_like(flat))
        if order == 2:
            totals.append(flat.new_zeros(len(flat), len(flat)))
        seen = 0
        bar = tqdm(
            self.data,
            total=self.data.runs,
            desc="Laplace exact Hessian" if order == 2 else "log joint",
            disable=not progress,
            leave=False,
        )
        for args, kwargs, context in bar:
            z = flat.detach().requires_grad_(order > 0)
            values, log_jacobian = self.sites.constrain(self.sites.unpack(z))
            with torch.set_grad_enabled(order > 0), context, _PassTerms(values) as terms:
                self.model(*args, **kwargs)
            run = terms.subsampled + (terms.other + log_jacobian) / runs
            if terms.num_data is not None:
                self.num_data = terms.num_data
                plate = self.data.plate
                seen += plate.kept if plate is not None else terms.batch_size
            for total, derivative in zip(totals, _derivatives(run, z, order)):
                total += derivative
        seen, *_ = distributed.sum_across_ranks(seen)
        distributed.all_reduce_(totals)
        if self.num_data is not None and seen != self.num_data:
            raise ValueError(
                f"LaplaceGuide: one pass over the data saw {seen:g} examples, but the "
                f"likelihood is scaled to {self.num_data} (its plate's size); the exact "
                "Hessian needs every example once: use a DataLoader without drop_last, and "
                "a plate of the data set's size"
            )
        return tuple(totals) + (None,) * (2 - order)


def _derivatives(value, z: torch.Tensor, order: int) -> list[torch.Tensor]:
    """``[value, grad, hessian][: order + 1]`` of a scalar in ``z``."""
    value = torch.as_tensor(value, dtype=z.dtype, device=z.device)
    if order == 0 or not value.requires_grad:
        zeros = [torch.zeros_like(z), z.new_zeros(len(z), len(z))]
        return [value.detach(), *zeros[:order]]
    (grad,) = torch.autograd.grad(value, z, create_graph=order == 2)
    if order == 1:
        return [value.detach(), grad.detach()]
    return [value.detach(), grad.detach(), _jacobian(grad, z)]


def _jacobian(grad: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """The Jacobian of ``grad`` in ``z``, batched over rows where autograd can."""
    if not grad.requires_grad:  # the log joint is linear in z
        return z.new_zeros(len(z), len(z))
    rows = []
    eye = torch.eye(len(z), dtype=z.dtype, device=z.device)
    for start in range(0, len(z), _ROWS_PER_BACKWARD):
        block = eye[start : start + _ROWS_PER_BACKWARD]
        try:
            (part,) = torch.autograd.grad(
                grad, z, block, retain_graph=True, is_grads_batched=True, allow_unused=True
            )
        except RuntimeError:  # an operation without a batching rule: one row at a time
            part = torch.stack([_row(grad, z, row) for row in block])
        rows.append(torch.zeros_like(block) if part is None else part)
    return torch.cat(rows)


def _row(grad: torch.Tensor, z: torch.Tensor, direction: torch.Tensor) -> torch.Tensor:
    (row,) = torch.autograd.grad(grad, z, direction, retain_graph=True, allow_unused=True)
    return torch.zeros_like(z) if row is None else row
