"""The demo's whole run (``pyro-bdl demo --quick`` on the shared SST-2): every section, its
tables, figures, ``posterior.nc`` and ``results.json`` (minutes; ``tests/test_demo.py`` checks
the demo's flow with its sections stubbed)."""

import json

import xarray as xr

from pyro_bdl.cli import main
from pyro_bdl.demo import SECTIONS


def test_quick_demo_writes_its_results(tmp_path, capsys, shared_data, report):
    main(["demo", "--out", str(tmp_path), "--quick", "--data-dir", str(shared_data)])
    printed = capsys.readouterr().err  # the report, through the pyro_bdl logger
    results = json.loads((tmp_path / "results.json").read_text())
    links = ("mc", "probit", "bridge")
    sghmc = results["sghmc"]  # a row of the digits table when it beats the MAP
    assert set(results["methods"]) - {"MAP"} <= {f"SGHMC (T={sghmc['temperature']:g}, 2 chains)"}
    assert results["mcmc_choices"]["SGHMC temperature"]["chosen"] == sghmc["temperature"]
    lora = {"MAP", "MAP + temperature scaling", "SGHMC (2 chains from the MAP, T=1)"}
    assert set(results["lora_methods"]) - lora in [{f"Laplace-LoRA ({link})"} for link in links]
    choice = results["lora_choices"]["Laplace-LoRA link"]  # the best on validation data
    assert choice["chosen"] == min(choice["validation NLL"], key=choice["validation NLL"].get)
    assert f"Laplace-LoRA link = {choice['chosen']}" in printed
    assert 0 <= results["lora_methods"]["MAP"]["train_accuracy"] <= 1
    scaled = results["lora_methods"]["MAP + temperature scaling"]  # the same argmax as MAP
    assert scaled["accuracy"] == results["lora_methods"]["MAP"]["accuracy"]
    assert "temperature T = " in printed
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
    function = diagnostics["function_space"]  # judged on the test images' predictions
    assert function["chains"] == 2 and function["draws"] == 10 and function["r_hat_max"] >= 1
    assert (
        f"split R-hat max {function['r_hat_max']:.3f}" in printed and "trace.png: left" in printed
    )
    for figure in ("trace.png", "reliability.png", "reliability_lora.png"):
        assert (tmp_path / figure).read_bytes()[:4] == b"\x89PNG"
    tree = xr.open_datatree(tmp_path / "posterior.nc", engine="h5netcdf")
    assert {"posterior", "sample_stats", "log_likelihood", "function_space"} <= set(tree.children)
    assert tree["posterior"].sizes["chain"] == 2
    # every section ran, said in results.json and in the closing line
    assert list(results["sections"]) == list(SECTIONS)
    assert all(section["ran"] for section in results["sections"].values())
    closing = printed.strip().splitlines()[-1]
    assert all(f"{title}: ran" in closing for title in SECTIONS.values()), closing
    report(
        "demo",
        wall_time_s=results["wall_time_s"],
        **{f"{name}_s": section["seconds"] for name, section in results["sections"].items()},
    )
