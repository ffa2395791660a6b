"""The validation tier, ``make validate``: the long statistical checks.

``make test`` (``tests/``) holds the unit and property tests and the statistical tests
at the smallest size that still fails on a wrong sampler; what needs minutes per check
(SGMCMC defaults against NUTS and posteriordb's reference draws, the experiments in
``--quick`` mode, the examples) lives here. Each check reports its rows through the
``report`` fixture: they are appended to ``results/validation/<table>.jsonl`` at once and
printed as the check finishes, by the process that prints pytest's progress (so that
``pytest -n 2``'s workers, whose own output pytest-xdist drops, print their rows too).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

#: Where the rows are collected, one JSON line per row, per table.
RESULTS = Path(__file__).resolve().parents[1] / "results" / "validation"


@pytest.fixture
def report(request):
    """``report(table, **columns)``: append one result row to
    ``results/validation/<table>.jsonl`` now; it is printed when the check finishes."""

    def write(table: str, **columns) -> None:
        RESULTS.mkdir(parents=True, exist_ok=True)
        with open(RESULTS / f"{table}.jsonl", "a") as file:
            file.write(json.dumps(columns) + "\n")
        cells = "  ".join(f"{key}={_cell(value)}" for key, value in columns.items())
        request.node.user_properties.append(("report", f"[{table}] {cells}"))

    return write


def pytest_report_teststatus(report, config):
    """Print a finished check's rows (the report carries them from an xdist worker)."""
    rows = [value for key, value in report.user_properties if key == "report"]
    terminal = config.pluginmanager.get_plugin("terminalreporter")
    if report.when == "call" and rows and terminal is not None:
        for row in rows:
            terminal.write_line(row)


def _cell(value) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)
