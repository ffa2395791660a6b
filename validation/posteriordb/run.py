"""Run the SGMCMC kernels with their defaults on the posteriordb ports and judge each run.

Each kernel is built as a user would, ``SGLD(model)``, ``SGHMC(model)``, ``SGNHT(model)``
(imported from :mod:`pyro_bdl.inference`, so ``PYTHONPATH=<other checkout>:.`` judges that
checkout's kernels), and run by ``pyro.infer.MCMC`` with the same ``warmup_steps`` and
``num_samples`` and ``thin`` on every posterior, in float64, one chain:

- **full batch**: the data tensors are the model's argument, the whole data set every step;
- **minibatch**, where the likelihood is exchangeable and N >= ``MIN_MINIBATCH_N`` (500): a
  ``DataLoader`` over a ``TensorDataset`` of the data, batch ``BATCH_SIZE`` (100),
  shuffled with the run's seed.

A run is **right** when every parameter's mean is within 0.3 reference sds of the
reference mean and its sd within 25 % of the reference sd; **warned** when it is not right
but the kernel warned (the warnings' text is kept, to read whether they name a cause and
a remedy); **error** when the kernel stopped with an error (its text kept); **wrong** when
it is not right and silent; **timeout** when it ran past ``--time-limit``. Each row also
gives the smallest bulk ESS over the parameters per 1,000 gradient evaluations (model
evaluations during the run, warm-up included); :mod:`.table` sets NUTS's beside it.

Usage::

    python -m validation.posteriordb.run [--kernels SGLD,SGHMC,SGNHT] [--posteriors ...]
        [--minibatch | --full-batch] [--seeds 0] [--warmup-steps 1000] [--num-samples 1000]
        [--thin 10] [--out FILE] [--draws DIR]
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import time
import warnings
from pathlib import Path

import pyro
import torch
from pyro.infer import MCMC
from safetensors.torch import save_file
from torch.utils.data import DataLoader, TensorDataset

import pyro_bdl
import pyro_bdl.inference
from validation.posteriordb.extract import load_references
from validation.posteriordb.posteriors import POSTERIORS, stan_draws
from validation.posteriordb.summary import agreement, summarise

__all__ = [
    "BATCH_SIZE",
    "KERNELS",
    "MIN_MINIBATCH_N",
    "SETTINGS",
    "modes",
    "run_one",
]

#: The kernels judged, by their names in :mod:`pyro_bdl.inference`.
KERNELS = ("SGLD", "SGHMC", "SGNHT")
#: What the runner chooses, the same for every posterior. Thinning by 10 keeps 1,000
#: draws from 10,000 steps: at thin 1 the kernels' draws have a bulk ESS of 10 - 60 on
#: the stiffer posteriors, and a 25 % sd tolerance judged on so few effective draws fails
#: correct chains by Monte Carlo error alone.
SETTINGS = {"warmup_steps": 1000, "num_samples": 1000, "thin": 10}
#: Minibatch runs where N is at least this.
MIN_MINIBATCH_N = 500
#: The minibatch size.
BATCH_SIZE = 100
#: Warnings that are about the code, not the run.
_IGNORED = (DeprecationWarning, PendingDeprecationWarning, FutureWarning)


class _TimeOut(Exception):
    pass


class _Counted:
    """The model, counting its evaluations (one per gradient the kernels take)."""

    def __init__(self, model):
        self.model, self.calls = model, 0
        functools.update_wrapper(self, model)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.model(*args, **kwargs)


def modes(name: str) -> list[str]:
    """The data modes a posterior is run in: ``"full"``, and ``"minibatch"`` where its
    likelihood is exchangeable and N >= ``MIN_MINIBATCH_N``."""
    posterior = POSTERIORS[name]
    _, data = posterior.build()
    minibatch = posterior.exchangeable and posterior.num_data(data) >= MIN_MINIBATCH_N
    return ["full", "minibatch"] if minibatch else ["full"]


def run_one(
    name: str,
    kernel: str,
    mode: str,
    seed: int = 0,
    settings: dict | None = None,
    time_limit: float = float("inf"),
    draws: Path | None = None,
    options: dict | None = None,
) -> dict:
    """One run of ``kernel`` with its defaults on posterior ``name``, judged.

    :param str mode: ``"full"`` or ``"minibatch"``.
    :param draws: a directory to write the kept draws to, one safetensors file a run
        (``<posterior>-<kernel>-<mode>-<seed>.safetensors``, Stan's parameter names), to
        judge them again without running them.
    :param dict options: more arguments of the kernel (``init_params``, ...), to try a
        warning's remedy; none for the table.
    :return: the row: verdict, agreement, ESS per 1,000 gradient evaluations, cost,
        warnings.
    """
    settings = {**SETTINGS, **(settings or {})}
    posterior = POSTERIORS[name]
    reference = load_references()["posteriors"][name]["reference"]
    torch.set_default_dtype(torch.float64)
    pyro.set_rng_seed(seed)
    model, data = posterior.build()
    num_data = posterior.num_data(data)
    if mode == "minibatch":
        generator = torch.Generator().manual_seed(seed)
        batches = DataLoader(
            TensorDataset(*data), batch_size=BATCH_SIZE, shuffle=True, generator=generator
        )
        args = (batches, num_data)
    elif mode == "full":
        args = (data, num_data)
    else:
        raise ValueError(f"mode must be 'full' or 'minibatch', got {mode!r}")
    counted = _Counted(model)
    sampler = getattr(pyro_bdl.inference, kernel)(counted, thin=settings["thin"], **(options or {}))
    row = {"posterior": name, "kernel": kernel, "mode": mode, "seed": seed, **settings}
    if mode == "minibatch":
        row["batch_size"] = BATCH_SIZE
    start, cpu = time.perf_counter(), time.process_time()

    def stop_late(*_):
        if time.perf_counter() - start > time_limit:
            raise _TimeOut

    mcmc = MCMC(
        sampler,
        warmup_steps=settings["warmup_steps"],
        num_samples=settings["num_samples"],
        hook_fn=stop_late,
        disable_progbar=True,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            mcmc.run(*args)
        except _TimeOut:
            row["verdict"] = "timeout"
        except Exception as error:  # a kernel that stops says why; the row keeps it
            row.update(verdict="error", error=f"{type(error).__name__}: {error}")
    row.update(
        wall_s=time.perf_counter() - start,
        cpu_s=time.process_time() - cpu,
        gradient_evaluations=counted.calls,
        warnings=list(
            dict.fromkeys(
                f"{w.category.__name__}: {w.message}"
                for w in caught
                if not issubclass(w.category, _IGNORED)
            )
        ),
        adapted_step_size=getattr(sampler, "adapted_step_size", None),
    )
    if "verdict" in row:
        return row
    samples = mcmc.get_samples(group_by_chain=True)
    stan = stan_draws(posterior, samples, model, data, reference)
    if draws is not None:
        draws.mkdir(parents=True, exist_ok=True)
        tensors = {key: torch.as_tensor(value).contiguous() for key, value in stan.items()}
        save_file(tensors, draws / f"{name}-{kernel}-{mode}-{seed}.safetensors")
    summary = summarise(stan)
    agree = agreement(summary, reference)
    ess = min(s["ess_bulk"] for s in summary.values())
    row.update(
        verdict="right" if agree["right"] else "warned" if row["warnings"] else "wrong",
        worst_mean=agree["worst_mean"],
        worst_mean_at=agree["worst_mean_at"],
        sd_ratio=agree["sd_ratio"],
        worst_sd_at=agree["worst_sd_at"],
        ess_bulk_min=ess,
        ess_per_1k=1000 * ess / counted.calls,
        summary=summary,
    )
    return row


def _provenance() -> dict:
    """Which pyro_bdl the kernels came from: its path and, in a git checkout, its commit."""
    where = Path(pyro_bdl.__file__).resolve().parent
    commit = subprocess.run(
        ["git", "-C", str(where), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    return {"pyro_bdl": str(where), "commit": commit or None}


def _line(row: dict) -> str:
    cells = [f"{row['posterior']:<45}", f"{row['kernel']:<6}", f"{row['mode']:<9}"]
    cells.append(f"{row['verdict']:<7}")
    if "worst_mean" in row:
        low, high = row["sd_ratio"]
        cells.append(
            f"mean {row['worst_mean']:8.3g} sd  sd x{low:.2f}-{high:.2f}  "
            f"ESS/1k grad {row['ess_per_1k']:.3g}"
        )
    cells.append(f"{row['wall_s']:.0f} s")
    return "  ".join(cells)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", default=",".join(KERNELS), help="comma-separated")
    parser.add_argument("--posteriors", nargs="*", default=sorted(POSTERIORS))
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--minibatch", action="store_true", help="only the minibatch runs")
    which.add_argument("--full-batch", action="store_true", help="only the full-batch runs")
    parser.add_argument("--seeds", default="0", help="comma-separated")
    parser.add_argument("--warmup-steps", type=int, default=SETTINGS["warmup_steps"])
    parser.add_argument("--num-samples", type=int, default=SETTINGS["num_samples"])
    parser.add_argument("--thin", type=int, default=SETTINGS["thin"], help="kept draws' stride")
    parser.add_argument("--time-limit", type=float, default=600.0, help="seconds per run")
    parser.add_argument("--out", type=Path, default=Path("results/posteriordb/run.json"))
    parser.add_argument("--draws", type=Path, help="a directory to keep each run's draws in")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.posteriors) - set(POSTERIORS))
    if unknown:
        parser.error(f"--posteriors: unknown {unknown}; known: {sorted(POSTERIORS)}")
    torch.set_num_threads(1)
    settings = {
        "warmup_steps": args.warmup_steps,
        "num_samples": args.num_samples,
        "thin": args.thin,
    }
    output = {
        **_provenance(),
        "settings": {**settings, "batch_size": BATCH_SIZE, "min_minibatch_n": MIN_MINIBATCH_N},
        "rows": [],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for name in args.posteriors:
        for mode in modes(name):
            if (args.minibatch and mode == "full") or (args.full_batch and mode != "full"):
                continue
            for kernel in args.kernels.split(","):
                for seed in (int(s) for s in args.seeds.split(",")):
                    row = run_one(name, kernel, mode, seed, settings, args.time_limit, args.draws)
                    print(_line(row), flush=True)
                    output["rows"].append(row)
                    args.out.write_text(json.dumps(output, indent=1) + "\n")


if __name__ == "__main__":
    main()
