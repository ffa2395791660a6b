"""Issue 33's conjugate Bayesian linear regression against its exact posterior.

N = 1,000, d = 3, ``X ~ N(0, I)``, ``y = X @ [1, -2, 0.5] + 0.5 * noise``, ``w ~ Normal(0, 1)``,
noise sd 0.5 known, float64, seed 0; ``bdl.observe`` with a ``DataLoader`` of batch 100 and
with the full batch; thin 5, 2,000 kept draws, warm-up 500. For each kernel run with its
defaults it prints the worst ``|mean - exact|`` in exact sds and the range of sd ratios.

Usage::

    python -m validation.conjugate_regression [--warmup-steps 500] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import time
import warnings

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import MCMC
from torch.utils.data import DataLoader, TensorDataset

import pyro_bdl as bdl
from pyro_bdl.inference import SGHMC, SGLD, SGNHT

NOISE = 0.5
KERNELS = {
    "SGLD(model)": lambda m: SGLD(m, thin=5),
    "SGHMC(model)": lambda m: SGHMC(m, thin=5),
    "SGNHT(model)": lambda m: SGNHT(m, thin=5),
    "SGLD(model, step_size=0.01)": lambda m: SGLD(m, step_size=0.01, thin=5),
}


def data(num_data: int = 1000, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_data, 3, generator=generator, dtype=torch.float64)
    w = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    y = x @ w + NOISE * torch.randn(num_data, generator=generator, dtype=torch.float64)
    return x, y


def exact(x, y):
    precision = x.T @ x / NOISE**2 + torch.eye(3, dtype=torch.float64)
    covariance = torch.linalg.inv(precision)
    return covariance @ (x.T @ y) / NOISE**2, covariance.diagonal().sqrt()


def model(batch, num_data):
    xb, yb = batch
    w = pyro.sample("w", dist.Normal(torch.zeros(3, dtype=torch.float64), 1.0).to_event(1))
    bdl.observe("y", dist.Normal(xb @ w, NOISE), yb, num_data)


def run(name, batch_size, warmup_steps, num_samples, seed=0):
    x, y = data()
    mean, sd = exact(x, y)
    pyro.set_rng_seed(seed)
    if batch_size is None:
        args = ((x, y), len(y))
    else:
        args = (DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=True), len(y))
    kernel = KERNELS[name](model)
    mcmc = MCMC(kernel, num_samples=num_samples, warmup_steps=warmup_steps, disable_progbar=True)
    start = time.process_time()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mcmc.run(*args)
    w = mcmc.get_samples()["w"]
    ratio = w.std(0) / sd
    return {
        "kernel": name,
        "batch": batch_size or len(y),
        "mean_error_sds": float(((w.mean(0) - mean).abs() / sd).max()),
        "sd_ratio": [float(ratio.min()), float(ratio.max())],
        "step_size": kernel.adapted_step_size,
        "warned": [str(c.message)[:200] for c in caught if issubclass(c.category, RuntimeWarning)],
        "cpu_s": time.process_time() - start,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup-steps", type=int, default=500)
    parser.add_argument("--num-samples", type=int, default=2000)
    parser.add_argument("--kernels", default=";".join(KERNELS), help="semicolon-separated")
    parser.add_argument("--out")
    options = parser.parse_args()
    torch.set_default_dtype(torch.float64)
    rows = []
    for name in options.kernels.split(";"):
        for batch_size in (100, None):
            row = run(name, batch_size, options.warmup_steps, options.num_samples)
            rows.append(row)
            lo, hi = row["sd_ratio"]
            print(
                f"{name:30s} B={row['batch']:5d} mean err {row['mean_error_sds']:8.3g} sds, "
                f"sd ratio {lo:.2f}-{hi:.2f}, step {row['step_size']:.3g}, "
                f"warned {len(row['warned'])}, {row['cpu_s']:.1f} s",
                flush=True,
            )
    if options.out:
        with open(options.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
