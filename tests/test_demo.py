import importlib.util
import json
import logging
import time
import urllib.error
import urllib.request
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import xarray as xr

import pyro_bdl as bdl
from pyro_bdl import data, demo
from pyro_bdl.cli import main
from pyro_bdl.demo import _TRACED, DemoSetupError, _diagnose, _sst2_root, run_demo


def _tree(weight_offsets, probs):
    """Draws of the traced weights, chain c shifted by weight_offsets[c], with the class
    probabilities ``probs`` (chain, draw, image, class) as the function_space group."""
    generator = torch.Generator().manual_seed(0)
    shift = torch.tensor(weight_offsets, dtype=torch.float32)[:, None, None]
    draws = torch.randn(len(weight_offsets), 200, 3, generator=generator) + shift
    idata = bdl.to_arviz({site: draws for site in _TRACED}, grouped_by_chain=True)
    idata["function_space"] = xr.DataTree(
        xr.Dataset({"probs": (("chain", "draw", "probe", "class"), probs)})
    )
    return idata


def _probs(num_chains, shift=0.0, seed=1):
    """Class probabilities of 5 images, 200 independent draws per chain, chain c's logits
    shifted by c * shift."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(num_chains, 200, 5, 3))
    logits[..., 0] += shift * np.arange(num_chains)[:, None, None]
    return np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)


def test_function_space_decides_and_a_high_weight_r_hat_is_explained():
    # Weights of two chains 5 sd apart (R-hat far above 1.01 on all 12), predictions of
    # independent draws alike in both (R-hat of 15 outputs of 2 x 200 iid draws about
    # 1.01, below 1.05): no warning, and the text says why the weights' R-hat is high.
    idata = _tree([0.0, 5.0], _probs(2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report, text = _diagnose(idata, idata, "SGHMC")
    assert report["r_hat_above_1.01"] == 12 and report["function_space"]["r_hat_max"] < 1.05
    assert "chains sit in different modes that make the same predictions" in text
    assert "function space, the class probabilities of the 5 test images" in text
    # Chains whose logits differ by 3: the predictive has not converged, said by a warning.
    with pytest.warns(RuntimeWarning, match="the predictive has not converged"):
        report, text = _diagnose(_tree([0.0, 0.0], _probs(2, shift=3.0)), idata, "SGHMC")
    assert report["function_space"]["r_hat_max"] > 1.5 and "different modes" not in text


def _fake_sst2(calls):
    def load_dataset(*names):
        calls.append(names)
        return {
            "train": [
                {"sentence": "a gripping film ", "label": 1},
                {"sentence": "dull", "label": 0},
            ],
            "validation": [{"sentence": "not worth it", "label": 0}],
        }

    return load_dataset


def test_sst2_is_fetched_once_into_the_cache_where_no_data_dir_has_it(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    calls = []
    monkeypatch.setattr(datasets, "load_dataset", _fake_sst2(calls))
    monkeypatch.setattr(demo, "_hub_unreachable", lambda: None)  # the Hub answers
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    root = _sst2_root(tmp_path / "empty")
    assert root == tmp_path / "cache" / "pyro_bdl" and calls == [("nyu-mll/glue", "sst2")]
    train = data.load("sst2", root, "train")
    assert [(r["text"], r["label"]) for r in train] == [("a gripping film ", 1), ("dull", 0)]
    assert len(data.load("sst2", root, "test")) == 1
    assert _sst2_root(None) == root and len(calls) == 1  # the cached copy, not a new fetch


def test_a_data_dir_with_sst2_is_used_as_it_is(tmp_path, monkeypatch):
    (tmp_path / "sst2").mkdir()
    for name in ("train.tsv", "dev.tsv"):
        (tmp_path / "sst2" / name).write_text("sentence\tlabel\nfine\t1\n")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert _sst2_root(tmp_path) == tmp_path


# -- never half-run ------------------------------------------------------------------------


@pytest.fixture
def no_sst2(tmp_path, monkeypatch):
    """No SST-2 anywhere (an empty cache), and a record of every fetch attempted."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    fetches = []
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets, "load_dataset", lambda *names: fetches.append(names))
    return fetches


