"""The ``pyro-bdl`` command: one-line errors for bad arguments, before any work."""

import importlib
import logging
import os
import re
import sys
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

import pyro_bdl
from experiments import EXPERIMENTS
from pyro_bdl.cli import COMMANDS, main
from pyro_bdl.data import DATASETS

ROOT = Path(__file__).resolve().parents[1]


def _declared_commands() -> list[EntryPoint]:
    """The entry points of pyproject.toml's ``pyro_bdl.commands`` table."""
    text = (ROOT / "pyproject.toml").read_text()
    table = re.search(rf'\[project\.entry-points\."{COMMANDS}"\]\n((?:[^\[\n].*\n)*)', text)
    lines = re.findall(r'^(\w+) = "([^"]+)"$', table.group(1), re.M)
    return [EntryPoint(name, value, COMMANDS) for name, value in lines]


@pytest.fixture(autouse=True)
def commands(monkeypatch) -> list[EntryPoint]:
    """The commands an install of this checkout registers, as pyproject.toml declares them
    (the environment's metadata may be older than the checkout)."""
    points = _declared_commands()

    def registered(group: str, name: str) -> list[EntryPoint]:
        return [p for p in points if p.group == group and p.name == name]

    monkeypatch.setattr("pyro_bdl.cli.entry_points", registered)
    return points


def _fails(capsys, argv, status=2):
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == status or (status == 1 and isinstance(exit.value.code, str))
    error = capsys.readouterr().err or str(exit.value.code)
    assert error.strip().count("\n") == 0, error  # one line, no traceback, no usage
    assert error.startswith("pyro-bdl")
    return error


def test_version(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["--version"])
    assert exit.value.code == 0
    assert capsys.readouterr().out.strip() == f"pyro-bdl {pyro_bdl.__version__}"


@pytest.fixture
def data_dir(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    return str(folder)


@pytest.mark.parametrize(
    "argv, named",
    [
        ([], "command"),
        (["train"], "invalid choice"),
        (["experiment", "calibrate", "--data-dir", "{data}", "--out", "{out}"], "calibrate"),
        (["experiment", "ood", "--data-dir", "/no/such/dir", "--out", "{out}"], "--data-dir"),
        (["experiment", "ood", "--out", "{out}"], "--data-dir"),
        (["experiment", "ood", "--data-dir", "{data}", "--out", "{data}/file"], "--out"),
        (
            ["experiment", "ood", "--data-dir", "{data}", "--out", "{out}", "--seeds", "-1"],
            "--seeds",
        ),
        (
            ["experiment", "ood", "--data-dir", "{data}", "--out", "{out}", "--seeds", "one"],
            "--seeds",
        ),
        (
            ["experiment", "ood", "--data-dir", "{data}", "--out", "{out}", "--seeds", "1", "1"],
            "--seeds",
        ),
        (["experiment", "ood", "--data-dir", "{data}", "--out", "{out}", "--bogus"], "--bogus"),
        (
            ["experiment", "lm-ood", "--data-dir", "{data}", "--out", "{out}", "--model", "/no/m"],
            "--model",
        ),
        (["demo", "--seed", "-3"], "--seed"),
        (["demo", "--seed", "1.5"], "--seed"),
        (["demo", "--data-dir", "/no/such/dir"], "--data-dir"),
    ],
)
def test_bad_arguments_end_with_one_line_that_names_them(capsys, tmp_path, data_dir, argv, named):
    (tmp_path / "data" / "file").write_text("not a directory")
    argv = [a.format(data=data_dir, out=str(tmp_path / "out")) for a in argv]
    error = _fails(capsys, argv)
    assert named in error
    assert not (tmp_path / "out").exists()  # nothing was started


@pytest.mark.parametrize(
    "option, value, named",
    [("--datasets", "sst2", "--datasets"), ("--methods", "SGLD", "--methods")],
)
def test_unknown_datasets_and_methods_stop_before_any_work(
    capsys, data_dir, tmp_path, option, value, named
):
    argv = ["experiment", "cold-posterior", "--data-dir", data_dir, "--out", str(tmp_path / "out")]
    error = _fails(capsys, [*argv, option, value], status=1)
    assert named in error and value in error


def test_the_hub_setting_is_left_to_the_user(monkeypatch):
    """Models load as from_pretrained does: online or not is HF_HUB_OFFLINE's to say."""
    monkeypatch.delenv("HF_HUB_OFFLINE")
    with pytest.raises(SystemExit):
        main(["--version"])
    assert "HF_HUB_OFFLINE" not in os.environ


@pytest.fixture
def pyro_bdl_logger():
    """The pyro_bdl logger (conftest's ``_loggers`` restores it after the test)."""
    return logging.getLogger("pyro_bdl")


@pytest.mark.parametrize(
    "flags, level",
    [([], logging.INFO), (["-q"], logging.WARNING), (["--verbose"], logging.DEBUG)],
)
def test_quiet_and_verbose_set_the_pyro_bdl_loggers_level(
    capsys, data_dir, tmp_path, pyro_bdl_logger, flags, level
):
    argv = ["experiment", "cold-posterior", "--data-dir", data_dir, "--out", str(tmp_path)]
    _fails(capsys, [*flags, *argv, "--methods", "SGLD"], status=1)
    assert pyro_bdl_logger.getEffectiveLevel() == level
    for name in ("pyro_bdl.demo", "experiments.runner"):  # the library's and the experiments'
        logging.getLogger(name).info("a cell: 3 s")
        assert ("a cell: 3 s" in capsys.readouterr().err) == (level <= logging.INFO)


def test_quiet_and_verbose_together_are_refused(capsys):
    assert "not allowed with" in _fails(capsys, ["-q", "-v", "demo"])


def test_help_lists_the_experiments_datasets_and_methods(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["experiment", "--help"])
    assert exit.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for name, module in EXPERIMENTS.items():
        assert name in text
        assert f"{name}: {', '.join(importlib.import_module(module).METHODS)}" in text
    assert all(dataset in text for dataset in DATASETS)


def test_experiment_outside_a_checkout_says_how_to_run_the_experiments(
    capsys, monkeypatch, tmp_path
):
    # The installed package has no experiments: a directory without the repository's
    # experiments/ and nothing importable under that name.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "experiments", None)
    error = _fails(capsys, ["experiment", "ood", "--data-dir", ".", "--out", "out"])
    assert "not part of the installed package" in error and "python -m experiments" in error
    assert not (tmp_path / "out").exists()


def test_demo_refuses_what_it_does_not_take(capsys):
    assert "--seeds" in _fails(capsys, ["demo", "--seeds", "1"])


def test_the_experiments_come_through_their_entry_point(commands, capsys, tmp_path):
    # pyproject.toml registers the repository's experiments as `pyro-bdl experiment`
    assert [(p.name, p.value) for p in commands] == [("experiment", "experiments:main")]
    argv = ["experiment", "calibrate", "--data-dir", str(tmp_path), "--out", str(tmp_path / "o")]
    error = _fails(capsys, argv)
    assert error.startswith("pyro-bdl experiment: error:") and "calibrate" in error
    commands.clear()  # an install without the entry point: how to run them instead
    error = _fails(capsys, argv)
    assert "not part of the installed package" in error and "python -m experiments" in error
