"""The continual-learning experiment in --quick mode (moved from
``tests/experiments``): result schema, ranges, figures, resume."""

import json
import math

from experiments import run_experiment
from experiments.continual import METHODS

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_quick_run_writes_results_and_resumes(tmp_path, shared_data, report):
    results = run_experiment("continual", data_dir=shared_data, out=tmp_path, quick=True, seeds=[0])
    saved = json.loads((tmp_path / "results.json").read_text())
    report("experiments", experiment="continual", wall_time_s=saved["wall_time_s"])
    assert saved["experiment"] == "continual" and saved["quick"] is True
    assert saved["library_version"] and saved["wall_time_s"] > 0
    books = saved["settings"]["books"]
    assert len(books) == saved["settings"]["num_books"] == len(results["books"])

    rows = results["rows"]
    assert {(r["method"], r["episode"]) for r in rows} == {
        (label, episode) for label in METHODS.values() for episode in range(1, len(books) + 1)
    }
    # A fresh network scores about log(vocabulary) nats per token; training lowers it.
    uniform = math.log(saved["settings"]["vocab_size"])
    for row in rows:
        assert set(row["test_loss"]) == set(books)
        for loss in row["test_loss"].values():
            assert math.isfinite(loss) and 0 < loss < 2 * uniform, row
    assert saved["results"]["baselines"] == results["baselines"]
    baselines = results["baselines"]["0"]
    assert set(baselines) == set(books)
    # Online AdamW's first episode is the first book's single-episode baseline.
    first = next(r for r in rows if r["method"] == METHODS["online"] and r["episode"] == 1)
    assert first["test_loss"][books[0]] == baselines[books[0]]
    for method in METHODS.values():
        for entry in results["summary"][method].values():
            assert math.isfinite(entry["relative_loss"]["mean"])
            assert math.isfinite(entry["seen_loss"]["mean"])

    for name in ("continual.png", "continual_average.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG_MAGIC

    cells = sorted((tmp_path / "cells").glob("*.json"))
    stamps = [cell.stat().st_mtime_ns for cell in cells]
    again = run_experiment("continual", data_dir=shared_data, out=tmp_path, quick=True, seeds=[0])
    assert again["rows"] == rows
    assert [cell.stat().st_mtime_ns for cell in cells] == stamps

    # An interrupted sequence resumes from its checkpoints (safetensors, no pickle): the
    # later episodes recomputed from the first one's saved weights and Laplace prior give
    # the same losses.
    later = [
        c for c in cells if "episode=2" in c.name and ("laplace" in c.name or "online" in c.name)
    ]
    assert later
    for cell in later:
        cell.unlink()
    assert not list(tmp_path.rglob("*.pt"))
    resumed = run_experiment("continual", data_dir=shared_data, out=tmp_path, quick=True, seeds=[0])
    assert resumed["rows"] == rows