def _demo_fails(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0, error  # one message, no traceback
    return error


def test_without_sst2_and_offline_the_demo_stops_before_any_work(tmp_path, capsys, no_sst2):
    """Issue 35: before, `make demo` retried for 23 s, skipped the LoRA part in one line and
    exited 0 with `"lora_methods": {}`. Now it stops at once, status 2, one message naming
    --data-dir, nothing fetched, run or written."""
    out = tmp_path / "out"
    started = time.perf_counter()
    error = _demo_fails(capsys, ["demo", "--out", str(out), "--quick"])
    assert time.perf_counter() - started < 5  # no retries
    assert error.startswith("pyro-bdl demo: error: the LoRA part needs SST-2")
    assert "--data-dir DIR" in error and "--skip-lora" in error and "HF_HUB_OFFLINE=1" in error
    assert "Nothing was run" in error and not out.exists() and no_sst2 == []


def test_an_unreachable_hub_is_asked_once_without_retries(tmp_path, monkeypatch, no_sst2):
    """Downloads on (make demo's HF_HUB_OFFLINE=0), the Hub silent: one request, then the
    same stop, and datasets (whose retries took the 23 s) is never called."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    requests = []

    def silent(request, timeout):
        requests.append((request.full_url, timeout))
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(urllib.request, "urlopen", silent)
    with pytest.raises(DemoSetupError, match="the Hugging Face Hub did not answer .*URLError"):
        run_demo(tmp_path / "out", data_dir=tmp_path)
    assert requests == [("https://huggingface.co", demo._HUB_TIMEOUT_S)] and no_sst2 == []
    assert "has no train.tsv and dev.tsv" in str(_setup_error(run_demo, tmp_path))


def _setup_error(run, tmp_path) -> DemoSetupError:
    with pytest.raises(DemoSetupError) as error:
        run(tmp_path / "out", data_dir=tmp_path)
    return error.value


def test_a_missing_package_stops_the_demo_before_any_work(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: None if name == "arviz_plots" else real(name)
    )
    with pytest.raises(DemoSetupError, match=r"needs arviz_plots: pip install 'pyro-bdl\[demo\]'"):
        run_demo(tmp_path / "out", skip_lora=True)
    assert not (tmp_path / "out").exists()


def _fake_sections(monkeypatch, lora_fails: bool = False):
    """The two sections replaced by stand-ins that return at once (their own tests are the
    demo's full run, in validation/test_demo.py)."""
    scores = {"accuracy": 0.9, "nll": 0.3, "ece": 0.05}

    def lora(root, settings, seed, out):
        if lora_fails:
            raise RuntimeError("the fine-tune diverged\nsecond line")
        return {"methods": {"MAP": scores}, "choices": {}}

    def digits(settings, seed, out):
        return {
            "methods": {"MAP": scores},
            "sghmc": scores,
            "diagnostics": {},
            "summary_text": "",
            "mcmc_text": "",
            "choices": {},
        }

    monkeypatch.setattr(demo, "_lora_section", lora)
    monkeypatch.setattr(demo, "_digits_section", digits)
    monkeypatch.setattr(demo, "_sst2_root", lambda data_dir: Path("sst2-here"))


def test_results_and_the_closing_line_account_for_every_section(tmp_path, monkeypatch, caplog):
    _fake_sections(monkeypatch)
    caplog.set_level(logging.INFO, logger="pyro_bdl.demo")
    run_demo(tmp_path / "all")
    sections = json.loads((tmp_path / "all" / "results.json").read_text())["sections"]
    assert list(sections) == ["lora", "mcmc_tour"] and all(s["ran"] for s in sections.values())
    closing = caplog.records[-1].getMessage()
    assert "LoRA fine-tuning of MiniLM on SST-2: ran; MCMC tour on the digits: ran" in closing

    caplog.clear()
    run_demo(tmp_path / "tour", skip_lora=True)
    results = json.loads((tmp_path / "tour" / "results.json").read_text())
    assert results["sections"]["lora"] == {"ran": False, "reason": "--skip-lora was passed"}
    assert results["sections"]["mcmc_tour"]["ran"] and results["lora_methods"] == {}
    closing = caplog.records[-1].getMessage()
    assert "LoRA fine-tuning of MiniLM on SST-2: not run, --skip-lora was passed" in closing


def test_a_section_that_fails_is_recorded_with_its_reason(tmp_path, monkeypatch):
    _fake_sections(monkeypatch, lora_fails=True)
    with pytest.raises(RuntimeError, match="diverged"):
        run_demo(tmp_path)
    sections = json.loads((tmp_path / "results.json").read_text())["sections"]
    assert sections == {
        "lora": {"ran": False, "reason": "failed: RuntimeError: the fine-tune diverged"}
    }
