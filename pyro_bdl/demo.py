"""``pyro-bdl demo``: the library's main path on real data, in a few minutes on a laptop.

A small Bayesian MLP on scikit-learn's bundled handwritten digits (1,797 real 8x8
images, offline) is fitted by MAP (SGHMC at T = 0, i.e. SGD with momentum), by SGHMC and
by SGLD at T = 1, all through ``pyro.infer.MCMC`` on minibatches, and by Laplace
approximations at the MAP (diagonal GGN and K-FAC, prior precision by marginal
likelihood, linearised predictive). Given a data directory with SST-2
(``--data-dir``), a LoRA language model follows: the pretrained all-MiniLM-L6-v2 with
LoRA adapters fine-tuned on a subset of SST-2 by MAP, then K-FAC Laplace-LoRA, and BLoB.
For each method the demo prints test accuracy, NLL and ECE, and it writes to the output
directory:

* ``posterior.nc``: the SGHMC draws as an ArviZ DataTree (with the test-set pointwise
  log likelihood), readable by ``xarray.open_datatree``;
* ``trace.png``: ``arviz_plots.plot_trace_dist`` of a few weights;
* ``reliability.png``: reliability diagrams of every digits method
  (``reliability_lora.png`` for the LoRA model);
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
from pyro_bdl.inference import SGHMC, SGLD, LaplaceGuide, baselines
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
    lora_train: int = 512
    lora_test: int = 256
    lora_steps: int = 96
    lora_batch_size: int = 16

    @classmethod
    def quick(cls) -> DemoSettings:
        return cls(
            map_steps=300,
            warmup_steps=50,
            num_samples=20,
            thin=5,
            lora_train=64,
            lora_test=32,
            lora_steps=8,
        )


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


def run_demo(
    out: str | Path = "results/demo",
    seed: int = 0,
    quick: bool = False,
    data_dir: str | Path | None = None,
) -> dict:
    """Run the demo and write its outputs; returns the metrics per method.

    :param out: output directory.
    :param int seed: seed of the split, the initialisation and the chains.
    :param bool quick: the small CI-sized run.
    :param data_dir: a directory with SST-2 (``sst2/train.tsv``, ``sst2/dev.tsv``) for
        the LoRA language-model part; without it that part is skipped.
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
    for name, curvature in (
        ("Laplace diag GGN (GLM)", "diag_ggn"),
        ("Laplace K-FAC (GLM)", "kron"),
    ):
        guide = LaplaceGuide(model, curvature=curvature)
        guide.fit(loader, num_data, map=theta_map, progress=False)
        guide.optimize_prior_precision("marglik")
        probs = guide.predictive(test, num_data, link="mc", num_samples=200)
        results[name] = metrics.summarize(probs, y_test)
        curves[name] = (probs, y_test)

    idata = bdl.to_arviz(runs["SGHMC"], model_args=(test, num_data), log_likelihood=True)
    idata.to_netcdf(out / "posterior.nc", engine="h5netcdf")
    _trace_plot(runs["SGHMC"], out / "trace.png")
    plots.reliability_diagram(curves, out / "reliability.png", title="Digits, test set")
    lora_results = _lora_section(Path(data_dir), settings, seed, out) if data_dir else {}
    summary = {
        "data": "sklearn digits",
        "num_train": num_data,
        "num_test": len(x_test),
        "settings": settings.__dict__,
        "seed": seed,
        "methods": results,
        "lora_methods": lora_results,
        "wall_time_s": time.perf_counter() - started,
        "version": bdl.__version__,
    }
    (out / "results.json").write_text(json.dumps(summary, indent=2))
    print("Bayesian MLP on digits (test set)")
    print(_table(results))
    if lora_results:
        print("MiniLM + LoRA on SST-2 (dev subset)")
        print(_table(lora_results))
    print(f"wrote {out}/posterior.nc, trace.png, reliability*.png, results.json")
    return summary


def _lora_section(data_dir: Path, settings: DemoSettings, seed: int, out: Path) -> dict:
    """MiniLM + LoRA on an SST-2 subset: MAP, K-FAC Laplace-LoRA (GLM predictive), BLoB."""
    from pyro_bdl import data
    from pyro_bdl.models import lora_model

    train = data.load("sst2", data_dir, "train", seed=seed, limit=settings.lora_train)
    test = data.load("sst2", data_dir, "test", seed=seed, limit=settings.lora_test)
    num_data = len(train)
    lora = lora_model("minilm", "classification", num_labels=2, prior_scale=0.2)
    collate = data.ClassificationCollator(lora.tokenizer, max_length=64)
    loader = data.make_loader(train, collate, settings.lora_batch_size, shuffle=True, seed=seed)
    test_batch = collate(list(test))
    labels = test_batch["labels"]
    results, curves = {}, {}

    # The papers' MAP: AdamW whose small decoupled decay stands for the prior. Adam on the
    # lifted log joint would not fine-tune: with LoRA's B at zero, A gets only the prior's
    # gradient at first, and Adam's normalised steps shrink it to zero.
    predictor = baselines.map_estimate(
        lora.model, loader, num_data, num_steps=settings.lora_steps, lr=1e-3, progress=True
    )
    theta_map = {site: value[0] for site, value in predictor.members[0].samples.items()}
    probs = predictor(test_batch, num_data)[0]
    results["MAP"], curves["MAP"] = metrics.summarize(probs, labels), (probs, labels)

    guide = LaplaceGuide(lora.model, curvature="kron")
    guide.fit(loader, num_data, map=theta_map, progress=True)
    guide.optimize_prior_precision("marglik")
    probs = guide.predictive(test_batch, num_data, link="mc", num_samples=200)
    name = "Laplace-LoRA K-FAC (GLM)"
    results[name], curves[name] = metrics.summarize(probs, labels), (probs, labels)

    blob_lora = lora_model(
        "minilm", "classification", num_labels=2, adapters_random="A", head="point"
    )
    predictor = baselines.blob(
        blob_lora.model,
        loader,
        num_data,
        num_steps=settings.lora_steps,
        lr=1e-3,
        num_samples=10,
        progress=True,
    )
    probs = predictor(test_batch, num_data).mean(0)
    results["BLoB (N=10)"], curves["BLoB (N=10)"] = (
        metrics.summarize(probs, labels),
        (probs, labels),
    )
    plots.reliability_diagram(curves, out / "reliability_lora.png", title="SST-2, dev subset")
    return results


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
