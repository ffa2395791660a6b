import math

import numpy as np
import pytest
import torch
from sklearn.metrics import roc_auc_score

from pyro_bdl import metrics


def tensor(values):
    return torch.tensor(values, dtype=torch.float64)


def test_accuracy_by_hand():
    probs = tensor([[0.9, 0.1], [0.4, 0.6], [0.3, 0.7]])
    # predictions 0, 1, 1 against labels 0, 0, 1: two of three right
    assert metrics.accuracy(probs, torch.tensor([0, 0, 1])) == pytest.approx(2 / 3)


def test_nll_by_hand():
    probs = tensor([[0.5, 0.5], [0.25, 0.75]])
    # -(log 0.5 + log 0.75) / 2
    expected = (math.log(2) + math.log(4 / 3)) / 2
    assert metrics.nll(probs, torch.tensor([0, 1])) == pytest.approx(expected, rel=1e-12)


def test_nll_of_a_zero_probability_is_finite():
    value = metrics.nll(tensor([[1.0, 0.0]]), torch.tensor([1]))
    assert value == pytest.approx(-math.log(torch.finfo(torch.float64).tiny))


def test_brier_by_hand():
    probs = tensor([[0.7, 0.2, 0.1], [0.2, 0.5, 0.3]])
    # (0.3^2 + 0.2^2 + 0.1^2 = 0.14) and (0.2^2 + 0.5^2 + 0.7^2 = 0.78), mean 0.46
    assert metrics.brier(probs, torch.tensor([0, 2])) == pytest.approx(0.46, rel=1e-12)


def test_selective_accuracy_by_hand():
    probs = tensor([[0.9, 0.1], [0.6, 0.4], [0.2, 0.8], [0.55, 0.45], [0.3, 0.7]])
    labels = torch.tensor([0, 1, 1, 0, 0])
    # confidences 0.9, 0.6, 0.8, 0.55, 0.7, right, wrong, right, right, wrong
    assert metrics.selective_accuracy(probs, labels, coverage=0.4) == 1.0  # 0.9, 0.8
    assert metrics.selective_accuracy(probs, labels, coverage=0.6) == pytest.approx(2 / 3)
    # ceil(0.5 * 5) = 3 answered: the 0.9, 0.8 and 0.7 rows
    assert metrics.selective_accuracy(probs, labels, coverage=0.5) == pytest.approx(2 / 3)
    assert metrics.selective_accuracy(probs, labels, coverage=1.0) == metrics.accuracy(
        probs, labels
    )


def test_selective_accuracy_of_two_classes_ignores_a_temperature():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(200, 2, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, 2, (200,), generator=generator)
    for coverage in (0.3, 0.8):
        scores = [
            metrics.selective_accuracy(torch.softmax(logits / t, -1), labels, coverage)
            for t in (0.5, 1.0, 3.0)
        ]
        assert scores[0] == scores[1] == scores[2]
    # with four classes it does not: the top probability also depends on the others
    logits = torch.tensor([[2.0, 0.0, 0.0, 0.0], [2.0, 1.9, -9.0, -9.0]], dtype=torch.float64)
    labels = torch.tensor([0, 1])
    assert metrics.selective_accuracy(torch.softmax(logits, -1), labels, 0.5) == 1.0
    assert metrics.selective_accuracy(torch.softmax(logits / 10, -1), labels, 0.5) == 0.0
    for coverage in (0.0, 1.5):
        with pytest.raises(ValueError, match="coverage"):
            metrics.selective_accuracy(torch.softmax(logits, -1), labels, coverage)


