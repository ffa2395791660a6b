"""The cold-posterior experiment in --quick mode (moved from
``tests/experiments``): result schema, ranges, figure, resume."""

import json
import math

import pytest

from experiments import run_experiment
from experiments.cold_posterior import METHODS, TEMPERATURES

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_quick_run_writes_results_and_resumes(tmp_path, shared_data, report):
    results = run_experiment(
        "cold-posterior", data_dir=shared_data, out=tmp_path, quick=True, seeds=[0]
    )
    saved = json.loads((tmp_path / "results.json").read_text())
    report("experiments", experiment="cold-posterior", wall_time_s=saved["wall_time_s"])
    assert saved["experiment"] == "cold-posterior" and saved["quick"] is True
    assert saved["seeds"] == [0]
    assert saved["settings"]["temperatures"] == list(TEMPERATURES)
    assert saved["library_version"] and saved["wall_time_s"] > 0
    assert saved["results"]["rows"] == results["rows"]

    rows = results["rows"]
    expected = {(label, None) for label in ("MAP", "MLE")} | {
        (label, t)
        for key, label in METHODS.items()
        if key not in ("map", "mle")
        for t in TEMPERATURES
    }
    assert {(r["method"], r["temperature"]) for r in rows} == expected
    assert len(rows) == len(expected)
    for row in rows:
        assert math.isfinite(row["nll"]) and row["nll"] > 0, row
        for metric in ("accuracy", "ece", "brier"):
            assert math.isfinite(row[metric]), row
        assert 0 <= row["accuracy"] <= 1 and 0 <= row["ece"] <= 1 and 0 <= row["brier"] <= 2
    # the serial chain's function-space R-hat (4 draws in --quick: defined, at least 1)
    assert all(r["function_rhat"] >= 1 for r in rows if r["method"] == "SGHMC (serial)")
    for row in rows:
        if row["method"] in ("MAP", "MLE"):
            assert 0 <= row["train_accuracy"] <= 1 and row["train_nll"] > 0
    # The temperature acts on VI's learned scales: colder, narrower (moved from the start).
    vi = {row["temperature"]: row["vi_scale"] for row in rows if row["method"] == "VI"}
    assert all(scale["initial"] == pytest.approx(math.exp(-3)) for scale in vi.values())
    assert vi[min(TEMPERATURES)]["mean"] < vi[max(TEMPERATURES)]["mean"]
    assert vi[max(TEMPERATURES)]["mean"] != pytest.approx(math.exp(-3), rel=1e-3)

    assert len(results["summary"]) == len(expected)
    for entry in results["summary"]:
        assert entry["seeds"] == 1
        assert entry["nll"]["sd"] >= 0 and math.isfinite(entry["nll"]["mean"])

    figure = tmp_path / "cold_posterior.png"
    assert figure.read_bytes()[:8] == PNG_MAGIC

    # Every cell is cached: a second run recomputes nothing and reports the same numbers.
    cells = sorted((tmp_path / "cells").glob("*.json"))
    stamps = [cell.stat().st_mtime_ns for cell in cells]
    again = run_experiment(
        "cold-posterior", data_dir=shared_data, out=tmp_path, quick=True, seeds=[0]
    )
    assert again["rows"] == rows
    assert [cell.stat().st_mtime_ns for cell in cells] == stamps
