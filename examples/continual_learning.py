"""Continual learning over books: the Laplace posterior of one book is the prior of the next.

A small character-level language model (a Llama built from a configuration, every
weight random with a prior) reads Project Gutenberg books one after the other. Two ways
to learn book n:

- online: maximum likelihood on book n alone, starting from the weights after book n-1
  (what plain fine-tuning does; it forgets the earlier books);
- Laplace: the Bayesian online update p(theta | books 1..n) ~ p(theta | books 1..n-1)
  p(book n | theta), the previous posterior approximated by a diagonal empirical-Fisher
  Laplace approximation and used as the prior (``LaplaceGuide.as_prior()`` assigned to
  the lifted network's ``prior``): the posteriors paper, section 5.2.

After each book, the held-out loss (nats per character) of every book is recorded. The
script prints the table and writes ``continual.png`` and ``results.json``.

    python examples/continual_learning.py --data-dir ../shared/data --out results/continual

About two minutes of one CPU core (three books); ``--quick`` runs in seconds.
"""

import argparse
import json
from pathlib import Path

import pyro
import torch
from matplotlib.figure import Figure
from pyro.infer.autoguide.initialization import init_to_value
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM

import pyro_bdl as bdl
from pyro_bdl import data
from pyro_bdl.inference import LaplaceGuide, fit_map
from pyro_bdl.models import BayesianNet, NextToken

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--data-dir", default="../shared/data", help="holds books/*.txt")
parser.add_argument("--out", default="results/continual_learning")
parser.add_argument("--quick", action="store_true", help="seconds, for CI")
args = parser.parse_args()
out = Path(args.out)
out.mkdir(parents=True, exist_ok=True)
num_books, train_chars, test_chars, epochs = (
    (2, 2048, 1024, 1) if args.quick else (3, 20_000, 8192, 12)
)
WINDOW = 64


# -- data: characters as token ids (ASCII), cut into windows of 64 ---------------------------
def windows(text: str) -> torch.Tensor:
    ids = torch.tensor(list(text.encode("ascii", errors="replace")))
    return ids[: len(ids) // WINDOW * WINDOW].view(-1, WINDOW)


def collate(rows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    ids = torch.stack(rows)
    return {"input_ids": ids, "labels": ids}  # the model shifts the labels


books = data.load("books", args.data_dir, "train")[:num_books]
held_out = data.load("books", args.data_dir, "test")[:num_books]
names = [book["book"] for book in books]
train = [windows(book["text"][:train_chars]) for book in books]
test = [collate(list(windows(book["text"][:test_chars]))) for book in held_out]


# -- the network: a small Llama over 128 characters, every weight matrix random -------------
def network() -> BayesianNet:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=WINDOW,
    )
    module = LlamaForCausalLM(config)
    for param in module.parameters():
        param.requires_grad_(param.dim() > 1)  # norm gains stay at 1
    return BayesianNet(bdl.lift(module, prior=bdl.priors.IIDNormal(1.0)), NextToken())


def test_losses(model: BayesianNet, values: dict) -> dict[str, float]:
    """Held-out nats per character of every book, with the weights ``values``."""
    losses = {}
    with torch.no_grad(), model.net.fixed(values):
        for name, batch in zip(names, test):
            logits = model.net.module(input_ids=batch["input_ids"]).logits
            targets = batch["input_ids"][:, 1:]
            losses[name] = float(
                torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), targets)
            )
    return losses


results = {}
for method in ["online", "Laplace"]:
    model = network()
    values = model.net.init_values()
    results[method] = []
    for episode, book in enumerate(train):
        pyro.clear_param_store()
        pyro.set_rng_seed(episode)
        loader = DataLoader(list(book), batch_size=16, shuffle=True, collate_fn=collate)
        fit = {
            "num_steps": epochs * len(loader),
            "optimizer": pyro.optim.AdamW({"lr": 3e-3}),
            "init_loc_fn": init_to_value(values=values),
        }
        if method == "online":
            values = fit_map(model, loader, len(book), mle=True, **fit)
        else:
            # The same AdamW steps under the current prior (mode_tolerance=None: no L-BFGS
            # to the exact mode, which overfits a small book), then the curvature there.
            guide = LaplaceGuide(model, curvature="diag_ef", init_loc_fn=fit.pop("init_loc_fn"))
            guide.fit(loader, len(book), mode_tolerance=None, **fit)
            values = guide.median()
            model.net.prior = guide.as_prior()  # the prior of the next book
        results[method].append(test_losses(model, values))
        print(f"{method}, after book {names[episode]}: {results[method][-1]}")

# -- table and figure: each book's held-out loss after each episode -------------------------
print("\n| method | after book | " + " | ".join(f"loss on {n}" for n in names) + " |")
print("|---" * (len(names) + 2) + "|")
for method, episodes in results.items():
    for name, losses in zip(names, episodes):
        print(f"| {method} | {name} | " + " | ".join(f"{losses[n]:.3f}" for n in names) + " |")
fig = Figure(figsize=(3.2 * num_books, 3.2), layout="constrained")
for ax, name in zip(fig.subplots(1, num_books, sharey=True), names):
    for method, episodes in results.items():
        ax.plot(
            range(1, num_books + 1), [losses[name] for losses in episodes], marker="o", label=method
        )
    ax.set(title=f"book {name}", xlabel="after episode", xticks=range(1, num_books + 1))
fig.axes[0].set_ylabel("held-out nats per character")
fig.axes[0].legend(fontsize="small")
fig.savefig(out / "continual.png", dpi=120)
(out / "results.json").write_text(json.dumps({"books": names, **results}, indent=2))
print(f"wrote {out}/continual.png, results.json")
