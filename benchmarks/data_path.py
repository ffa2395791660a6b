"""Milliseconds per step of four inference routines fed in-memory data four ways.

The model is a linear regression on 26 features (the size of posteriordb's diamonds;
synthetic data, float64), ``N`` = 5,000 and 100,000 examples, batches of ``B`` = 64, 500
and ``N``. The data paths:

* ``collated``: ``DataLoader(TensorDataset(X, y), batch_size=B, shuffle=True)`` iterated
  as PyTorch does, fetching and stacking ``B`` examples one by one (what every routine
  paid before issue 39; a ``DataLoader`` subclass, which ``Minibatches`` leaves alone);
* ``plain``: the same loader as it is passed today, which
  :class:`~pyro_bdl.inference.Minibatches` iterates through
  :func:`~pyro_bdl.data.tensor_loader.sliced` (the same batches, by index);
* ``TensorLoader``: ``TensorLoader((X, y), batch_size=B, shuffle=True)``;
* ``direct``: the tensors themselves, the first ``B`` rows, with ``num_data=N``: the
  model's cost with no loader at all.

The routines: a step of SGLD and of SGHMC with a fixed step size (no warm-up adaptation:
only the data path differs), as ``pyro.infer.MCMC`` calls them (``kernel.sample``); the
curvature pass of :meth:`~pyro_bdl.inference.LaplaceGuide.fit` (what a fit with
``map=False`` runs after its set-up), per batch (the ``direct`` pass is one batch, which
alone carries the pass's fixed costs that a loader's ``N / B`` batches share); a step of
SVI with a :class:`~pyro_bdl.inference.MeanFieldGuide` (``TraceMeanField_ELBO``, Adam),
the batch from ``Minibatches.next()``; and, in a table of its own, ``Minibatches.next()``
alone, the data path's own cost (in microseconds), which every step above starts with.
Each figure is the median over ``--rounds`` rounds; a round runs the four paths of every
routine and case one after the other, in a new random order every round, each for at
least ``--seconds`` (a Laplace pass at least once), so a load on a shared machine hits
every path alike, and each ratio is the median of the ratios within each round. One
thread.

The target (issue 39): ``TensorLoader`` within 1.2 x the ``direct`` path at every ``B``.

Run: ``python benchmarks/data_path.py [--rounds 5] [--seconds 0.3] [--sizes 5000 100000]
[--clock cpu]``
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI, TraceMeanField_ELBO
from torch.utils.data import DataLoader, TensorDataset

import pyro_bdl as bdl
from pyro_bdl.data import TensorLoader
from pyro_bdl.inference import SGHMC, SGLD, LaplaceGuide, MeanFieldGuide, Minibatches
from pyro_bdl.inference.laplace.curvature_pass import accumulate
from pyro_bdl.inference.minibatch import DataPass

FEATURES = 26
PATHS = ("collated", "plain", "TensorLoader", "direct")
ROUTINES = ("next batch", "SGLD", "SGHMC", "Laplace pass", "mean-field SVI")
TARGET = 1.2


class Collated(DataLoader):
    """PyTorch's DataLoader as it iterates: one example at a time, then ``default_collate``."""


