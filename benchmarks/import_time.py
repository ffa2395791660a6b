"""What ``import pyro_bdl`` costs on top of ``import pyro``.

A Pyro user sampling a regression should not pay for an LLM stack on every start: the
package and ``pyro_bdl.inference`` load neither transformers nor peft (the Hugging Face side
loads when a model constructor is called). Each statement runs in a fresh interpreter,
``--rounds`` times, alternating with the reference so that a busy machine slows both alike;
the script prints the median wall time and CPU time (user + system: on a shared machine
the steadier figure) of each, interpreter start-up included (the same for both), and their
ratios. Target: ``import pyro_bdl`` within 1.5x of ``import pyro``.

Run: ``python benchmarks/import_time.py [--rounds 7]``
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time

REFERENCE = "import pyro"
STATEMENTS = (
    "import pyro_bdl",
    "from pyro_bdl.inference import SGHMC, LaplaceGuide, BLoBGuide, IVONGuide",
)


def seconds(statement: str) -> tuple[float, float]:
    """Wall and CPU (user + system) time of a fresh interpreter running ``statement``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", statement], check=True, env=os.environ.copy())
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="fresh interpreters per statement")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be positive, got {args.rounds}")
    statements = (REFERENCE, *STATEMENTS)
    seconds(";".join(statements))  # warm the file system cache before timing
    times: dict[str, list[tuple[float, float]]] = {statement: [] for statement in statements}
    for _ in range(args.rounds):
        for statement in statements:
            times[statement].append(seconds(statement))
    medians = {
        statement: [statistics.median(run[k] for run in runs) for k in (0, 1)]
        for statement, runs in times.items()
    }
    wall, cpu = medians[REFERENCE]
    print(f"median of {args.rounds} fresh interpreters each (start-up included): wall, CPU")
    print(f"{REFERENCE:<74s} {wall:6.2f} s {cpu:6.2f} s")
    for statement in STATEMENTS:
        ratios = [medians[statement][k] / medians[REFERENCE][k] for k in (0, 1)]
        print(
            f"{statement:<74s} {medians[statement][0]:6.2f} s {medians[statement][1]:6.2f} s"
            f"  {ratios[0]:4.2f}x {ratios[1]:4.2f}x  (target <= 1.5x)"
        )


if __name__ == "__main__":
    main()
