import json

import xarray as xr

from pyro_bdl.cli import main


def test_quick_demo_writes_its_results(tmp_path, capsys):
    main(["demo", "--out", str(tmp_path), "--quick"])
    printed = capsys.readouterr().out
    assert "| SGHMC |" in printed and "| SGLD |" in printed
    results = json.loads((tmp_path / "results.json").read_text())
    for name, values in results["methods"].items():
        assert 0.5 < values["accuracy"] <= 1.0, name
        assert 0.0 <= values["ece"] <= 1.0 and values["nll"] > 0
    for figure in ("trace.png", "reliability.png"):
        assert (tmp_path / figure).read_bytes()[:4] == b"\x89PNG"
    tree = xr.open_datatree(tmp_path / "posterior.nc", engine="h5netcdf")
    assert {"posterior", "sample_stats", "log_likelihood"} <= set(tree.children)
