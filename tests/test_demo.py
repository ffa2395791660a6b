import json

import pytest
import xarray as xr

from pyro_bdl import data
from pyro_bdl.cli import main
from pyro_bdl.demo import _sst2_root


@pytest.mark.slow
def test_quick_demo_writes_its_results(tmp_path, capsys, shared_data):
    main(["demo", "--out", str(tmp_path), "--quick", "--data-dir", str(shared_data)])
    printed = capsys.readouterr().out
    results = json.loads((tmp_path / "results.json").read_text())
    links = ("mc", "probit", "bridge")
    digits = {"MAP (SGHMC, T=0)", "SGHMC", "SGLD"}
    assert set(results["methods"]) - digits in [{f"Laplace K-FAC ({link})"} for link in links]
    lora = {"MAP", "BLoB (N=10)", "BLoB (N=0, mean weights)"}
    assert set(results["lora_methods"]) - lora in [{f"Laplace-LoRA ({link})"} for link in links]
    blob = results["lora_methods"]["BLoB (N=10)"]
    assert blob["initial_sd_range"] == pytest.approx([0.05**2 / 2, 0.05**2])  # eps = 0.05
    assert blob["posterior_sd"] > 0 and f"{blob['posterior_sd']:.4f}" in printed
    assert 0 <= results["lora_methods"]["MAP"]["train_accuracy"] <= 1
    for name, values in {**results["methods"], **results["lora_methods"]}.items():
        assert f"| {name} |" in printed
        assert 0.0 <= values["accuracy"] <= 1.0 and 0.0 <= values["ece"] <= 1.0, name
        assert values["nll"] > 0, name
    for name in results["methods"]:  # the digits are easy: every method learns them
        assert results["methods"][name]["accuracy"] > 0.8, name
    for figure in ("trace.png", "reliability.png", "reliability_lora.png"):
        assert (tmp_path / figure).read_bytes()[:4] == b"\x89PNG"
    tree = xr.open_datatree(tmp_path / "posterior.nc", engine="h5netcdf")
    assert {"posterior", "sample_stats", "log_likelihood"} <= set(tree.children)


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
    tmp_path, monkeypatch, capsys
):
    datasets = pytest.importorskip("datasets")

    def offline(*names):
        raise ConnectionError("the Hub is unreachable\nsecond line")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert _sst2_root(None) is None
    (line,) = capsys.readouterr().out.splitlines()
    assert "skipped the LoRA fine-tuning on SST-2" in line and "--data-dir" in line
    assert "ConnectionError: the Hub is unreachable" in line


def test_a_data_dir_with_sst2_is_used_as_it_is(tmp_path, monkeypatch):
    (tmp_path / "sst2").mkdir()
    for name in ("train.tsv", "dev.tsv"):
        (tmp_path / "sst2" / name).write_text("sentence\tlabel\nfine\t1\n")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert _sst2_root(tmp_path) == tmp_path
