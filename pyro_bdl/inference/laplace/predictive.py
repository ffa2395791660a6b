r"""Class probabilities from the linearised (GLM) predictive.

Linearising the network at the MAP, :math:`f_\theta(x_*) \approx f_{\theta_\text{MAP}}(x_*)
+ J_*(\theta - \theta_\text{MAP})`, turns the Gaussian posterior into a Gaussian over the
logits, :math:`f(x_*) \sim \mathcal{N}(f_{\theta_\text{MAP}}(x_*), \Lambda)` with
:math:`\Lambda = J_* \Sigma J_*^\top` (Laplace-LoRA eqs. 10-12, 15-16). ``linearize`` gives
:math:`\Lambda` from one vector-Jacobian product per class, at the model linearised by
the fit's last curvature pass (a :class:`~.approximation.LaplaceFit`); this module maps
:math:`(f, \Lambda)` to class probabilities (``glm_predictive`` is
:meth:`~pyro_bdl.inference.LaplaceGuide.predictive`):

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
from tqdm.auto import tqdm

from pyro_bdl._checks import instance, integer, one_of
from pyro_bdl.inference.laplace.approximation import LaplaceFit
from pyro_bdl.inference.minibatch import Minibatches

__all__ = [
    "LINKS",
    "probit",
    "laplace_bridge",
    "mc_probabilities",
    "linearize",
    "output_distribution",
    "glm_predictive",
]

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


def one_pass(args: tuple, kwargs: dict, desc: str, progress: bool):
    """The batches of one pass over the model's arguments, behind a progress bar."""
    batches = Minibatches(args, kwargs)
    return tqdm(
        batches.one_pass(),
        total=batches.batches_per_epoch,
        desc=desc,
        disable=not progress,
        leave=False,
    )


def link_probabilities(link, mean, covariance, num_samples, generator, contrasts=True):
    """Class probabilities of the logits' Gaussian (MC: the draws, ``(S, B, C)``).

    With ``contrasts`` the MC link's Gaussian is that of the contrasts :math:`f_k - f_C`,
    :math:`k < C` (see :func:`linearize`); otherwise, as for the other links, of the logits.
    """
    if link == "mc":
        if contrasts:
            padded = torch.nn.functional.pad
            mean, covariance = padded(mean, (0, 1)), padded(covariance, (0, 1, 0, 1))
        return mc_probabilities(mean, covariance, num_samples, generator)
    if link == "probit":
        return probit(mean, covariance)
    return laplace_bridge(mean, covariance)


def linearize(fit: LaplaceFit, args: tuple, kwargs: dict, contrasts: bool = False):
    """The linearised outputs at the MAP, their per-example Jacobian rows, the run.

    With ``contrasts`` the outputs are the ``C - 1`` logit differences
    :math:`f_k - f_C`: the softmax is shift invariant, so their Gaussian carries the
    whole MC predictive at one vector-Jacobian product fewer per batch.

    :param fit: the fit, whose model linearised at the MAP is run.
    """
    fit.require_structure("the linearised (GLM) predictive")
    run = fit.jacobians(args, kwargs, output="return")
    output = run.output
    if output.dim() != 2:
        raise ValueError(
            "the linearised predictive needs a model returning logits shaped "
            f"(batch, classes), got shape {tuple(output.shape)}"
        )
    rows = torch.eye(output.shape[1], dtype=output.dtype, device=output.device)
    if contrasts:
        rows = rows[:-1] - rows[-1]
    columns = rows.unsqueeze(1).expand(len(rows), *output.shape)
    return output.detach() @ rows.mT, run.gradients(columns), run


def output_distribution(fit: LaplaceFit, args: tuple, kwargs: dict, delta) -> tuple:
    """:meth:`LaplaceGuide.output_distribution <.guide.LaplaceGuide.output_distribution>`
    at the prior precision ``delta``."""
    means, covariances = [], []
    for batch_args, batch_kwargs in Minibatches(args, kwargs).one_pass():
        mean, grads, _ = linearize(fit, batch_args, batch_kwargs)
        means.append(mean)
        covariances.append(fit.output_covariance(grads, delta))
    return torch.cat(means), torch.cat(covariances)


def glm_predictive(
    fit: LaplaceFit,
    args,
    kwargs,
    *,
    link,
    num_samples,
    return_samples,
    generator,
    prior_precision,
    progress,
) -> torch.Tensor:
    """:meth:`LaplaceGuide.predictive <.guide.LaplaceGuide.predictive>` (``link`` None:
    the fit's) at ``prior_precision`` (None: the fit's)."""
    link = one_of("link", fit.link if link is None else link, LINKS)
    num_samples = integer("num_samples", num_samples, low=1)
    instance("return_samples", return_samples, bool, "True or False")
    if generator is not None:
        instance("generator", generator, torch.Generator, "a torch.Generator or None")
    instance("progress", progress, bool, "True or False")
    if return_samples and link != "mc":
        raise ValueError(f"return_samples=True needs link='mc', got link={link!r}")
    delta = fit.resolve(prior_precision)
    results = []
    for batch_args, batch_kwargs in one_pass(args, kwargs, "GLM predictive", progress):
        mean, grads, _ = linearize(fit, batch_args, batch_kwargs, contrasts=link == "mc")
        covariance = fit.output_covariance(grads, delta)
        probs = link_probabilities(link, mean, covariance, num_samples, generator)
        results.append(probs if return_samples or link != "mc" else probs.mean(0))
    return torch.cat(results, dim=-2)
