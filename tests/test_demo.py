import json
import warnings

import pytest
import torch
import xarray as xr

import pyro_bdl as bdl
from pyro_bdl import data
from pyro_bdl.cli import main
from pyro_bdl.demo import _TRACED, _diagnose, _sst2_root


@pytest.mark.slow
def test_quick_demo_writes_its_results(tmp_path, capsys, shared_data):
    main(["demo", "--out", str(tmp_path), "--quick", "--data-dir", str(shared_data)])
    printed = capsys.readouterr().err  # the report, through the pyro_bdl logger
    results = json.loads((tmp_path / "results.json").read_text())
    links = ("mc", "probit", "bridge")
    assert set(results["methods"]) == {"MAP"}
    lora = {"MAP", "SGHMC (2 chains from the MAP, T=1)"}
    assert set(results["lora_methods"]) - lora in [{f"Laplace-LoRA ({link})"} for link in links]
    choice = results["lora_choices"]["Laplace-LoRA link"]  # the best on validation data
    assert choice["chosen"] == min(choice["validation NLL"], key=choice["validation NLL"].get)
    assert f"Laplace-LoRA link = {choice['chosen']}" in printed
    assert 0 <= results["lora_methods"]["MAP"]["train_accuracy"] <= 1
    for name, values in {**results["methods"], **results["lora_methods"]}.items():
        assert f"| {name} |" in printed
        assert 0.0 <= values["accuracy"] <= 1.0 and 0.0 <= values["ece"] <= 1.0, name
        assert values["nll"] > 0, name
    assert results["methods"]["MAP"]["accuracy"] > 0.8  # the digits are easy
    assert results["sghmc"]["accuracy"] > 0.8 and f"NLL {results['sghmc']['nll']:.3f}" in printed
    diagnostics = results["diagnostics"]  # every weight's R-hat and ESS, summarised
    assert diagnostics["weights"] == 64 * 64 + 64 + 64 * 10 + 10
    assert diagnostics["r_hat_max"] >= 1 and diagnostics["ess_bulk_min"] > 0
    assert "r_hat" in printed and "ess_bulk" in printed and "2.bias[" in printed
    for figure in ("trace.png", "reliability.png", "reliability_lora.png"):
        assert (tmp_path / figure).read_bytes()[:4] == b"\x89PNG"
    tree = xr.open_datatree(tmp_path / "posterior.nc", engine="h5netcdf")
    assert {"posterior", "sample_stats", "log_likelihood"} <= set(tree.children)
    assert tree["posterior"].sizes["chain"] == 2


def test_r_hat_above_1_01_warns_with_the_count():
    """Two chains far apart: R-hat far above 1.01, a warning naming how many weights."""
    generator = torch.Generator().manual_seed(0)
    draws = torch.randn(2, 50, 3, generator=generator) + torch.tensor([[[0.0]], [[5.0]]])
    draws = {site: draws for site in _TRACED}
    idata = bdl.to_arviz(draws, grouped_by_chain=True)
    with pytest.warns(RuntimeWarning, match=r"R-hat exceeds 1.01 for 12 of 12 weights"):
        report, text = _diagnose(idata, idata, "SGHMC")
    assert report["r_hat_above_1.01"] == 12 and "r_hat" in text
    calm = bdl.to_arviz({site: torch.randn(4, 400, 3) for site in _TRACED}, grouped_by_chain=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report, _ = _diagnose(calm, calm, "SGHMC")
    assert report["r_hat_max"] < 1.01


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
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    root = _sst2_root(tmp_path / "empty")
    assert root == tmp_path / "cache" / "pyro_bdl" and calls == [("nyu-mll/glue", "sst2")]
    train = data.load("sst2", root, "train")
    assert [(r["text"], r["label"]) for r in train] == [("a gripping film ", 1), ("dull", 0)]
    assert len(data.load("sst2", root, "test")) == 1
    assert _sst2_root(None) == root and len(calls) == 1  # the cached copy, not a new fetch


def test_without_sst2_and_offline_the_demo_says_in_one_line_what_it_skips(
    tmp_path, monkeypatch, caplog
):
    datasets = pytest.importorskip("datasets")

    def offline(*names):
        raise ConnectionError("the Hub is unreachable\nsecond line")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert _sst2_root(None) is None
    (line,) = "\n".join(r.getMessage() for r in caplog.records).splitlines()
    assert "skipped the LoRA fine-tuning on SST-2" in line and "--data-dir" in line
    assert "ConnectionError: the Hub is unreachable" in line


def test_a_data_dir_with_sst2_is_used_as_it_is(tmp_path, monkeypatch):
    (tmp_path / "sst2").mkdir()
    for name in ("train.tsv", "dev.tsv"):
        (tmp_path / "sst2" / name).write_text("sentence\tlabel\nfine\t1\n")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert _sst2_root(tmp_path) == tmp_path
