"""Predictive metrics for classifiers: accuracy, NLL, ECE, Brier, AUROC, and the split of
predictive uncertainty into aleatoric and epistemic parts.

Every metric takes class probabilities ``probs`` shaped ``(batch, classes)`` (already averaged
over posterior samples for a Bayesian predictive) and integer ``labels`` shaped ``(batch,)``,
as torch tensors or numpy arrays. Scalar metrics return Python floats; per-example ones
return tensors.

Example::

    probs = Predictive(model, guide=guide, num_samples=20)(batch)["probs"]  # (S, B, C)
    summarize(probs.mean(0), batch["labels"])   # accuracy, nll, ece, brier
    uncertainty_decomposition(probs).epistemic  # (B,), an out-of-distribution score
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch

from pyro_bdl._checks import integer, real

__all__ = [
    "ROW_SUM_ATOL",
    "ReliabilityCurve",
    "UncertaintyDecomposition",
    "accuracy",
    "auroc",
    "brier",
    "ece",
    "nll",
    "reliability_curve",
    "selective_accuracy",
    "summarize",
    "uncertainty_decomposition",
]

#: How far rows of ``probs`` may sum from 1: float32 softmax outputs averaged over samples
#: are off by about 1e-6; anything beyond this is a logit or an unnormalised score.
ROW_SUM_ATOL = 1e-3
_NUM_BINS = 15

ArrayLike = torch.Tensor | np.ndarray


class ReliabilityCurve(NamedTuple):
    """Per-bin mean confidence, accuracy and count of top-label predictions.

    Empty bins have ``nan`` confidence and accuracy. ``bin_edges`` has ``num_bins + 1``
    entries; bin ``b`` holds confidences in ``(edges[b], edges[b + 1]]``.
    """

    confidence: torch.Tensor
    accuracy: torch.Tensor
    count: torch.Tensor
    bin_edges: torch.Tensor

    @property
    def ece(self) -> float:
        r""":math:`\sum_b (n_b / n) |\mathrm{acc}_b - \mathrm{conf}_b|` over non-empty bins."""
        weights = self.count.double() / self.count.sum()  # int / int is float32
        gaps = (self.accuracy - self.confidence).abs()
        return float(torch.where(self.count > 0, weights * gaps, 0.0).sum())


class UncertaintyDecomposition(NamedTuple):
    """Total, aleatoric and epistemic predictive uncertainty (nats), each ``(batch,)``."""

    total: torch.Tensor
    aleatoric: torch.Tensor
    epistemic: torch.Tensor


def accuracy(probs: ArrayLike, labels: ArrayLike) -> float:
    """Fraction of examples whose most probable class is the label.

    Ties go to the lowest class index, as :func:`torch.argmax`.

    Example::

        accuracy(torch.tensor([[0.9, 0.1], [0.4, 0.6]]), torch.tensor([0, 0]))  # 0.5

    :param probs: class probabilities ``(batch, classes)``.
    :type probs: torch.Tensor or numpy.ndarray
    :param labels: integer labels ``(batch,)``.
    :type labels: torch.Tensor or numpy.ndarray
    :rtype: float
    """
    probs, labels = _validate(probs, labels)
    return float((probs.argmax(dim=-1) == labels).double().mean())


def nll(probs: ArrayLike, labels: ArrayLike) -> float:
    r"""Mean negative log-likelihood of the labels, :math:`-\frac1n \sum_i \log p_i(y_i)`.

    Probabilities are clamped below at the smallest positive normal number of their dtype,
    so a zero probability on the label costs :math:`-\log(\text{tiny})` (708 in float64, 87
    in float32) instead of ``inf``.

    Example::

        nll(torch.tensor([[0.5, 0.5], [0.25, 0.75]]), torch.tensor([0, 1]))  # 0.4904

    :param probs: class probabilities ``(batch, classes)``.
    :type probs: torch.Tensor or numpy.ndarray
    :param labels: integer labels ``(batch,)``.
    :type labels: torch.Tensor or numpy.ndarray
    :rtype: float
    """
    probs, labels = _validate(probs, labels)
    label_probs = probs.gather(-1, labels[:, None]).squeeze(-1)
    return float(-label_probs.clamp_min(torch.finfo(probs.dtype).tiny).log().mean())


def brier(probs: ArrayLike, labels: ArrayLike) -> float:
    r"""Multi-class Brier score, :math:`\frac1n \sum_i \sum_c (p_{ic} - [y_i = c])^2`.

    Ranges from 0 (certain and right) to 2 (certain and wrong).

    Example::

        brier(torch.tensor([[1.0, 0.0]]), torch.tensor([1]))  # 2.0

    :param probs: class probabilities ``(batch, classes)``.
    :type probs: torch.Tensor or numpy.ndarray
    :param labels: integer labels ``(batch,)``.
    :type labels: torch.Tensor or numpy.ndarray
    :rtype: float
    """
    probs, labels = _validate(probs, labels)
    one_hot = torch.nn.functional.one_hot(labels, probs.shape[-1]).to(probs.dtype)
    return float(((probs - one_hot) ** 2).sum(dim=-1).mean())


def selective_accuracy(probs: ArrayLike, labels: ArrayLike, coverage: float = 0.8) -> float:
    r"""Accuracy on the ``coverage`` fraction of examples predicted most confidently.

    Selective prediction: a predictor that may abstain answers the
    :math:`\lceil \text{coverage} \cdot n \rceil` examples of highest top-class
    probability and is scored on those. It rewards uncertainty that ranks the errors
    last, which NLL and ECE do not measure: with two classes a temperature changes
    neither the ranking nor this score (with more it can reorder examples whose other
    classes differ). Ties in confidence keep the examples' order.

    Example::

        probs = torch.tensor([[0.9, 0.1], [0.6, 0.4], [0.2, 0.8], [0.55, 0.45]])
        selective_accuracy(probs, torch.tensor([0, 1, 1, 0]), coverage=0.5)  # 1.0

    :param probs: class probabilities ``(batch, classes)``.
    :type probs: torch.Tensor or numpy.ndarray
    :param labels: integer labels ``(batch,)``.
    :type labels: torch.Tensor or numpy.ndarray
    :param float coverage: the fraction of examples answered, in (0, 1].
    :rtype: float
    """
    coverage = real("coverage", coverage, positive=True, high=1.0)
    probs, labels = _validate(probs, labels)
    confidence, predicted = probs.max(dim=-1)
    answered = torch.argsort(confidence, descending=True, stable=True)
    answered = answered[: math.ceil(coverage * labels.numel() - 1e-9)]
    return float((predicted[answered] == labels[answered]).double().mean())


def reliability_curve(
    probs: ArrayLike, labels: ArrayLike, num_bins: int = _NUM_BINS
) -> ReliabilityCurve:
    r"""Bin the top-label confidences into equal-width bins on [0, 1] and compare with accuracy.

    For bin :math:`B_b = (b / M, (b + 1) / M]`,
    :math:`\mathrm{conf}_b = \frac{1}{n_b} \sum_{i \in B_b} \max_c p_{ic}` and
    :math:`\mathrm{acc}_b = \frac{1}{n_b} \sum_{i \in B_b} [\arg\max_c p_{ic} = y_i]`.
    :func:`ece` and :func:`pyro_bdl.plots.reliability_diagram` are built on it.

    **References**

    [1] Guo, C., Pleiss, G., Sun, Y. and Weinberger, K. Q. (2017). On calibration of modern
    neural networks. *ICML*.

    Example::

        curve = reliability_curve(probs, labels)
        curve.accuracy - curve.confidence  # > 0 in under-confident bins

    :param probs: class probabilities ``(batch, classes)``.
    :type probs: torch.Tensor or numpy.ndarray
    :param labels: integer labels ``(batch,)``.
    :type labels: torch.Tensor or numpy.ndarray
    :param int num_bins: number of equal-width confidence bins :math:`M`.
    :rtype: ReliabilityCurve
    """
    num_bins = integer("num_bins", num_bins, low=1)
    probs, labels = _validate(probs, labels)
    confidence, prediction = probs.double().max(dim=-1)
    correct = (prediction == labels).double()
    edges = torch.linspace(0.0, 1.0, num_bins + 1, dtype=torch.float64)
    # Right-closed bins (b / M, (b + 1) / M]; bucketize on the inner edges puts anything
    # above (M - 1) / M, rounding beyond 1 included, in the last bin.
    bins = torch.bucketize(confidence, edges[1:-1])
    count = torch.bincount(bins, minlength=num_bins)
    per_bin = count.double()  # 0 / 0 = nan marks empty bins
    return ReliabilityCurve(
        confidence=torch.bincount(bins, confidence, minlength=num_bins) / per_bin,
        accuracy=torch.bincount(bins, correct, minlength=num_bins) / per_bin,
        count=count,
        bin_edges=edges,
    )


def ece(probs: ArrayLike, labels: ArrayLike, num_bins: int = _NUM_BINS) -> float:
    r"""Expected calibration error of the top-label confidence.

    .. math:: \mathrm{ECE} = \sum_{b=1}^{M} \frac{n_b}{n} |\mathrm{acc}_b - \mathrm{conf}_b|

    over :math:`M` equal-width bins (see :func:`reliability_curve`, reference [1] there).

    Example::

        probs = torch.tensor([[0.75, 0.25]] * 4)
        ece(probs, torch.tensor([0, 0, 0, 1]))  # 0.0: 75% confident, 75% right

    :param probs: class probabilities ``(batch, classes)``.
    :type probs: torch.Tensor or numpy.ndarray
    :param labels: integer labels ``(batch,)``.
    :type labels: torch.Tensor or numpy.ndarray
    :param int num_bins: number of equal-width confidence bins.
    :rtype: float
    """
    return reliability_curve(probs, labels, num_bins).ece


def auroc(scores: ArrayLike, labels: ArrayLike) -> float:
    r"""Area under the ROC curve of ``scores`` for telling positives (label 1) from negatives.

    The probability that a random positive scores higher than a random negative, ties
    counting one half (the Mann-Whitney statistic, equal to the trapezoidal area of
    ``sklearn.metrics.roc_auc_score``):

    .. math:: \mathrm{AUROC} = \frac{\sum_{i: y_i = 1} r_i - n_+ (n_+ + 1) / 2}{n_+ n_-}

    with :math:`r_i` the average ranks of the scores.

    Example::

        # out-of-distribution detection: OOD inputs are the positives
        auroc(torch.cat([eu_in, eu_ood]), torch.cat([torch.zeros(n_in), torch.ones(n_ood)]))

    :param scores: one score per example ``(n,)``; higher means more likely positive.
    :type scores: torch.Tensor or numpy.ndarray
    :param labels: 0 / 1 (or boolean) labels ``(n,)`` with both classes present.
    :type labels: torch.Tensor or numpy.ndarray
    :rtype: float
    """
    scores = _to_numpy(scores, "scores").astype(np.float64)
    labels = _to_numpy(labels, "labels")
    if scores.ndim != 1 or not np.isfinite(scores).all():
        raise ValueError(f"scores must be finite and shaped (n,), got shape {scores.shape}")
    if labels.shape != scores.shape or not np.isin(labels, (0, 1)).all():
        raise ValueError(
            f"labels must be 0 / 1 and shaped like scores {scores.shape}, got shape "
            f"{labels.shape} with values {np.unique(labels)[:5]}"
        )
    positive = labels.astype(bool)
    num_pos, num_neg = int(positive.sum()), int((~positive).sum())
    if num_pos == 0 or num_neg == 0:
        raise ValueError(
            f"labels must contain both classes to define an AUROC, got {num_pos} positives and "
            f"{num_neg} negatives"
        )
    # scipy.stats takes about as long to import as Pyro: only AUROC's users pay for it.
    from scipy.stats import rankdata

    rank_sum = rankdata(scores)[positive].sum()
    return float((rank_sum - num_pos * (num_pos + 1) / 2) / (num_pos * num_neg))


def uncertainty_decomposition(probs: ArrayLike) -> UncertaintyDecomposition:
    r"""Split the predictive entropy into aleatoric and epistemic uncertainty.

    With :math:`S` posterior samples of the class probabilities :math:`p_s(y \mid x)`,

    .. math:: \mathrm{TU} = H\Big[\frac1S \sum_s p_s\Big], \quad
              \mathrm{AU} = \frac1S \sum_s H[p_s], \quad \mathrm{EU} = \mathrm{TU} - \mathrm{AU},

    eq. (2) of [1]: EU is the mutual information between the label and the parameters,
    zero when all samples agree. Entropies use :math:`0 \log 0 = 0`; rounding below zero
    in EU is clamped, since a mutual information is non-negative.

    **References**

    [1] Duffield, S., Donatella, K., Chiu, J., Klett, P. and Simpson, D. (2024). Scalable
        Bayesian learning with posteriors.

    Example::

        probs = torch.softmax(torch.stack([net(x) for net in ensemble]), dim=-1)  # (S, B, C)
        uncertainty_decomposition(probs).epistemic  # (B,)

    :param probs: class probabilities ``(samples, batch, classes)``.
    :type probs: torch.Tensor or numpy.ndarray
    :rtype: UncertaintyDecomposition
    """
    probs = _validate_probs(probs, ("samples", "batch", "classes"))
    total = _entropy(probs.mean(dim=0))
    aleatoric = _entropy(probs).mean(dim=0)
    return UncertaintyDecomposition(total, aleatoric, (total - aleatoric).clamp_min(0.0))


def summarize(probs: ArrayLike, labels: ArrayLike, num_bins: int = _NUM_BINS) -> dict[str, float]:
    """Accuracy, NLL, ECE and Brier score in one dict, as the experiments report them.

    Example::

        summarize(probs, labels)  # {"accuracy": 0.91, "nll": 0.27, "ece": 0.03, "brier": 0.14}

    :param probs: class probabilities ``(batch, classes)``.
    :type probs: torch.Tensor or numpy.ndarray
    :param labels: integer labels ``(batch,)``.
    :type labels: torch.Tensor or numpy.ndarray
    :param int num_bins: number of confidence bins of the ECE.
    :rtype: dict
    """
    num_bins = integer("num_bins", num_bins, low=1)
    probs, labels = _validate(probs, labels)
    return {
        "accuracy": accuracy(probs, labels),
        "nll": nll(probs, labels),
        "ece": ece(probs, labels, num_bins),
        "brier": brier(probs, labels),
    }


def _entropy(probs: torch.Tensor) -> torch.Tensor:
    """Entropy over the last axis in nats, with 0 log 0 = 0."""
    return -torch.special.xlogy(probs, probs).sum(dim=-1)


def _to_numpy(value: ArrayLike, name: str) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    if isinstance(value, np.ndarray):
        return value
    raise TypeError(f"{name} must be a torch.Tensor or numpy.ndarray, got {type(value).__name__}")


def _to_tensor(value: ArrayLike, name: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach()
    return torch.from_numpy(_to_numpy(value, name))


def _validate_probs(probs: ArrayLike, dims: tuple[str, ...] = ("batch", "classes")) -> torch.Tensor:
    """Check that ``probs`` is floating, shaped ``dims``, with rows on the simplex."""
    probs = _to_tensor(probs, "probs")
    requirement = f"probs must be ({', '.join(dims)}) with rows summing to 1"
    if probs.dim() != len(dims) or probs.shape[-1] == 0:
        raise ValueError(f"{requirement}, got shape {tuple(probs.shape)}")
    if not probs.is_floating_point():
        raise ValueError(f"{requirement}, got dtype {probs.dtype}; pass probabilities, not labels")
    if probs.numel() and (
        not torch.isfinite(probs).all()
        or (probs < 0).any()
        or ((probs.sum(dim=-1) - 1).abs() > ROW_SUM_ATOL).any()
    ):
        raise ValueError(
            f"{requirement} and entries in [0, 1]; got row sums in "
            f"[{float(probs.sum(-1).min()):.4g}, {float(probs.sum(-1).max()):.4g}], "
            "apply torch.softmax to logits first"
        )
    return probs


def _validate(probs: ArrayLike, labels: ArrayLike) -> tuple[torch.Tensor, torch.Tensor]:
    """Validated ``probs`` (batch, classes) and int64 ``labels`` (batch,) on the same device."""
    probs = _validate_probs(probs)
    labels = _to_tensor(labels, "labels")
    if labels.dim() != 1 or labels.is_floating_point() or labels.is_complex():
        raise ValueError(
            f"labels must be integer class indices shaped (batch,), got shape "
            f"{tuple(labels.shape)} and dtype {labels.dtype}"
        )
    if labels.shape[0] != probs.shape[0]:
        raise ValueError(
            f"labels and probs must have the same batch size, got {labels.shape[0]} labels "
            f"and {probs.shape[0]} rows of probs"
        )
    if labels.numel() == 0:
        raise ValueError("probs and labels are empty; metrics need at least one example")
    num_classes = probs.shape[-1]
    if labels.min() < 0 or labels.max() >= num_classes:
        raise ValueError(
            f"labels must be in [0, {num_classes - 1}] for probs with {num_classes} classes, "
            f"got values in [{int(labels.min())}, {int(labels.max())}]"
        )
    return probs, labels.to(device=probs.device, dtype=torch.long)
