"""``python -m experiments NAME`` and ``python -m experiments.NAME``: one parser for both."""

import subprocess
import sys
from pathlib import Path

import pytest

from experiments import main

ROOT = Path(__file__).resolve().parents[2]


def test_each_experiment_module_runs_as_a_command_with_the_shared_options(tmp_path):
    # A method the experiment does not have: refused by the experiment before any work,
    # through the same options and one-line errors as `python -m experiments`.
    command = [sys.executable, "-m", "experiments.cold_posterior", "--data-dir", str(tmp_path)]
    command += ["--out", str(tmp_path / "out"), "--methods", "SGLD"]
    # the limit guards against a hang: a loaded 2-core machine took over 120 s to import
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith("python -m experiments.cold_posterior: error: --methods")
    assert "SGLD" in done.stderr and done.stderr.strip().count("\n") == 0


def test_the_package_command_takes_the_experiment_by_name(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit:
        main(["calibrate", "--data-dir", str(tmp_path), "--out", str(tmp_path / "out")])
    assert exit.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith("python -m experiments: error:") and "calibrate" in error
    assert not (tmp_path / "out").exists()
