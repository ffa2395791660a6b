r"""The Laplace evidence and the prior precision that maximises it.

For a Gaussian prior :math:`\mathcal{N}(\mu_0, \operatorname{diag}(\delta)^{-1})` the
Laplace approximation of the log marginal likelihood is (Laplace-LoRA eq. 13, MacKay
1992, Daxberger et al. 2021)

.. math::

    \log p(\mathcal{D}) \approx \log p(\mathcal{D} \mid \theta_\text{MAP})
        + \log p(\theta_\text{MAP}) + \frac{d}{2} \log 2\pi
        - \frac{1}{2} \log\det P,
    \qquad P = H + \operatorname{diag}(\delta),

the prior's :math:`-\frac{d}{2}\log 2\pi` cancelling the third term. It is exact for a
linear-Gaussian model. (The ``bayesian-lora`` package writes it with the opposite sign
of the log determinant and an unnormalised prior; we follow the formula.) Changing
:math:`\delta` changes only the prior term and :math:`\log\det P`, both cheap given the
curvature's factorisation, so :math:`\delta` is tuned by gradient ascent on
:math:`\log \delta` without refitting.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import torch

from pyro_bdl.inference.laplace.curvature.base import GaussianBlock

__all__ = ["log_marginal_likelihood", "maximise_evidence"]

#: The evidence counts as maximised when, for every group of sites, the gradient of the log
#: evidence in :math:`\log\delta` is below this fraction of its scale :math:`d_g / 2`
#: (:math:`d_g` weights; the derivative of the prior's :math:`\frac{d_g}{2}\log\delta`).
CONVERGENCE_TOLERANCE = 1e-2
#: Adam stops early once every group's relative gradient is below this (near the maximum
#: it is about the relative error of :math:`\delta`).
STOPPING_TOLERANCE = 1e-6


def log_marginal_likelihood(
    log_likelihood: torch.Tensor,
    blocks: list[GaussianBlock],
    loc: dict[str, torch.Tensor],
    prior_loc: dict[str, torch.Tensor],
    prior_precision: dict[str, torch.Tensor],
) -> torch.Tensor:
    """The Laplace evidence, differentiable in ``prior_precision``.

    :param torch.Tensor log_likelihood: :math:`\\log p(\\mathcal{D} \\mid \\theta_\\text{MAP})`
        summed over the whole data set, plus the log prior at :math:`\\theta_\\text{MAP}` of
        the sites that have no Gaussian prior term here.
    :param list blocks: the posterior precision's blocks (curvature :math:`H`).
    :param dict loc: :math:`\\theta_\\text{MAP}` per site (every site: :math:`d` counts them).
    :param dict prior_loc: :math:`\\mu_0` per site with the Gaussian prior
        :math:`\\mathcal{N}(\\mu_0, \\delta^{-1})` (a site left out has its log prior in
        ``log_likelihood``).
    :param dict prior_precision: :math:`\\delta` per site, broadcastable to the site.
    """
    log_prior = 0.0
    gaussian = 0
    for site, mean in prior_loc.items():
        value = loc[site]
        delta = prior_precision[site].expand(value.shape)
        log_prior = log_prior + 0.5 * (delta.log().sum() - (delta * (value - mean).square()).sum())
        gaussian += value.numel()
    log_prior = log_prior - 0.5 * gaussian * math.log(2 * math.pi)
    num_params = sum(value.numel() for value in loc.values())
    log_det = sum(block.log_det(prior_precision) for block in blocks)
    return log_likelihood + log_prior + 0.5 * num_params * math.log(2 * math.pi) - 0.5 * log_det


def maximise_evidence(
    evidence: Callable[[dict[str, torch.Tensor]], torch.Tensor],
    groups: dict[str, list[str]],
    init: dict[str, torch.Tensor],
    num_steps: int,
    lr: float,
    sizes: dict[str, int] | None = None,
) -> dict[str, torch.Tensor]:
    """Adam on :math:`\\log\\delta`, one scalar per group of sites.

    With ``sizes``, the gradient :math:`\\partial \\log p(\\mathcal{D}) / \\partial
    \\log\\delta_g` of each group is compared with its scale :math:`d_g / 2`: Adam stops
    before ``num_steps`` once every ratio is below :data:`STOPPING_TOLERANCE`, and a group
    whose ratio after the last step exceeds :data:`CONVERGENCE_TOLERANCE` gets a warning
    naming it (the prior precision is not at the evidence's maximum yet).

    :param callable evidence: prior precision (site -> tensor) -> log evidence.
    :param dict groups: group name -> the sites sharing one :math:`\\delta`.
    :param dict init: group name -> initial :math:`\\delta`.
    :param dict sizes: site -> number of weights (for the convergence check).
    :return: site -> the optimised :math:`\\delta` (a 0-dim tensor).
    """
    log_delta = {g: init[g].detach().log().clone().requires_grad_() for g in groups}
    optimiser = torch.optim.Adam(list(log_delta.values()), lr=lr)

    def per_site() -> dict[str, torch.Tensor]:
        return {site: log_delta[g].exp() for g, sites in groups.items() for site in sites}

    scale = None
    if sizes is not None:
        scale = torch.stack(
            [
                torch.as_tensor(0.5 * sum(sizes[site] for site in sites), dtype=torch.float64)
                for sites in groups.values()
            ]
        )
    for _ in range(num_steps):
        optimiser.zero_grad()
        (-evidence(per_site())).backward()
        if scale is not None and _largest(log_delta, scale)[1] < STOPPING_TOLERANCE:
            break
        optimiser.step()
    if scale is not None:
        _check_stationary(evidence, per_site, log_delta, scale, num_steps, lr)
    return {site: value.detach() for site, value in per_site().items()}


def _largest(log_delta: dict[str, torch.Tensor], scale: torch.Tensor) -> tuple[str, float]:
    """The group with the largest gradient relative to its scale, and that ratio."""
    gradients = torch.stack([value.grad.detach().double().cpu() for value in log_delta.values()])
    relative = gradients.abs() / scale
    worst = int(relative.argmax())
    return list(log_delta)[worst], float(relative[worst])


def _check_stationary(evidence, per_site, log_delta, scale, num_steps, lr) -> None:
    for value in log_delta.values():
        value.grad = None
    evidence(per_site()).backward()
    worst, relative = _largest(log_delta, scale)
    if relative > CONVERGENCE_TOLERANCE:
        warnings.warn(
            f"optimize_prior_precision: the evidence is not maximised after num_steps="
            f"{num_steps} (lr={lr}): its gradient in log delta for {worst!r} is "
            f"{relative:.2g} of its scale d/2 (tolerance {CONVERGENCE_TOLERANCE}); "
            "raise num_steps",
            RuntimeWarning,
            stacklevel=5,  # LaplaceGuide.optimize_prior_precision's caller
        )