def test_reliability_curve_and_ece_by_hand():
    probs = tensor([[0.9, 0.1], [0.1, 0.9], [0.38, 0.62], [0.58, 0.42]])
    labels = torch.tensor([0, 0, 1, 0])
    # Confidences 0.9 (right), 0.9 (wrong), 0.62 (right), 0.58 (right) in bins of width 1/15:
    # bin 13 = (0.867, 0.933]: n=2, conf 0.9, acc 0.5; bin 9 = (0.6, 0.667]: conf 0.62, acc 1;
    # bin 8 = (0.533, 0.6]: conf 0.58, acc 1.
    curve = metrics.reliability_curve(probs, labels)
    assert curve.count.tolist() == [0] * 8 + [1, 1, 0, 0, 0, 2, 0]
    assert curve.confidence[[8, 9, 13]].tolist() == pytest.approx([0.58, 0.62, 0.9])
    assert curve.accuracy[[8, 9, 13]].tolist() == pytest.approx([1.0, 1.0, 0.5])
    assert torch.isnan(curve.accuracy[0]) and len(curve.bin_edges) == 16
    # ECE = 2/4 * 0.4 + 1/4 * 0.38 + 1/4 * 0.42 = 0.4
    assert metrics.ece(probs, labels) == pytest.approx(0.4, rel=1e-12)
    assert curve.ece == metrics.ece(probs, labels)


def test_ece_weights_bins_by_count_and_bins_are_right_closed():
    # Four bins, edges 0, 1/4, 1/2, 3/4, 1 (exact in binary); confidences on the edges
    # 1/2 and 3/4 belong to the bin they close: (1/4, 1/2] and (1/2, 3/4].
    probs = tensor(
        [
            [0.5, 0.3, 0.1, 0.1],  # conf 1/2, right
            [0.1, 0.5, 0.2, 0.2],  # conf 1/2, wrong
            [0.75, 0.25, 0.0, 0.0],  # conf 3/4, right
            [0.75, 0.25, 0.0, 0.0],  # conf 3/4, wrong
            [0.75, 0.25, 0.0, 0.0],  # conf 3/4, right
            [0.9, 0.1, 0.0, 0.0],  # conf 0.9, wrong
        ]
    )
    labels = torch.tensor([0, 0, 0, 1, 0, 1])
    curve = metrics.reliability_curve(probs, labels, num_bins=4)
    assert curve.count.tolist() == [0, 2, 3, 1]  # left-closed bins would give [0, 0, 2, 4]
    # Bin gaps 0, |2/3 - 3/4| = 1/12 and 0.9, weighted by counts 2, 3 and 1 out of 6:
    # 3/6 * 1/12 + 1/6 * 0.9 = 0.19167; unweighted over the bins it would be 0.3278.
    expected = 3 / 6 / 12 + 0.9 / 6
    assert metrics.ece(probs, labels, num_bins=4) == pytest.approx(expected, rel=1e-12)


def test_ece_matches_torchmetrics():
    """torchmetrics' multiclass calibration error (L1, equal-width bins) is the reference.
    Continuous random confidences never fall on a bin edge, where the two could differ by
    convention. torchmetrics casts the confidences to float32 (relative rounding 6e-8 per
    term), so the two agree to about 1e-7 relative; 1e-6 allows for the sums' order."""
    from torchmetrics.functional.classification import multiclass_calibration_error

    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)  # the Dirichlet draws too: whatever ran before, in this process
    probs = torch.distributions.Dirichlet(torch.full((5,), 0.5)).sample((2000,)).double()
    labels = torch.multinomial(probs.float(), 1, generator=generator).squeeze(1)
    labels[::3] = torch.randint(0, 5, labels[::3].shape, generator=generator)  # miscalibrate
    for num_bins in (10, 15):
        reference = multiclass_calibration_error(
            probs, labels, num_classes=5, n_bins=num_bins, norm="l1"
        )
        assert metrics.ece(probs, labels, num_bins=num_bins) == pytest.approx(
            reference.item(), rel=1e-6
        )


def test_ece_is_zero_when_perfectly_calibrated():
    # 75% confident and right 3 times out of 4; fully confident and always right
    probs = tensor([[0.75, 0.25]] * 4 + [[0.0, 1.0]] * 2)
    labels = torch.tensor([0, 0, 0, 1, 1, 1])
    assert metrics.ece(probs, labels) == pytest.approx(0.0, abs=1e-15)


