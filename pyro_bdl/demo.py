"""``pyro-bdl demo``: the library's main path on real data, in a few minutes on a laptop.

A small Bayesian MLP on scikit-learn's bundled handwritten digits (1,797 real 8x8
images, offline) is fitted by MAP (SGHMC at T = 0, i.e. SGD with momentum), by SGHMC and
by SGLD at T = 1, all through ``pyro.infer.MCMC`` on minibatches. For each method the
demo prints test accuracy, NLL and ECE, and it writes to the output directory:

* ``posterior.nc``: the SGHMC draws as an ArviZ DataTree (with the test-set pointwise
  log likelihood), readable by ``xarray.open_datatree``;
* ``trace.png``: ``arviz_plots.plot_trace_dist`` of a few weights;
* ``reliability.png``: reliability diagrams of every method;
* ``results.json``: the numbers.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import MCMC
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader, TensorDataset

import pyro_bdl as bdl
from pyro_bdl import metrics, plots
from pyro_bdl.inference import SGHMC, SGLD
from pyro_bdl.predict import predict_proba

__all__ = ["run_demo", "DemoSettings"]


@dataclass
class DemoSettings:
    """Sizes of the demo; ``quick()`` is the CI-sized version."""

    hidden: int = 64
    batch_size: int = 64
    map_steps: int = 3000
    warmup_steps: int = 500
    num_samples: int = 100
    thin: int = 10
    prior_scale: float = 1.0

    @classmethod
    def quick(cls) -> DemoSettings:
        return cls(map_steps=300, warmup_steps=50, num_samples=20, thin=5)


def digits(seed: int = 0):
    """Train/test tensors of the digits data (pixels scaled to [0, 1])."""
    images, labels = load_digits(return_X_y=True)
    x = torch.tensor(images / 16.0, dtype=torch.float32)
    y = torch.tensor(labels, dtype=torch.long)
    return train_test_split(x, y, test_size=0.25, random_state=seed, stratify=y)


def classifier(net: bdl.LiftedModule):
    """The Pyro model of a Bayesian classifier: ``model((x, y), num_data) -> logits``."""

    def model(batch, num_data):
        x, y = batch
        logits = net(x)
        bdl.observe("y", dist.Categorical(logits=logits), y, num_data)
        return logits

    return model


def run_demo(out: str | Path = "results/demo", seed: int = 0, quick: bool = False) -> dict:
    """Run the demo and write its outputs; returns the metrics per method.

    :param out: output directory.
    :param int seed: seed of the split, the initialisation and the chains.
    :param bool quick: the small CI-sized run.
    """
    settings = DemoSettings.quick() if quick else DemoSettings()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    pyro.set_rng_seed(seed)
    x_train, x_test, y_train, y_test = digits(seed)
    num_data = len(x_train)
    loader = DataLoader(
        TensorDataset(x_train, y_train),
        batch_size=settings.batch_size,
        shuffle=True,
        drop_last=True,
    )
    module = torch.nn.Sequential(
        torch.nn.Linear(64, settings.hidden), torch.nn.Tanh(), torch.nn.Linear(settings.hidden, 10)
    )
    net = bdl.lift(module, prior=bdl.priors.IIDNormal(settings.prior_scale))
    model = classifier(net)
    test = (x_test, y_test)
    started = time.perf_counter()

    # SGHMC at T = 0 is SGD with momentum (lr = eps / mass, momentum = 1 - eps * friction).
    map_run = MCMC(
        SGHMC(model, step_size=0.1, friction=1.0, temperature=0.0),
        num_samples=1,
        warmup_steps=settings.map_steps,
        disable_progbar=False,
    )
    map_run.run(loader, num_data)
    theta_map = {name: value[-1] for name, value in map_run.get_samples().items()}
    runs = {"MAP (SGHMC, T=0)": theta_map}

    for name, kernel in (
        (
            "SGHMC",
            SGHMC(model, step_size=0.05, friction=1.0, thin=settings.thin, init_params=theta_map),
        ),
        ("SGLD", SGLD(model, step_size=0.02, thin=settings.thin, init_params=theta_map)),
    ):
        mcmc = MCMC(kernel, num_samples=settings.num_samples, warmup_steps=settings.warmup_steps)
        mcmc.run(loader, num_data)
        runs[name] = mcmc
    results, curves = {}, {}
    for name, run in runs.items():
        samples = (
            run.get_samples() if isinstance(run, MCMC) else {k: v[None] for k, v in run.items()}
        )
        probs = predict_proba(model, test, num_data, samples=samples).mean(0)
        results[name] = metrics.summarize(probs, y_test)
        curves[name] = (probs, y_test)

    idata = bdl.to_arviz(runs["SGHMC"], model_args=(test, num_data), log_likelihood=True)
    idata.to_netcdf(out / "posterior.nc", engine="h5netcdf")
    _trace_plot(runs["SGHMC"], out / "trace.png")
    plots.reliability_diagram(curves, out / "reliability.png", title="Digits, test set")
    summary = {
        "data": "sklearn digits",
        "num_train": num_data,
        "num_test": len(x_test),
        "settings": settings.__dict__,
        "seed": seed,
        "methods": results,
        "wall_time_s": time.perf_counter() - started,
        "version": bdl.__version__,
    }
    (out / "results.json").write_text(json.dumps(summary, indent=2))
    print(_table(results))
    print(f"wrote {out}/posterior.nc, trace.png, reliability.png, results.json")
    return summary


def _trace_plot(mcmc: MCMC, path: Path) -> None:
    import arviz_plots

    idata = bdl.to_arviz(mcmc, var_names=["2.bias"], max_coords_per_var=3)
    plot = arviz_plots.plot_trace_dist(idata, backend="matplotlib")
    plot.savefig(path)


def _table(results: dict) -> str:
    lines = ["| method | accuracy | NLL | ECE |", "|---|---|---|---|"]
    for name, m in results.items():
        lines.append(f"| {name} | {m['accuracy']:.3f} | {m['nll']:.3f} | {m['ece']:.3f} |")
    return "\n".join(lines)