def regression(num_data: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(num_data, FEATURES, generator=generator, dtype=torch.float64)
    weights = torch.randn(FEATURES, generator=generator, dtype=torch.float64)
    return x, x @ weights + torch.randn(num_data, generator=generator, dtype=torch.float64)


def linear_model() -> Callable:
    torch.manual_seed(0)
    net = bdl.lift(torch.nn.Linear(FEATURES, 1).double(), bdl.priors.IIDNormal(1.0))

    def model(batch, num_data):
        x, y = batch
        bdl.observe("y", dist.Normal(net(x).squeeze(-1), 1.0), y, num_data)

    return model


def data_paths(x: torch.Tensor, y: torch.Tensor, batch_size: int) -> dict[str, object]:
    """The model's first argument for each path."""
    seeded = {"generator": torch.Generator().manual_seed(0)}
    dataset = TensorDataset(x, y)
    return {
        "collated": Collated(dataset, batch_size=batch_size, shuffle=True, **seeded),
        "plain": DataLoader(dataset, batch_size=batch_size, shuffle=True, **seeded),
        "TensorLoader": TensorLoader((x, y), batch_size=batch_size, shuffle=True, seed=0),
        "direct": (x[:batch_size], y[:batch_size]),
    }


def kernel_steps(kind: type, model: Callable, data: object, num_data: int) -> Callable:
    """One step of a fixed SGMCMC kernel per call, as ``pyro.infer.MCMC`` makes it."""
    kernel = kind(
        model,
        step_size=0.1 / num_data,  # a tenth of the stable step of this likelihood
        adapt_step_size=False,
        adapt_mass_matrix=False,
        keep_draws=False,
    )
    kernel.setup(0, data, num_data)
    params = kernel.initial_params

    def step() -> int:
        nonlocal params
        params = kernel.sample(params)
        return 1

    return step


def laplace_passes(guide: LaplaceGuide, model: Callable, data: object, num_data: int):
    """One curvature pass per call; returns its batches."""
    batches = DataPass(model, (data, num_data), {})

    def one_pass() -> int:
        accumulate(guide, model, batches, progress=False, gradient=False)
        return batches.runs

    return one_pass


def next_batches(data: object, num_data: int) -> Callable:
    """The data path alone: ``Minibatches.next()``, what every step above starts with."""
    batches = Minibatches((data, num_data), {})

    def step() -> int:
        batches.next()
        return 1

    return step


def svi_steps(svi: SVI, data: object, num_data: int) -> Callable:
    batches = Minibatches((data, num_data), {})

    def step() -> int:
        args, kwargs = batches.next()
        svi.step(*args, **kwargs)
        return 1

    return step


def case_runners(num_data: int, batch_size: int) -> dict[tuple[str, str], Callable]:
    """(routine, path) -> a callable doing some steps and returning how many."""
    x, y = regression(num_data)
    paths = data_paths(x, y, batch_size)
    model = linear_model()
    pyro.clear_param_store()
    laplace = LaplaceGuide(model).fit(
        paths["direct"], num_data, map=False, mode_tolerance=None, progress=False
    )
    mean_field = MeanFieldGuide(model)
    svi = SVI(model, mean_field, pyro.optim.Adam({"lr": 1e-3}), TraceMeanField_ELBO())
    runners = {}
    for path, data in paths.items():
        runners["next batch", path] = next_batches(data, num_data)
        runners["SGLD", path] = kernel_steps(SGLD, model, data, num_data)
        runners["SGHMC", path] = kernel_steps(SGHMC, model, data, num_data)
        runners["Laplace pass", path] = laplace_passes(laplace, model, data, num_data)
        runners["mean-field SVI", path] = svi_steps(svi, data, num_data)
    return runners


def per_step_ms(run: Callable, seconds: float, clock: Callable[[], float]) -> float:
    """Milliseconds per step over at least ``seconds`` of steps (at least one call)."""
    steps, start = 0, clock()
    while True:
        steps += run()
        elapsed = clock() - start
        if elapsed >= seconds:
            return 1e3 * elapsed / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=0.3, help="per path and round")
    parser.add_argument("--sizes", type=int, nargs="+", default=[5_000, 100_000])
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 500], help="and N")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    args = parser.parse_args()
    torch.set_num_threads(1)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    cases = [(n, b) for n in args.sizes for b in (*args.batches, n) if b <= n]
    runners = {case: case_runners(*case) for case in cases}
    for case_runs in runners.values():  # warm up every path (first epochs, allocations)
        for run in case_runs.values():
            run()
    times: dict[tuple, list[float]] = {}
    order = random.Random(0)
    for _ in range(args.rounds):
        for case, case_runs in runners.items():
            for routine in ROUTINES:
                # the paths of a routine one after the other, in a new order every round
                for path in order.sample(PATHS, len(PATHS)):
                    ms = per_step_ms(case_runs[routine, path], args.seconds, clock)
                    times.setdefault((*case, routine, path), []).append(ms)
    medians = {key: statistics.median(values) for key, values in times.items()}
    print(f"median of {args.rounds} rounds, {args.clock} clock, 1 thread\n")
    print("Minibatches.next() alone, us per batch")
    print("| N | B | " + " | ".join(PATHS) + " |")
    print("|---|---|" + "---|" * len(PATHS))
    for num_data, batch_size in cases:
        cells = " | ".join(
            f"{1e3 * medians[num_data, batch_size, 'next batch', p]:.3g}" for p in PATHS
        )
        print(f"| {num_data} | {_size(num_data, batch_size)} | {cells} |")
    print("\nms per step; ratios to the direct path (median over rounds of each round's)")
    print(
        "| routine | N | B | " + " | ".join(PATHS) + " | TensorLoader / direct | plain / direct |"
    )
    print("|---|---|---|" + "---|" * (len(PATHS) + 2))
    worst = 0.0
    for routine in ROUTINES[1:]:
        for num_data, batch_size in cases:
            ms = {p: medians[num_data, batch_size, routine, p] for p in PATHS}
            fast, plain = (
                _paired_ratio(times, (num_data, batch_size, routine), path, "direct")
                for path in ("TensorLoader", "plain")
            )
            worst = max(worst, fast)
            cells = " | ".join(f"{ms[p]:.3g}" for p in PATHS)
            size = _size(num_data, batch_size)
            print(f"| {routine} | {num_data} | {size} | {cells} | {fast:.2f} | {plain:.2f} |")
    verdict = "met" if worst <= TARGET else "missed"
    print(f"\nworst TensorLoader / direct: {worst:.2f} (target <= {TARGET}: {verdict})")


def _paired_ratio(times: dict, case: tuple, path: str, reference: str) -> float:
    """The median over rounds of the ratio within each round (a load that changes from
    round to round cancels out of it)."""
    pairs = zip(times[(*case, path)], times[(*case, reference)])
    return statistics.median(ours / theirs for ours, theirs in pairs)


def _size(num_data: int, batch_size: int) -> str:
    return "N" if batch_size == num_data else str(batch_size)


if __name__ == "__main__":
    main()
