"""The runner's verdict on Stan's own draws: how often a perfect sampler is judged right.

A run is judged on ``num_samples`` kept draws against a reference of 10,000. On a
posterior with heavy tails the sd of 1,000 draws, even independent exact ones, scatters
by more than the verdict's 25 %, so a *wrong* there may be Monte Carlo error, not the
kernel's. This measures that floor: for each posterior, ``--repeats`` times, it judges
``--draws`` of posteriordb's reference draws, chosen at random without replacement, by
:func:`~validation.posteriordb.summary.agreement` against the summary of the other draws
(so the two never share a draw). A kernel's draws are correlated, with a bulk ESS below
their number, so the rate at ``--draws 1000`` is the most a kernel can expect from the
runner's 1,000 kept draws; ``--draws`` set to a run's ESS gives that run's share.

It writes ``{"posteriordb_commit", "num_draws", "repeats", "seed", "rates": {name:
fraction judged right}, "sd_ratio_interval": {name: {parameter: [2.5 %, 97.5 %]}}}``:
the rate and, for the parameters whose sd ratio leaves the tolerance in more than 5 % of
the repeats, the central 95 % of the ratio a perfect sampler produces.

Usage (needs a clone of posteriordb, as :mod:`.extract`)::

    python -m validation.posteriordb.perfect /path/to/posteriordb/.git \\
        [--posteriors ...] [--draws 1000] [--repeats 400] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from validation.posteriordb.extract import head_commit, reference_draws
from validation.posteriordb.posteriors import POSTERIORS
from validation.posteriordb.summary import SD_TOLERANCE, agreement

__all__ = ["PERFECT", "judge_reference"]

#: The stored rates (``python -m validation.posteriordb.perfect``'s default output).
PERFECT = Path(__file__).resolve().parent / "perfect.json"


def judge_reference(
    draws: dict[str, np.ndarray], num_draws: int, repeats: int, seed: int = 0
) -> tuple[float, dict[str, list[float]]]:
    """Judge ``repeats`` random subsets of ``num_draws`` of ``draws`` against the rest.

    :param dict draws: Stan parameter name -> draws of any shape (flattened here).
    :return: the fraction judged right, and for the parameters whose sd ratio left the
        tolerance in more than 5 % of the repeats, its 2.5 % and 97.5 % quantiles.
    """
    flat = {name: np.asarray(values, dtype=np.float64).ravel() for name, values in draws.items()}
    total = len(next(iter(flat.values())))
    rng = np.random.default_rng(seed)
    right, ratios = 0, {name: [] for name in flat}
    for _ in range(repeats):
        chosen = np.zeros(total, dtype=bool)
        chosen[rng.choice(total, num_draws, replace=False)] = True
        run = {name: _moments(values[chosen]) for name, values in flat.items()}
        rest = {name: _moments(values[~chosen]) for name, values in flat.items()}
        right += agreement(run, rest)["right"]
        for name in flat:
            ratios[name].append(run[name]["sd"] / rest[name]["sd"])
    intervals = {
        name: np.quantile(values, [0.025, 0.975]).tolist()
        for name, values in ratios.items()
        if np.mean(np.abs(np.asarray(values) - 1) > SD_TOLERANCE) > 0.05
    }
    return right / repeats, intervals


def _moments(values: np.ndarray) -> dict[str, float]:
    return {"mean": float(values.mean()), "sd": float(values.std(ddof=1))}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("git_dir", help="a git directory of stan-dev/posteriordb")
    parser.add_argument("--posteriors", nargs="*", default=sorted(POSTERIORS))
    parser.add_argument("--draws", type=int, default=1000, help="draws judged per repeat")
    parser.add_argument("--repeats", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=PERFECT)
    args = parser.parse_args(argv)
    output = {
        "posteriordb_commit": head_commit(args.git_dir),
        "num_draws": args.draws,
        "repeats": args.repeats,
        "seed": args.seed,
        "rates": {},
        "sd_ratio_interval": {},
    }
    for name in args.posteriors:
        draws = reference_draws(args.git_dir, name)
        rate, intervals = judge_reference(draws, args.draws, args.repeats, args.seed)
        output["rates"][name] = rate
        if intervals:
            output["sd_ratio_interval"][name] = intervals
        print(f"{name:<45} right {rate:.3f}  {intervals or ''}", flush=True)
    args.out.write_text(json.dumps(output, indent=1) + "\n")


if __name__ == "__main__":
    main()