def test_auroc_by_hand_and_against_sklearn():
    # positives 0.35 and 0.8 beat negatives 0.1 and 0.4 in 3 of 4 pairs
    scores, labels = tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1])
    assert metrics.auroc(scores, labels) == pytest.approx(0.75)
    assert metrics.auroc(tensor([0.5, 0.5]), torch.tensor([0, 1])) == pytest.approx(0.5)
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 2, size=500)
    scores = np.round(rng.normal(size=500) + labels, 1)  # rounding makes many ties
    assert metrics.auroc(scores, labels) == pytest.approx(roc_auc_score(labels, scores), rel=1e-12)


def test_uncertainty_decomposition_when_samples_agree():
    p = tensor([[0.7, 0.2, 0.1], [1.0, 0.0, 0.0]])
    result = metrics.uncertainty_decomposition(p.expand(5, 2, 3))
    entropy = -(0.7 * math.log(0.7) + 0.2 * math.log(0.2) + 0.1 * math.log(0.1))
    assert result.total.tolist() == pytest.approx([entropy, 0.0], rel=1e-12)
    assert result.aleatoric.tolist() == pytest.approx([entropy, 0.0], rel=1e-12)
    assert result.epistemic.tolist() == pytest.approx([0.0, 0.0], abs=1e-15)


def test_uncertainty_decomposition_two_samples_by_hand():
    probs = tensor([[[0.8, 0.2], [1.0, 0.0]], [[0.4, 0.6], [0.0, 1.0]]])  # (2 samples, 2, 2)
    result = metrics.uncertainty_decomposition(probs)
    assert result.epistemic.dtype == torch.float64
    # Mutual information = mean over samples of KL(p_s || mean p), mean p = (0.6, 0.4):
    kl_1 = 0.8 * math.log(0.8 / 0.6) + 0.2 * math.log(0.2 / 0.4)
    kl_2 = 0.4 * math.log(0.4 / 0.6) + 0.6 * math.log(0.6 / 0.4)
    # Second example: one-hot samples that disagree: TU = log 2, AU = 0 (0 log 0 = 0).
    assert result.epistemic.tolist() == pytest.approx([(kl_1 + kl_2) / 2, math.log(2)])
    assert result.epistemic[0] > 0
    assert result.aleatoric[1] == 0.0
    torch.testing.assert_close(result.total, result.aleatoric + result.epistemic)


def test_summarize_accepts_numpy():
    probs = np.array([[0.9, 0.1], [0.2, 0.8]])
    result = metrics.summarize(probs, np.array([0, 1]))
    assert set(result) == {"accuracy", "nll", "ece", "brier"}
    assert all(isinstance(value, float) for value in result.values())
    assert result["accuracy"] == 1.0


@pytest.mark.parametrize(
    "probs, labels, message",
    [
        (tensor([0.2, 0.3, 0.5]), [0], r"probs must be \(batch, classes\) .* got shape \(3,\)"),
        (tensor([[2.0, -1.0]]), [0], "apply torch.softmax"),
        (torch.tensor([[1, 0]]), [0], "pass probabilities"),
        (tensor([[0.5, 0.5]]), [2], r"labels must be in \[0, 1\]"),
        (tensor([[0.5, 0.5]]), [0, 1], "same batch size"),
        (tensor([[0.5, 0.5]]), [0.0], "integer class indices"),
    ],
)
def test_bad_input_is_rejected(probs, labels, message):
    labels = torch.tensor(labels)
    with pytest.raises(ValueError, match=message):
        metrics.nll(probs, labels)


def test_bad_auroc_and_decomposition_input_is_rejected():
    with pytest.raises(ValueError, match="both classes"):
        metrics.auroc(tensor([0.1, 0.2]), torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="0 / 1"):
        metrics.auroc(tensor([0.1, 0.2]), torch.tensor([0, 2]))
    with pytest.raises(ValueError, match=r"\(samples, batch, classes\)"):
        metrics.uncertainty_decomposition(tensor([[0.5, 0.5]]))
    with pytest.raises(ValueError, match="num_bins"):
        metrics.reliability_curve(tensor([[0.5, 0.5]]), torch.tensor([0]), num_bins=0)
