"""Time pyro_bdl's R-hat + bulk ESS + tail ESS on a million coordinates against arviz_stats.

arviz_stats computes one coordinate at a time, so it is timed on a subset and compared per
coordinate; the subset's values are also checked against ours.

Run::

    python benchmarks/diagnostics.py                       # 10^6 coordinates, 4 x 100 draws
    python benchmarks/diagnostics.py --num-coords 100000 --num-threads 1
"""

import argparse
import time
import warnings

import arviz_base
import arviz_stats
import numpy as np

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


def main() -> None:
    args = parse_args()
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


if __name__ == "__main__":
    main()
