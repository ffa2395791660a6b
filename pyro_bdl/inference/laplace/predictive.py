r"""Class probabilities from the linearised (GLM) predictive.

Linearising the network at the MAP, :math:`f_\theta(x_*) \approx f_{\theta_\text{MAP}}(x_*)
+ J_*(\theta - \theta_\text{MAP})`, turns the Gaussian posterior into a Gaussian over the
logits, :math:`f(x_*) \sim \mathcal{N}(f_{\theta_\text{MAP}}(x_*), \Lambda)` with
:math:`\Lambda = J_* \Sigma J_*^\top` (Laplace-LoRA eqs. 10-12, 15-16). The guide computes
:math:`\Lambda` from one vector-Jacobian product per class; this module maps
:math:`(f, \Lambda)` to class probabilities:

* ``"mc"`` (Appendix A.1, eq. 17): average the softmax of :math:`S` joint logit samples
  :math:`f + L\xi`, :math:`L L^\top = \Lambda`, the approximation Laplace-LoRA found best;
* ``"probit"`` (A.2, eq. 18): :math:`\operatorname{softmax}(f / \sqrt{1 + \frac{\pi}{8}
  \operatorname{diag}\Lambda})`;
* ``"bridge"`` (A.3, eq. 20): the mean of the Laplace-bridge Dirichlet,
  :math:`\alpha_i = \Lambda_{ii}^{-1} (1 - 2/C + e^{f_i} C^{-2} \sum_j e^{-f_j})`.

**References**

- A. X. Yang, M. Robeyns, X. Wang, L. Aitchison, *Bayesian low-rank adaptation for large
  language models*, ICLR 2024 (Laplace-LoRA), Appendix A.
- M. Hobbhahn, A. Kristiadi, P. Hennig, *Fast predictive uncertainty for classification
  with Bayesian deep networks*, UAI 2022 (the Laplace bridge).
"""

from __future__ import annotations

import math

import torch

__all__ = ["LINKS", "probit", "laplace_bridge", "mc_probabilities"]

LINKS = ("mc", "probit", "bridge")


def probit(mean: torch.Tensor, covariance: torch.Tensor) -> torch.Tensor:
    """The generalised probit approximation (eq. 18), ``(B, C)``.

    :param torch.Tensor mean: logits :math:`f`, ``(B, C)``.
    :param torch.Tensor covariance: :math:`\\Lambda`, ``(B, C, C)``.
    """
    variance = covariance.diagonal(dim1=-2, dim2=-1)
    return torch.softmax(mean / (1 + math.pi / 8 * variance).sqrt(), -1)


def laplace_bridge(mean: torch.Tensor, covariance: torch.Tensor) -> torch.Tensor:
    """The mean of the Laplace-bridge Dirichlet (eq. 20), ``(B, C)``."""
    num_classes = mean.shape[-1]
    variance = covariance.diagonal(dim1=-2, dim2=-1)
    # e^{f_i} sum_j e^{-f_j}, computed in log space
    cross = torch.exp(mean + torch.logsumexp(-mean, -1, keepdim=True))
    alpha = (1 - 2 / num_classes + cross / num_classes**2) / variance
    return alpha / alpha.sum(-1, keepdim=True)


def mc_probabilities(
    mean: torch.Tensor,
    covariance: torch.Tensor,
    num_samples: int,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Softmax of ``num_samples`` joint logit draws (eq. 17), ``(S, B, C)``.

    The square root of :math:`\\Lambda` comes from its eigendecomposition, which, unlike
    a Cholesky factor, exists for every positive semi-definite :math:`\\Lambda`.
    """
    values, vectors = torch.linalg.eigh(covariance)
    root = vectors * values.clamp(min=0).sqrt().unsqueeze(-2)
    noise = torch.randn(
        num_samples, *mean.shape, dtype=mean.dtype, device=mean.device, generator=generator
    )
    return torch.softmax(mean + (noise.unsqueeze(-2) @ root.mT).squeeze(-2), -1)
