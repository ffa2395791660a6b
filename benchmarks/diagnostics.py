"""Time pyro_bdl's R-hat + bulk ESS + tail ESS on a million coordinates against arviz_stats,
and measure the peak memory of ``summary`` streaming a draw store larger than its memory cap.

arviz_stats computes one coordinate at a time, so it is timed on a subset and compared per
coordinate; the subset's values are also checked against ours.

The store part writes ``--store-chains`` chains of ``--store-draws`` draws of a million
float32 weights as the SGMCMC checkpoints do (one chunked zarr store per chain), then, in
a child process whose address space is capped at ``--memory-cap-gb`` (``RLIMIT_AS``),
opens them lazily with ``bdl.to_arviz(path)`` and runs ``bdl.diagnostics.summary``. It
reports the child's peak resident memory, checks a subset against the in-memory result,
and shows that loading the draws eagerly under the same cap fails.

Run::

    python benchmarks/diagnostics.py                       # 10^6 coordinates, 4 x 100 draws
    python benchmarks/diagnostics.py --num-coords 100000 --num-threads 1
    python benchmarks/diagnostics.py --skip-timing --store-draws 1000   # a 15 GiB store
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import arviz_base
import arviz_stats
import numpy as np
import torch

from pyro_bdl import diagnostics


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-coords", type=int, default=1_000_000)
    parser.add_argument("--num-chains", type=int, default=4)
    parser.add_argument("--num-draws", type=int, default=100)
    parser.add_argument("--arviz-coords", type=int, default=2_000)
    parser.add_argument("--chunk-size", type=int, default=diagnostics.DEFAULT_CHUNK_SIZE)
    parser.add_argument("--num-threads", type=int, default=diagnostics.DEFAULT_NUM_THREADS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-timing", action="store_true", help="only the store part")
    parser.add_argument("--skip-store", action="store_true", help="only the timing part")
    parser.add_argument("--store-chains", type=int, default=4)
    parser.add_argument("--store-draws", type=int, default=100)
    parser.add_argument("--store-dir", type=Path, default=None, help="default: a temp dir")
    parser.add_argument("--memory-cap-gb", type=float, default=1.5)
    parser.add_argument("--child", choices=["summary", "eager"], help=argparse.SUPPRESS)
    return parser.parse_args()


def autocorrelated_draws(args: argparse.Namespace) -> np.ndarray:
    """AR(1) chains (coefficient 0.5) in float32, the dtype of network weights."""
    rng = np.random.default_rng(args.seed)
    shape = (args.num_chains, args.num_draws, args.num_coords)
    draws = rng.standard_normal(shape, dtype=np.float32)
    for t in range(1, args.num_draws):
        draws[:, t] += 0.5 * draws[:, t - 1]
    return draws


def time_pyro_bdl(draws: np.ndarray, args: argparse.Namespace) -> tuple[float, float, np.ndarray]:
    """Wall-clock and CPU seconds (all threads) of ``diagnose``, and its result."""
    start, start_cpu = time.perf_counter(), time.process_time()
    result = diagnostics.diagnose(draws, chunk_size=args.chunk_size, num_threads=args.num_threads)
    return time.perf_counter() - start, time.process_time() - start_cpu, np.stack(result)


def time_arviz(draws: np.ndarray) -> tuple[float, np.ndarray]:
    idata = arviz_base.from_dict({"posterior": {"w": draws.astype(np.float64)}})
    start = time.perf_counter()
    result = [
        arviz_stats.rhat(idata)["w"].values,
        arviz_stats.ess(idata, method="bulk")["w"].values,
        arviz_stats.ess(idata, method="tail")["w"].values,
    ]
    return time.perf_counter() - start, np.stack(result)


def time_against_arviz(args: argparse.Namespace) -> None:
    draws = autocorrelated_draws(args)
    print(
        f"{args.num_coords:,} coordinates, {args.num_chains} chains x {args.num_draws} draws, "
        f"chunk_size={args.chunk_size}, num_threads={args.num_threads}"
    )
    ours_s, ours_cpu_s, ours = time_pyro_bdl(draws, args)
    subset = draws[:, :, : args.arviz_coords]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        arviz_s, reference = time_arviz(subset)
    ours_per = ours_s / args.num_coords
    arviz_per = arviz_s / subset.shape[-1]
    max_rel = np.max(np.abs(ours[:, : subset.shape[-1]] - reference) / np.abs(reference))
    print(
        f"pyro_bdl.diagnostics.diagnose: {ours_s:8.2f} s  ({1e6 * ours_per:7.2f} us / coord; "
        f"{ours_cpu_s:.2f} s CPU over all threads)"
    )
    print(
        f"arviz_stats rhat + ess x 2:    {arviz_s:8.2f} s  ({1e6 * arviz_per:7.2f} us / coord, "
        f"{subset.shape[-1]:,} coords)"
    )
    print(f"per-coordinate speed-up: {arviz_per / ours_per:.1f}x")
    print(f"max relative difference on the subset: {max_rel:.1e}")


# -- streaming a store larger than memory -----------------------------------------------------

STORE_SHAPE = (1000, 1000)  # one site of a million weights
CHECKED_ROWS = 3  # rows of the site (3,000 coordinates) checked against the in-memory result


def write_store(args: argparse.Namespace, root: Path) -> int:
    """AR(1) draws (coefficient 0.5) written chain by chain as a checkpoint writes them."""
    from pyro_bdl.inference.sgmcmc.store import DrawStore

    rng = np.random.default_rng(args.seed)
    for chain in range(args.store_chains):
        store = DrawStore(root / f"chain_{chain}" / "draws.zarr", chain)
        previous = np.zeros(STORE_SHAPE, np.float32)
        for _ in range(args.store_draws):
            previous = 0.5 * previous + rng.standard_normal(STORE_SHAPE, dtype=np.float32)
            store.append({"w": torch.from_numpy(previous)}, {"potential_energy": 0.0})
            if store.chunk_is_full:
                store.flush()
        store.flush()
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())


def run_child(args: argparse.Namespace, root: Path, what: str) -> subprocess.CompletedProcess:
    cap = int(args.memory_cap_gb * 2**30)

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    command = [sys.executable, __file__, "--child", what, "--store-dir", str(root)]
    # few malloc arenas: each thread's 64 MB arena reservation would count against the cap
    env = {**os.environ, "MALLOC_ARENA_MAX": "2"}
    return subprocess.run(
        command, preexec_fn=limit, capture_output=True, text=True, env=env, check=False
    )


def child(args: argparse.Namespace) -> None:
    """Runs under the memory cap: summarise the store lazily, or load it eagerly."""
    import pyro_bdl as bdl

    tree = bdl.to_arviz(args.store_dir)
    baseline_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # imports (torch) and metadata
    start = time.perf_counter()
    if args.child == "eager":
        np.asarray(tree["posterior"]["w"])
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        result = bdl.diagnostics.summary(tree, var_names=["w"])["w"]
    seconds = time.perf_counter() - start
    subset = np.asarray(tree["posterior"]["w"][:, :, :CHECKED_ROWS])
    expected = np.stack(diagnostics.diagnose(subset))
    got = result.sel(summary=["r_hat", "ess_bulk", "ess_tail"]).values[:, :CHECKED_ROWS]
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(
        json.dumps(
            {
                "seconds": seconds,
                "peak_rss_bytes": peak_kb * 1024,
                "baseline_rss_bytes": baseline_kb * 1024,
                "max_rhat": float(result.sel(summary="r_hat").max()),
                "max_relative_difference": float(np.max(np.abs(got - expected) / expected)),
            }
        )
    )


def measure_store(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(dir=args.store_dir) as directory:
        root = Path(directory)
        start = time.perf_counter()
        size = write_store(args, root)
        written = time.perf_counter() - start
        cap = args.memory_cap_gb * 2**30
        print(
            f"\nstore: {args.store_chains} chains x {args.store_draws} draws x "
            f"{np.prod(STORE_SHAPE):,} float32 weights = {size / 2**30:.2f} GiB on disk "
            f"(written in {written:.1f} s); child memory cap (RLIMIT_AS) {args.memory_cap_gb} GiB"
        )
        lazy = run_child(args, root, "summary")
        if lazy.returncode != 0:
            raise RuntimeError(f"summary under the cap failed:\n{lazy.stderr[-2000:]}")
        result = json.loads(lazy.stdout.strip().splitlines()[-1])
        print(
            f"bdl.diagnostics.summary(bdl.to_arviz(path)): {result['seconds']:.1f} s, peak RSS "
            f"{result['peak_rss_bytes'] / 2**30:.2f} GiB = {result['peak_rss_bytes'] / size:.2f} "
            f"x the store ({size / cap:.1f} x the cap), of which "
            f"{result['baseline_rss_bytes'] / 2**30:.2f} GiB before summary (imports, metadata); "
            f"max R-hat {result['max_rhat']:.3f}; "
            f"max relative difference on {CHECKED_ROWS * STORE_SHAPE[1]:,} coordinates "
            f"{result['max_relative_difference']:.1e}"
        )
        eager = run_child(args, root, "eager")
        outcome = (
            "fails (MemoryError)"
            if "MemoryError" in eager.stderr
            else (f"exit code {eager.returncode}")
        )
        print(f"loading the same draws eagerly under the cap: {outcome}")


def main() -> None:
    args = parse_args()
    if args.child:
        child(args)
        return
    if not args.skip_timing:
        time_against_arviz(args)
    if not args.skip_store:
        measure_store(args)


if __name__ == "__main__":
    main()
