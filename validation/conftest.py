"""The validation tier, ``make validate``: the long statistical checks.

``make test`` (``tests/``) holds the unit and property tests and the statistical tests
at the smallest size that still fails on a wrong sampler; what needs minutes per check
(SGMCMC defaults against NUTS and posteriordb's reference draws, the experiments in
``--quick`` mode, the examples) lives here. Each check reports its row through the
``report`` fixture as soon as it has it, so the run prints its tables as it goes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

#: Where the rows are collected, one JSON line per row, per table.
RESULTS = Path(__file__).resolve().parents[1] / "results" / "validation"


@pytest.fixture
def report(capsys):
    """``report(table, **columns)``: print one result row now (past pytest's capture) and
    append it to ``results/validation/<table>.jsonl``."""

    def write(table: str, **columns) -> None:
        RESULTS.mkdir(parents=True, exist_ok=True)
        with open(RESULTS / f"{table}.jsonl", "a") as file:
            file.write(json.dumps(columns) + "\n")
        cells = "  ".join(f"{key}={_cell(value)}" for key, value in columns.items())
        with capsys.disabled():
            print(f"\n[{table}] {cells}", flush=True)

    return write


def _cell(value) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)
