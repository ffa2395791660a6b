"""The docs table from the runner's output: right / warned / wrong per kernel and posterior.

Reads the JSON that :mod:`validation.posteriordb.run` writes (several, from a run split
over processes, are merged) and ``control.json`` (NUTS's ESS per 1,000 gradient
evaluations), and writes a Markdown table between the markers ``<!-- table:start -->``
and ``<!-- table:end -->`` of the docs page (or prints it).

Usage::

    python -m validation.posteriordb.table RUN.json [RUN.json ...] [--page docs/posteriordb.md]
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from validation.posteriordb.control import load_control

__all__ = ["markdown", "merged"]

_START, _END = "<!-- table:start -->", "<!-- table:end -->"


def markdown(output: dict) -> str:
    """The table (and a count of verdicts) of one runner output."""
    rows = output["rows"]
    kernels = list(dict.fromkeys(row["kernel"] for row in rows))
    control = load_control()
    cells: dict[tuple[str, str], dict[str, str]] = {}
    for row in rows:
        cell = row["verdict"]
        if "worst_mean" in row:
            low, high = row["sd_ratio"]
            cell += f" ({row['worst_mean']:.2g} sd, x{low:.2g}-{high:.2g}; {row['ess_per_1k']:.2g})"
        cells.setdefault((row["posterior"], row["mode"]), {})[row["kernel"]] = cell
    settings = output["settings"]
    lines = [
        f"Kernels from `{output.get('pyro_bdl')}` at commit `{output.get('commit')}`; "
        f"warm-up {settings['warmup_steps']}, {settings['num_samples']} kept draws "
        f"(thin {settings.get('thin', 1)}), one "
        f"chain, seed(s) {sorted({row['seed'] for row in rows})}; minibatch B = "
        f"{settings['batch_size']} where N >= {settings['min_minibatch_n']}. A cell is the "
        "verdict (worst mean error in reference sds, range of sd / reference sd; smallest "
        "bulk ESS per 1,000 gradient evaluations).",
        "",
        "| posterior | data | " + " | ".join(kernels) + " | NUTS ESS / 1k grad |",
        "|---|---|" + "---|" * len(kernels) + "---|",
    ]
    for (name, mode), by_kernel in cells.items():
        nuts = control.get(name)
        nuts_cell = "-" if nuts is None else f"{_ess_per_1k(nuts):.3g}"
        row = [name, mode, *(by_kernel.get(k, "-") for k in kernels), nuts_cell]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", f"Runs: {_counts(rows)}."]
    for key in ("mode", "kernel"):
        groups = dict.fromkeys(row[key] for row in rows)
        lines.append(
            f"By {key}: "
            + "; ".join(f"{g} {_counts([r for r in rows if r[key] == g])}" for g in groups)
            + "."
        )
    return "\n".join(lines)


def _counts(rows: list[dict]) -> str:
    counts = Counter(row["verdict"] for row in rows)
    return ", ".join(f"{verdict} {counts[verdict]}" for verdict in sorted(counts))


def merged(outputs: list[dict]) -> dict:
    """One runner output from several (the runner split over processes): their rows in
    order, refused unless their kernels and settings are the same."""
    first = outputs[0]
    for output in outputs[1:]:
        for key in ("pyro_bdl", "commit", "settings"):
            if output.get(key) != first.get(key):
                raise ValueError(
                    f"the outputs differ in {key}: {first.get(key)} and {output.get(key)}"
                )
    return {**first, "rows": [row for output in outputs for row in output["rows"]]}


def _ess_per_1k(control: dict) -> float:
    ess = min(s["ess_bulk"] for s in control["summary"].values())
    return 1000 * ess / sum(control["gradient_evaluations"].values())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, nargs="+", help="the runner's --out file(s)")
    parser.add_argument("--page", type=Path, help="the docs page to write the table into")
    args = parser.parse_args(argv)
    table = markdown(merged([json.loads(path.read_text()) for path in args.run]))
    if args.page is None:
        print(table)
        return
    text = args.page.read_text()
    head, rest = text.split(_START)
    _, tail = rest.split(_END)
    args.page.write_text(f"{head}{_START}\n{table}\n{_END}{tail}")


if __name__ == "__main__":
    main()
