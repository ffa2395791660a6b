import json

import pytest
import xarray as xr

from pyro_bdl.cli import main


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
