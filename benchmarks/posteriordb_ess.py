"""Effective samples per CPU second of the default SGMCMC kernels against NUTS (issue 33).

On the posteriordb ports with N >= 1,000 data points (``validation/posteriordb``), side by
side in one run on one thread: Pyro's NUTS with the control's settings (dense mass, JIT,
300 warm-up + 600 draws, :func:`validation.posteriordb.control.run_nuts`) and ``SGLD(model)``,
``SGHMC(model)``, ``SGNHT(model)`` with the runner's settings (1,000 warm-up + 1,000 draws
thinned 10, :func:`validation.posteriordb.run.run_one`), full batch and minibatch B = 100. A run's
figure is its smallest bulk ESS over the parameters divided by its whole CPU time (set-up,
warm-up and draws); a run that is not *right* against posteriordb's reference is shown with
its verdict, since effective samples of the wrong distribution are worth nothing.

Run: ``python benchmarks/posteriordb_ess.py [--posteriors NAME ...] [--seed 0]``
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from validation.posteriordb.control import run_nuts  # noqa: E402
from validation.posteriordb.posteriors import POSTERIORS  # noqa: E402
from validation.posteriordb.run import KERNELS, modes, run_one  # noqa: E402

#: The posteriors of at least 1,000 data points (the issue's "N >= 1,000").
MIN_N = 1000


def large_posteriors() -> list[str]:
    """The ports whose data have at least ``MIN_N`` rows."""
    names = []
    for name, posterior in sorted(POSTERIORS.items()):
        _, data = posterior.build()
        if posterior.num_data(data) >= MIN_N:
            names.append(name)
    return names


def _ess_per_second(summary: dict, cpu_s: float) -> float:
    return min(s["ess_bulk"] for s in summary.values()) / cpu_s


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--posteriors", nargs="*", default=None, help="default: N >= 1,000")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    names = args.posteriors or large_posteriors()
    print(
        "| posterior | data | NUTS ESS/s | "
        + " | ".join(f"{k} ESS/s (x NUTS)" for k in KERNELS)
        + " |"
    )
    print("|---|---|---|" + "---|" * len(KERNELS))
    for name in names:
        nuts = run_nuts(name, {"seed": args.seed})
        nuts_rate = _ess_per_second(nuts["summary"], nuts["cpu_s"])
        for mode in modes(name):
            cells = []
            for kernel in KERNELS:
                row = run_one(name, kernel, mode, args.seed)
                if "summary" not in row:
                    cells.append(row["verdict"])
                    continue
                rate = _ess_per_second(row["summary"], row["cpu_s"])
                verdict = "" if row["verdict"] == "right" else f", {row['verdict']}"
                cells.append(f"{rate:.3g} (x{rate / nuts_rate:.2g}{verdict})")
            print(f"| {name} | {mode} | {nuts_rate:.3g} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
