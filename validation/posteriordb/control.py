"""The NUTS control: Pyro's NUTS on each Pyro port, against posteriordb's reference.

Agreement of NUTS on the port with Stan's reference draws checks the port (model, data
and the wide priors that replace flat ones). Each posterior is run once, one chain with a
fixed seed, and its summary is stored in ``control.json`` with what it cost: wall and CPU
time (measured on whatever machine ran it) and gradient evaluations, NUTS's leapfrog steps
(``num_steps``) per iteration summed, during warm-up and sampling.

The control's tolerance is the issue's (mean within 0.3 reference sds, sd within 25 %)
tightened where Monte Carlo error allows: ``CONTROL_Z`` times the combined Monte Carlo
standard error of the two estimates, if that is smaller (:func:`control_tolerances`).

Usage::

    python -m validation.posteriordb.control [--posteriors NAME ...] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import pyro
import torch
from pyro.infer import MCMC, NUTS

from validation.posteriordb.extract import load_references
from validation.posteriordb.posteriors import POSTERIORS, stan_draws
from validation.posteriordb.summary import (
    MEAN_TOLERANCE,
    SD_TOLERANCE,
    agreement,
    summarise,
)

__all__ = [
    "CONTROL",
    "CONTROL_Z",
    "SETTINGS",
    "CountingNUTS",
    "control_tolerances",
    "load_control",
    "run_nuts",
]

#: The stored control summaries.
CONTROL = Path(__file__).resolve().parent / "control.json"
#: Standard errors a control estimate may be off by, where that is below the issue's bar.
CONTROL_Z = 4.0
#: NUTS's settings, the same for every posterior.
SETTINGS = {"warmup_steps": 300, "num_samples": 600, "seed": 0, "full_mass": True}


class CountingNUTS(NUTS):
    """Pyro's NUTS, counting its potential-energy gradient evaluations (``num_steps``
    summed) in ``gradient_evaluations``."""

    def setup(self, warmup_steps, *args, **kwargs):
        super().setup(warmup_steps, *args, **kwargs)
        self.gradient_evaluations = 0
        potential_fn = self.potential_fn

        def counted(params):
            self.gradient_evaluations += 1
            return potential_fn(params)

        self.potential_fn = counted


def run_nuts(name: str, settings: dict | None = None) -> dict:
    """Run NUTS on the port of posterior ``name``; its summary and cost."""
    settings = {**SETTINGS, **(settings or {})}
    posterior = POSTERIORS[name]
    reference = load_references()["posteriors"][name]["reference"]
    torch.set_default_dtype(torch.float64)
    pyro.set_rng_seed(settings["seed"])
    model, data = posterior.build()
    kernel = CountingNUTS(
        model, full_mass=settings["full_mass"], jit_compile=True, ignore_jit_warnings=True
    )
    counts = []
    mcmc = MCMC(
        kernel,
        num_samples=settings["num_samples"],
        warmup_steps=settings["warmup_steps"],
        hook_fn=lambda kernel, *_: counts.append(kernel.gradient_evaluations),
        disable_progbar=True,
    )
    wall, cpu = time.perf_counter(), time.process_time()
    mcmc.run(data, posterior.num_data(data))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    samples = mcmc.get_samples(group_by_chain=True)
    draws = stan_draws(posterior, samples, model, data, reference)
    warmup = counts[settings["warmup_steps"] - 1]
    return {
        **settings,
        "summary": summarise(draws),
        "wall_s": wall,
        "cpu_s": cpu,
        "gradient_evaluations": {"warmup": warmup, "sampling": counts[-1] - warmup},
        "divergences": len(mcmc.diagnostics()["divergences"]["chain 0"]),
    }


def control_tolerances(control: dict, reference: dict) -> tuple[dict, dict]:
    """Per parameter, the mean tolerance (in reference sds) and the sd tolerance (relative)
    that the control must meet: the issue's, or ``CONTROL_Z`` combined Monte Carlo standard
    errors where that is smaller."""
    means, sds = {}, {}
    for name, ref in reference.items():
        ours = control[name]
        mean_error = math.hypot(ours["mcse_mean"], ref["mcse_mean"]) / ref["sd"]
        sd_error = math.hypot(ours["mcse_sd"], ref["mcse_sd"]) / ref["sd"]
        means[name] = min(MEAN_TOLERANCE, CONTROL_Z * mean_error)
        sds[name] = min(SD_TOLERANCE, CONTROL_Z * sd_error)
    return means, sds


def load_control() -> dict:
    """``control.json``: posterior name -> :func:`run_nuts`'s result (empty before any run)."""
    return json.loads(CONTROL.read_text()) if CONTROL.exists() else {}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--posteriors", nargs="*", default=sorted(POSTERIORS))
    parser.add_argument("--out", type=Path, default=CONTROL)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    references = load_references()["posteriors"]
    for name in args.posteriors:
        # a stored entry's own settings (a longer warm-up, another seed) are kept
        stored = results.get(name, {})
        result = run_nuts(name, {key: stored[key] for key in SETTINGS if key in stored})
        reference = references[name]["reference"]
        tolerances = control_tolerances(result["summary"], reference)
        agree = agreement(result["summary"], reference, *tolerances)
        ess = min(s["ess_bulk"] for s in result["summary"].values())
        print(
            f"{name}: agrees={agree['right']} worst mean {agree['worst_mean']:.3f} sd "
            f"({agree['worst_mean_at']}), sd ratio {agree['sd_ratio'][0]:.3f}-"
            f"{agree['sd_ratio'][1]:.3f}, min ESS {ess:.0f}, "
            f"{sum(result['gradient_evaluations'].values())} gradients, "
            f"{result['wall_s']:.0f} s",
            flush=True,
        )
        results[name] = result
        args.out.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
