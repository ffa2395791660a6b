"""Write the NUTS references of ``reference_models`` to ``<name>.json`` (run once; minutes).

NUTS takes minutes on these models, longer than a test may, so its posterior means and
standard deviations are stored. Each file records the run that made it: Pyro's NUTS
(``target_accept_prob=0.9``, ``init_to_median``), its chains, warm-up and draws, and its
smallest bulk ESS over the compared coordinates, so a reader can judge the reference's
own Monte Carlo error (sd / sqrt(ESS) for a mean; about 1 / sqrt(2 ESS) relative for an
sd), and the largest rank-normalised split R-hat across its chains: a reference whose
chains disagree (above 1.01) is not a reference. The gaussian case is exact and written
without NUTS. On two cores Pyro runs the chains one after another.

``moons`` is a Bayesian neural network, whose posterior NUTS explores poorly in weight
space (the hidden units' permutations and sign flips make equivalent modes); its
reference is the posterior of the network's logits at fixed inputs, which the
symmetries leave unchanged, from four chains started apart (``init_to_median`` of
independent prior draws), and its R-hat says whether they found the same function.

Run: ``python tests/inference/sgmcmc/references/make_references.py [name ...]``
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import numpy as np
import pyro
import torch
from pyro.infer import MCMC, NUTS
from pyro.infer.autoguide.initialization import init_to_median

from pyro_bdl.diagnostics import ess_bulk, rhat

HERE = Path(__file__).parent
#: (chains, warm-up, draws per chain, max_tree_depth) per model
SETTINGS = {
    "breast_cancer": (2, 1000, 5000, 10),
    "regression": (2, 1000, 5000, 10),
    "eight_schools": (2, 1000, 10000, 10),
    "moons": (4, 500, 1000, 10),
}


def load_models():
    sys.path.insert(0, str(HERE.parents[2]))  # tests/, for tests/pyro_models.py
    spec = importlib.util.spec_from_file_location(
        "reference_models", HERE.parent / "reference_models.py"
    )
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write(name: str, sites: dict, run: dict) -> None:
    path = HERE / f"{name}.json"
    path.write_text(json.dumps({"run": run, "sites": sites}, indent=1) + "\n")
    print(f"wrote {path}")


def make(name: str, models) -> None:
    if name == "gaussian":
        sd = [1.0, 1000**-0.5]
        write(name, {"z": {"mean": [0.0, 0.0], "sd": sd}}, {"method": "exact"})
        return
    case = models.CASES[name]()
    chains, warmup, draws, depth = SETTINGS[name]
    pyro.set_rng_seed(0)
    kernel = NUTS(
        case.model, target_accept_prob=0.9, max_tree_depth=depth, init_strategy=init_to_median
    )
    mcmc = MCMC(kernel, draws, warmup, num_chains=chains, mp_context="fork", disable_progbar=True)
    start = time.perf_counter()
    mcmc.run(*case.args)
    seconds = time.perf_counter() - start
    grouped = mcmc.get_samples(group_by_chain=True)
    flat = {site: value.reshape(-1, *value.shape[2:]) for site, value in grouped.items()}
    compared = case.summarise(flat)
    by_chain = case.summarise({k: v.reshape(-1, *v.shape[2:]) for k, v in grouped.items()})
    per_chain = [values.reshape(chains, draws, -1).numpy() for values in by_chain.values()]
    ess = min(float(np.min(ess_bulk(values))) for values in per_chain)
    max_rhat = max(float(np.max(rhat(values))) for values in per_chain)
    sites = {
        site: {"mean": values.mean(0).tolist(), "sd": values.std(0).tolist()}
        for site, values in compared.items()
    }
    run = {
        "method": "pyro.infer.NUTS(target_accept_prob=0.9, init_strategy=init_to_median, "
        f"max_tree_depth={depth})",
        "chains": chains,
        "warmup_steps": warmup,
        "num_samples": draws,
        "min_bulk_ess": round(ess),
        "max_rhat": round(max_rhat, 4),
        "seconds": round(seconds),
        "torch": torch.__version__,
        "pyro": pyro.__version__,
    }
    print(name, "bulk ESS", round(ess), "R-hat", [np.round(rhat(v), 3) for v in per_chain])
    write(name, sites, run)


if __name__ == "__main__":
    torch.set_default_dtype(torch.float64)
    models = load_models()
    for name in sys.argv[1:] or ["gaussian", *SETTINGS]:
        make(name, models)
