r"""Bayesian causal LM: next-token uncertainty flags an unknown language (posteriors paper 5.3).

The paper fine-tunes the last attention layer of Llama 3 (8B) on science textbooks, by SGD,
serial SGHMC and parallel SGHMC (ten chains at :math:`T = 1`, each the last draw of its
own trajectory), and asks each model for the next token after 100 scientific statements
with the last word removed, in English (in distribution) and in Samoan (out of
distribution). The epistemic uncertainty (EU) of parallel SGHMC separates Samoan better
than any total uncertainty (TU): AUROC 0.95 against 0.90 (its TU) and 0.80 (SGD's TU),
while serial SGHMC's EU fails (0.17: its draws sit in one mode); every fine-tune lowers
the next-token loss in English (Tables 1 and 2, Figures 7 and 10).

Here, with the same structure at laptop scale:

- **the base** (Llama 3's role): a small Llama (``SETTINGS``: 4 layers, width 128, SwiGLU
  344, untied embeddings, 0.86M weights) trained from scratch on the books of the data
  directory (:func:`pyro_bdl.data.load` ``"books"``, their training parts; 1,000 AdamW
  steps of 32 windows of 128 tokens, 4.1M tokens, about one pass) over *bytes*: the
  tokenizer is a byte-level BPE without merges (the 256 bytes and three special tokens),
  so every language is representable and Samoan, never seen, is simply text the model
  cannot predict. (A BPE of 2,048 tokens trained on the books was tried first: in 1,500
  steps that base learnt next to nothing, 6.9 nats per token on English FLORES against
  7.6 for a uniform guess, and scored English and Samoan alike. The byte-level base
  reaches 2.2 nats per byte on English FLORES and 4.3 on Samoan in 1,000 steps.) With
  ``--model PATH`` any local Hugging Face causal LM and its own tokenizer are the base
  instead and nothing is pretrained (the paper's set-up on a GPU: ``--device cuda``). On
  a CPU such a base runs the ``"pretrained"`` sizes of :data:`SETTINGS` (fewer sentences,
  chains and draws: SmolLM2-135M costs about 150 times the byte model per token), and the
  frozen layers below the adapted one run once per sentence (:class:`SentencePrefix`).
- **the fine-tune** (TQA's role): the English FLORES-200 ``dev`` sentences (797 for
  training, the last 200 for validation; the first 128 tokens of each), next-token
  likelihood over every token of a sentence (:class:`~pyro_bdl.models.NextToken`), 5
  epochs of batch 16 (250 steps), through LoRA (rank 8, alpha 32, no
  dropout) on the query, key, value and output projections of the *last* attention layer
  (:func:`~pyro_bdl.models.lora_model`), prior :math:`\mathcal{N}(0, 0.2^2)` on every
  adapter weight.
- **the test** (the statements' role): the same ``n`` FLORES-200 ``devtest`` sentences in
  English and in Samoan (a seeded choice, the same for every method and seed), each cut
  before its last word (trailing punctuation dropped); the model is scored on the tokens
  of that word (at most 16; with bytes, its letters: the space before it joins the
  context), :func:`pyro_bdl.lm.token_uncertainty` at each: TU, EU and the next-token loss
  :math:`-\log \bar p(\text{token})` under the model average, each averaged over the
  word. The paper's next token is the word's first (BPE) token; with bytes that is one
  letter, which is about as unpredictable in English as in Samoan, so the whole word is
  the main score and its first token alone the variant (``first_token_table``).
  The AUROC of TU and of EU for telling Samoan from English is the paper's metric.

The methods (every chain and fit the same number of minibatch steps, ``epochs`` passes):

- **Base**: the base model, no fine-tuning (TU only).
- **SGD**: :class:`~pyro_bdl.inference.SGHMC` at :math:`T = 0`, which is SGD with
  momentum step for step, from the LoRA initialisation (B = 0: the base model).
- **SGHMC (serial)**: one chain at :math:`T = 1` from a LoRA initialisation, twice as
  long, ``serial_draws`` draws evenly spaced over its second half.
- **SGHMC (parallel)**: ``chains`` chains at :math:`T = 1`, each from its own LoRA
  initialisation (all start at the base model's function, as the paper's chains start at
  the pretrained weights), the last draw of each (:class:`~pyro_bdl.inference.Chains`).
- **Laplace**: K-FAC with the Monte Carlo Fisher (one sampled label per token, the
  practical curvature for a vocabulary-sized output) at the SGD solution, the prior
  precision per weight tensor by the evidence, ``laplace_samples`` draws of the weights
  (the GLM predictive's vocabulary-sized covariance does not fit).
- **BLoB**: :class:`~pyro_bdl.inference.BLoBGuide` trained by
  :func:`~pyro_bdl.inference.fit_blob` (A random, B a point estimate), the same steps,
  ``blob_samples`` draws.

Hyperparameters are chosen on the validation sentences, never on the test: the learning
rate of SGD at momentum 0.9 (then used by every SGHMC chain, as the paper uses one learning
rate: step size and friction from :func:`sghmc_parameters`) and BLoB's learning rate,
each from a grid, at seed 0, by the validation loss. Seeds change the LoRA
initialisations, the batch orders and the chains' noise; the base, tokenizer and data are
shared. ``results.json`` records every size, the choices and each cell's CPU time.

Outputs in ``--out``: ``results.json``, ``lm_ood.md`` (the table), ``lm_ood_hist.png``
(TU and EU on English and Samoan of SGD and parallel SGHMC: Figure 7),
``lm_ood_hist_all.png`` (the base, serial SGHMC, Laplace and BLoB: Figure 10 and more),
``base/`` (the base model and tokenizer, a Hugging Face directory), ``cells/`` and
``checkpoints/``.

Run::

    python -m experiments lm-ood --data-dir ../shared/data --out results/lm_ood
    python -m experiments lm-ood --data-dir ../shared/data --out results/lm-ood-smollm2 \
        --model smollm2
    python -m experiments lm-ood --data-dir ../shared/data --out results/lm_ood_gpu \
        --device cuda --model path/to/Meta-Llama-3-8B
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import pyro
import torch
from peft.tuners.lora import LoraLayer
from torch.utils.data import ConcatDataset

from experiments.causal_lm import FrozenPrefix
from experiments.lora_finetune import checkpoint, quiet, single_thread
from experiments.ood import LANGUAGES, _auroc
from experiments.runner import Experiment, markdown_table, mean_sd
from pyro_bdl import lm
from pyro_bdl.data import CausalLMCollator, TokenWindows, load, make_loader
from pyro_bdl.inference import (
    SGHMC,
    BLoBGuide,
    Chains,
    DivergenceError,
    Kron,
    LaplaceGuide,
    fit_blob,
    fit_map,
)
from pyro_bdl.lift import lift
from pyro_bdl.models import BayesianNet, NextToken, lora_model
from pyro_bdl.plots import plot_uncertainty_histograms
from pyro_bdl.predict import guide_draw
from pyro_bdl.priors import IIDNormal

__all__ = [
    "run",
    "METHODS",
    "SETTINGS",
    "OPTIONS",
    "SentencePrefix",
    "last_word",
    "sghmc_parameters",
]

METHODS = ("Base", "SGD", "SGHMC-serial", "SGHMC-parallel", "Laplace", "BLoB")
#: The runner's options this experiment takes beyond the common ones.
OPTIONS = ("model",)
#: Which FLORES-200 split trains (and validates) and which tests (the languages: ood's).
TRAIN_SPLIT, TEST_SPLIT = "dev", "devtest"

SETTINGS = {
    "full": {
        "vocab_size": 259,
        "hidden_size": 128,
        "intermediate_size": 344,
        "num_layers": 4,
        "num_heads": 4,
        "window": 128,
        "base_steps": 1000,
        "base_batch_size": 32,
        "base_learning_rate": 3e-3,
        "train_sentences": None,  # every dev sentence not held out
        "validation_sentences": 200,
        "max_length": 128,
        "test_sentences": 500,
        "context": 64,
        "lora": {"rank": 8, "alpha": 32, "dropout": 0.0},
        "prior_scale": 0.2,
        "batch_size": 16,
        "epochs": 5,
        "momentum": 0.9,
        "learning_rates": (1e-4, 3e-4, 1e-3, 3e-3),
        "blob_learning_rates": (1e-3, 3e-3, 1e-2, 3e-2),
        "chains": 10,
        "serial_draws": 10,
        "laplace_samples": 10,
        "blob_samples": 10,
        "marglik_steps": 300,
        "eval_batch_size": 64,
    },
    "quick": {
        "vocab_size": 259,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_layers": 2,
        "num_heads": 2,
        "window": 32,
        "base_steps": 5,
        "base_batch_size": 8,
        "base_learning_rate": 3e-3,
        "train_sentences": 48,
        "validation_sentences": 16,
        "max_length": 48,
        "test_sentences": 24,
        "context": 24,
        "lora": {"rank": 2, "alpha": 8, "dropout": 0.0},
        "prior_scale": 0.2,
        "batch_size": 8,
        "epochs": 1,
        "momentum": 0.9,
        "learning_rates": (1e-2, 1e6),  # the second diverges: a candidate that blows up
        "blob_learning_rates": (3e-3,),
        "chains": 2,
        "serial_draws": 2,
        "laplace_samples": 3,
        "blob_samples": 3,
        "marglik_steps": 10,
        "eval_batch_size": 64,
    },
}
#: A pretrained base (``--model``) on a CPU: the full run's recipe on fewer sentences,
#: fewer chains and draws: 37 minutes of one core for SmolLM2-135M, seeds 0-2 (its forward
#: costs about 150 times the byte model's: a 49,152-token head and 30 layers).
SETTINGS["pretrained"] = {
    **SETTINGS["full"],
    "train_sentences": 128,
    "validation_sentences": 48,
    "test_sentences": 100,  # the paper's 100 statements
    "context": 32,
    "batch_size": 8,
    "epochs": 3,
    "learning_rates": (3e-3, 1e-2, 3e-2),
    "blob_learning_rates": (3e-3, 1e-2),
    "chains": 4,
    "serial_draws": 4,
    "laplace_samples": 4,
    "blob_samples": 4,
    "eval_batch_size": 32,
}
#: Characters of the books that the quick run's tokenizer and base see (per book).
_QUICK_BOOK_CHARACTERS = 20_000
#: The most tokens of a last word that are scored (longer words: their first ones).
_MAX_WORD_TOKENS = 16


def run(experiment: Experiment) -> dict:
    """Run the experiment; write ``results.json``, the table and the histograms.

    :param Experiment experiment: where to read the data and write the results; its
        ``datasets`` may only name ``flores``, its ``methods`` any of :data:`METHODS`,
        its ``model`` a local Hugging Face causal LM to use as the base.
    :return: the table (mean ± sd over seeds), per-seed numbers and the choices made.
    """
    settings = SETTINGS[_tier(experiment)]
    experiment.selected("datasets", ["flores"])
    methods = experiment.selected("methods", METHODS)
    with single_thread():
        data = _Data(experiment, settings)
        choices = _Choices(experiment, data, settings)
        experiment.settings = {
            **settings,
            "base": data.description,
            "sizes": data.sizes(),
            "lora_targets": data.targets,
            "learning_rate": choices.learning_rate,
            "blob_learning_rate": choices.blob_learning_rate,
            "validation_losses": choices.losses,
        }
        cells = {}
        for seed in experiment.seeds:
            for method in methods:
                cell = experiment.cell(
                    ("flores", method, seed),
                    lambda method=method, seed=seed: _Cell(data, choices, seed).score(method),
                )
                cells.setdefault(method, {})[seed] = cell
    results = _summaries(cells)
    results["choices"] = {"lr": choices.learning_rate, "blob_lr": choices.blob_learning_rate}
    columns = ["method", "AUROC TU", "AUROC EU", "loss English", "loss Samoan"]
    table = markdown_table(
        [{"method": method, **row} for method, row in results["table"].items()],
        [*columns, "validation loss"],
    )
    first = markdown_table(
        [{"method": method, **row} for method, row in results["first_token_table"].items()],
        columns,
    )
    table = f"The last word, its tokens' mean:\n\n{table}\n\nIts first token alone:\n\n{first}"
    (experiment.out / "lm_ood.md").write_text(table + "\n")
    _histograms(cells, experiment.out)
    experiment.write_results(results)
    print(table)
    return results


def _tier(experiment: Experiment) -> str:
    if experiment.quick:
        return "quick"
    return "pretrained" if experiment.model is not None and not experiment.on_gpu else "full"


def last_word(text: str) -> tuple[str, str] | None:
    """``text`` cut before its last word: ``(prompt, word)``, trailing punctuation dropped.

    None when the sentence has one word or its last word has no letter (a number).

    Example::

        last_word('He said "it works."')   # ('He said "it', 'works')
    """
    end = len(text.rstrip())
    while end and not text[end - 1].isalnum():
        end -= 1
    prompt, _, word = text[:end].rpartition(" ")
    if not prompt.strip() or not any(character.isalpha() for character in word):
        return None
    return prompt.rstrip(), word


# -- data and the base model ---------------------------------------------------------------


class _Data:
    """The tokenizer, the base model's directory, the fine-tuning and test batches."""

    def __init__(self, experiment: Experiment, settings: Mapping):
        self.experiment, self.settings = experiment, settings
        self.device = experiment.device
        self.prefix = None
        if experiment.model is not None:
            self.base = Path(experiment.model)
            self.tokenizer = _pretrained_tokenizer(self.base)
            self.description = f"{self.base} (given with --model)"
            # LoRA adapts the last layer only: the frozen ones below run once per sentence
            self.prefix = SentencePrefix(
                lora_model_base(self.base, self.device), self.tokenizer.pad_token_id
            )
        else:
            self.base = experiment.out / "base"
            self.tokenizer = _BaseTrainer(experiment, settings).base()
            self.description = "a small Llama trained here on the books (see SETTINGS)"
        self.bos = [self.tokenizer.bos_token_id] if experiment.model is not None else []
        self.collate = CausalLMCollator(self.tokenizer)
        sentences = load("flores", experiment.data_dir, TRAIN_SPLIT, language="eng_Latn")
        texts = [record["text"] for record in sentences]
        cut = len(texts) - settings["validation_sentences"]
        train = texts[: min(cut, settings["train_sentences"] or cut)]
        self.train = [self.ids(text)[: settings["max_length"]] for text in train]
        self.validation = [self.ids(text)[: settings["max_length"]] for text in texts[cut:]]
        self.test, self.test_indices = self._test_batches()
        self.targets = _last_layer_attention(_skeleton(self.base))

    def ids(self, text: str) -> torch.Tensor:
        tokens = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return torch.tensor(self.bos + tokens, dtype=torch.long)

    @property
    def num_data(self) -> int:
        return len(self.train)

    def train_loader(self, seed: int):
        windows = [{"input_ids": ids} for ids in self.train]
        return make_loader(windows, self.collate, self.settings["batch_size"], True, seed)

    @property
    def steps(self) -> int:
        """Minibatch steps of every fine-tune: ``epochs`` passes over the sentences."""
        return self.settings["epochs"] * -(-self.num_data // self.settings["batch_size"])

    def lora(self, adapters_random: str = "AB"):
        """A fresh LoRA model on the base: adapters on the last attention layer."""
        base = lora_model_base(self.base, self.device)
        if self.prefix is not None:
            base = self.prefix.attach(base)
        with quiet():
            return lora_model(
                base,
                "causal_lm",
                target_modules=_last_layer_attention(base),
                prior_scale=self.settings["prior_scale"],
                adapters_random=adapters_random,
                tokenizer=self.tokenizer,
                **self.settings["lora"],
            )

    def _test_batches(self) -> tuple[dict[str, list[dict]], list[int]]:
        """The last-word batches of the chosen test sentences, in each language."""
        records = {
            name: load("flores", self.experiment.data_dir, TEST_SPLIT, language=language)
            for name, language in LANGUAGES.items()
        }
        cuts = {name: [last_word(r["text"]) for r in rows] for name, rows in records.items()}
        usable = [i for i in range(len(cuts["english"])) if all(c[i] for c in cuts.values())]
        chosen = usable
        count = self.settings["test_sentences"]
        if count is not None and not (self.experiment.on_gpu and self.experiment.model):
            order = torch.randperm(len(usable), generator=torch.Generator().manual_seed(0))
            chosen = sorted(usable[i] for i in order[:count].tolist())
        batches = {
            name: self._last_word_batches([cuts[name][i] for i in chosen]) for name in LANGUAGES
        }
        return batches, chosen

    def _last_word_batches(self, cuts: Sequence[tuple[str, str]]) -> list[dict]:
        """Prompt (its last ``context`` tokens) + the word's tokens, scored at the word."""
        rows = []
        for prompt, word in cuts:
            context, tokens = self._word_tokens(prompt, word)
            rows.append((context[-self.settings["context"] :], tokens[:_MAX_WORD_TOKENS]))
        batches = []
        size = self.settings["eval_batch_size"]
        for start in range(0, len(rows), size):
            part = rows[start : start + size]
            batch = self.collate([{"input_ids": torch.tensor(c + w)} for c, w in part])
            scored = torch.full_like(batch["labels"], -100)
            for row, (context, tokens) in enumerate(part):
                word = slice(len(context), len(context) + len(tokens))
                scored[row, word] = batch["labels"][row, word]
            batches.append({**batch, "labels": scored})
        return batches

    def _word_tokens(self, prompt: str, word: str) -> tuple[list[int], list[int]]:
        """The tokens before the word, and the word's tokens, as the sentence is tokenized.

        With a BPE tokenizer the leading space merges into the word's first token
        (`` Paris``: the paper's next token); with bytes the space is a token of its own,
        which joins the context, and the word's tokens are its letters. Where the prompt's
        own tokens change at the join, the word is tokenized alone.
        """
        prompt_ids = self.ids(prompt).tolist()
        full = self.ids(f"{prompt} {word}").tolist()
        if full[: len(prompt_ids)] != prompt_ids:
            full = prompt_ids + self.ids(" " + word).tolist()[len(self.bos) :]
        start = len(prompt_ids)
        while start < len(full) - 1 and not self.tokenizer.decode(full[start]).strip():
            start += 1
        return full[:start], full[start:]

    def sizes(self) -> dict:
        train_tokens = sum(len(ids) for ids in self.train)
        return {
            "train_sentences": self.num_data,
            "train_tokens": train_tokens,
            "validation_sentences": len(self.validation),
            "test_sentences": len(self.test_indices),
            "steps": self.steps,
            "batch_size": self.settings["batch_size"],
        }

    def validation_batches(self) -> list[dict]:
        windows = [{"input_ids": ids} for ids in self.validation]
        return list(make_loader(windows, self.collate, self.settings["eval_batch_size"]))


def lora_model_base(path: Path, device: torch.device):
    """The base causal LM of a directory, on ``device`` (float32 on a CPU, bf16 on a GPU)."""
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with quiet():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    return model.to(device)


class SentencePrefix:
    """The frozen decoder layers below the last of a causal LM, run once per sentence.

    LoRA on the last attention layer leaves every layer below it computing the same hidden
    states at every step, draw and chain. ``SentencePrefix(model, pad_id)`` keeps the
    layers of ``model`` below its last (a :class:`FrozenPrefix`); :meth:`attach` cuts
    another copy of the model to its last layer and makes its token embedding return,
    instead of the embeddings, the states those layers hand to the last, each sentence's
    computed once and kept. The sentence is the row's tokens up to its trailing padding
    (batches right-padded, as :class:`~pyro_bdl.data.CausalLMCollator` makes them):
    under causal attention a token's state does not depend on the padding after it, so
    a sentence reused in another batch, with other padding, is not computed again. The
    states at the padding are zeros; the attention mask keeps them out of the last layer.

    :param model: a Llama-architecture ``transformers`` causal LM (``model.model.layers``);
        cut in place.
    :param int pad_id: the collator's padding token id.
    """

    def __init__(self, model: torch.nn.Module, pad_id: int):
        self.frozen = FrozenPrefix(model.eval(), top_layers=1)
        self.pad_id = pad_id
        self.states: dict[tuple[int, ...], torch.Tensor] = {}

    def attach(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model`` (the same weights as the prefix's) cut to its last layer, fed the states."""
        FrozenPrefix(model, top_layers=1)
        model.get_input_embeddings().register_forward_hook(self._states)
        return model

    def _states(self, module, args, embeddings: torch.Tensor) -> torch.Tensor:
        (input_ids,) = args
        padding = input_ids == self.pad_id
        # a row's padding is its tail: no token after the first pad
        if (padding[:, :-1] & ~padding[:, 1:]).any():
            raise ValueError("SentencePrefix: batches must be right-padded (a token after a pad)")
        lengths = (~padding).sum(dim=1).tolist()
        keys = [tuple(row[:n].tolist()) for row, n in zip(input_ids, lengths, strict=True)]
        missing = list(dict.fromkeys(key for key in keys if key not in self.states))
        if missing:
            width = max(len(key) for key in missing)
            ids = torch.full((len(missing), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, key in enumerate(missing):
                ids[row, : len(key)] = torch.tensor(key)
                mask[row, : len(key)] = 1
            hidden = self.frozen.hidden(ids.to(input_ids.device), mask.to(input_ids.device))
            for row, key in enumerate(missing):
                self.states[key] = hidden[row, : len(key)].to(embeddings.dtype)
        states = torch.zeros_like(embeddings)
        for row, (key, n) in enumerate(zip(keys, lengths, strict=True)):
            states[row, :n] = self.states[key]
        return states


def _skeleton(path: Path) -> torch.nn.Module:
    """The causal LM of a directory without its weights (on the meta device): its layout."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _pretrained_tokenizer(path: Path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _last_layer_attention(model: torch.nn.Module) -> list[str]:
    """The names of the linear layers of the last decoder layer's attention block.

    The decoder layers are the longest ``ModuleList`` of the model (``model.layers`` of
    Llama, ``transformer.h`` of GPT-2); the attention block is the submodule of the last
    layer whose name says so (``self_attn``, ``attn``, ``attention``).
    """
    from transformers.pytorch_utils import Conv1D

    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.ModuleList)]
    name, layers = max(lists, key=lambda item: len(item[1]))
    prefix = f"{name}.{len(layers) - 1}."
    targets = []
    for full, module in model.named_modules():
        block = full[len(prefix) :].split(".")[0]
        is_attention = "attn" in block or "attention" in block
        if (
            full.startswith(prefix)
            and is_attention
            and isinstance(module, torch.nn.Linear | Conv1D)
        ):
            targets.append(full)
    if not targets:
        raise ValueError(f"lm-ood: found no linear layer of the attention block under {prefix}")
    return targets


class _BaseTrainer:
    """The tokenizer and base model trained on the books, once, saved under ``out/base``."""

    def __init__(self, experiment: Experiment, settings: Mapping):
        self.experiment, self.settings = experiment, settings
        self.directory = experiment.out / "base"

    def base(self):
        """The tokenizer (training the tokenizer and base model if not on disk)."""
        from transformers import PreTrainedTokenizerFast

        if (self.directory / "config.json").exists():
            return PreTrainedTokenizerFast.from_pretrained(self.directory)
        books = self._books()
        tokenizer = _train_tokenizer(books, self.settings["vocab_size"])
        self._train_base(books, tokenizer)
        tokenizer.save_pretrained(self.directory)
        return tokenizer

    def _books(self) -> list[str]:
        texts = [record["text"] for record in load("books", self.experiment.data_dir, "train")]
        if self.experiment.quick:
            texts = [text[:_QUICK_BOOK_CHARACTERS] for text in texts]
        return texts

    def _train_base(self, books: Sequence[str], tokenizer) -> None:
        """A small Llama trained from scratch on windows of the books (AdamW on the MLE)."""
        from transformers import LlamaConfig, LlamaForCausalLM

        s = self.settings
        config = LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=s["hidden_size"],
            intermediate_size=s["intermediate_size"],
            num_hidden_layers=s["num_layers"],
            num_attention_heads=s["num_heads"],
            num_key_value_heads=s["num_heads"],
            max_position_embeddings=max(s["window"], s["max_length"] + 1),
            tie_word_embeddings=False,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        torch.manual_seed(0)
        module = LlamaForCausalLM(config).to(self.experiment.device)
        windows = ConcatDataset(
            [
                TokenWindows(
                    torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"]),
                    s["window"],
                )
                for text in books
            ]
        )
        loader = make_loader(
            windows, CausalLMCollator(tokenizer), s["base_batch_size"], shuffle=True, seed=0
        )
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        # every weight a site of a flat prior, fitted by maximum likelihood
        net = lift(module, prior=IIDNormal(100.0))
        model = BayesianNet(net, NextToken())
        values = fit_map(
            model,
            loader,
            len(windows),
            num_steps=s["base_steps"],
            optimizer=pyro.optim.AdamW({"lr": s["base_learning_rate"]}),
            mle=True,
            progress=sys.stderr.isatty(),
        )
        with net.fixed(values):
            module.save_pretrained(self.directory)


def _train_tokenizer(texts: Sequence[str], vocab_size: int):
    """A byte-level BPE tokenizer (GPT-2's and Llama 3's kind) trained on ``texts``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["<pad>", "<s>", "</s>"]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )


# -- the choices on validation data --------------------------------------------------------


class _Choices:
    """SGD's step size and BLoB's learning rate, each by the validation loss at seed 0.

    A candidate that diverges has no loss (None) and is not chosen.
    """

    def __init__(self, experiment: Experiment, data: _Data, settings: Mapping):
        self.losses: dict[str, dict[str, float]] = {}
        grids = {"SGD": settings["learning_rates"], "BLoB": settings["blob_learning_rates"]}
        for method, grid in grids.items():
            self.losses[method] = {
                str(value): experiment.cell(
                    ("flores", "choice", method, f"value={value}"),
                    lambda method=method, value=value: self._candidate(data, method, value),
                )["validation_loss"]
                for value in grid
            }
        self.learning_rate = _best(self.losses["SGD"])
        self.blob_learning_rate = _best(self.losses["BLoB"])

    def _candidate(self, data: _Data, method: str, value: float) -> dict:
        try:
            return _Cell(data, self, 0).validation(method, value)
        except (DivergenceError, ValueError) as error:
            # a run that blew up: SGHMC's own check, or the likelihood's of its logits
            if isinstance(error, ValueError) and "invalid values" not in str(error):
                raise
            return {"validation_loss": None, "diverged": str(error).splitlines()[0]}


def _best(losses: Mapping[str, float]) -> float:
    finite = {v: loss for v, loss in losses.items() if loss is not None and math.isfinite(loss)}
    if not finite:
        raise RuntimeError(f"lm-ood: every candidate diverged on validation: {dict(losses)}")
    return float(min(finite, key=finite.get))


# -- one method and seed ------------------------------------------------------------------


class _Cell:
    """The posterior of one method at one seed, and its scores."""

    def __init__(self, data: _Data, choices: _Choices, seed: int):
        self.data, self.choices, self.seed = data, choices, seed
        self.settings = data.settings
        self.checkpoints = data.experiment.out / "checkpoints" / f"seed{seed}"

    def score(self, method: str) -> dict:
        """TU, AU, EU and the loss of the last word in each language, and the validation loss."""
        lora, posterior = self.posterior(method)
        result = {name: self._test(lora, batches, posterior) for name, batches in
                  self.data.test.items()}  # fmt: skip
        result["validation_loss"] = self._validation_loss(lora, posterior)
        return result

    def validation(self, method: str, value: float) -> dict:
        """The validation loss of SGD or BLoB at learning rate ``value``."""
        if method == "SGD":
            lora, posterior = self._sgd(value)
        else:
            lora, posterior = self._blob(value)
        return {"validation_loss": self._validation_loss(lora, posterior)}

    def posterior(self, method: str) -> tuple:
        """The LoRA model and its posterior (the keywords of :func:`pyro_bdl.lm`)."""
        if method == "Base":
            lora = self.data.lora()
            values = lora.net.init_values()  # B = 0: the base model's function
            return lora, {"samples": {site: value[None] for site, value in values.items()}}
        if method == "SGD":
            return self._sgd(self.choices.learning_rate)
        if method == "SGHMC-serial":
            draws = self.settings["serial_draws"]
            return self._sghmc("serial", 1, 2 * self.data.steps, draws, temperature=1.0)
        if method == "SGHMC-parallel":
            chains = self.settings["chains"]
            return self._sghmc("parallel", chains, self.data.steps, 1, temperature=1.0)
        if method == "Laplace":
            return self._laplace()
        return self._blob(self.choices.blob_learning_rate)

    def _guide_draws(self, lora, guide, num_samples: int) -> dict:
        """``num_samples`` draws of the weights from a guide, made once: every sentence of
        both languages is scored with the same draws, as with a chain's."""
        pyro.set_rng_seed(self.seed)
        batch = next(iter(self.data.train_loader(self.seed)))
        draws = [guide_draw(guide, batch, self.data.num_data) for _ in range(num_samples)]
        return {"samples": {site: torch.stack([d[site] for d in draws]) for site in draws[0]}}

    def _sgd(self, learning_rate: float) -> tuple:
        lora = self.data.lora()
        path = self.checkpoints / f"sgd_lr={learning_rate}.safetensors"
        values = checkpoint(
            path,
            lambda: self._chains(lora, 1, self.data.steps, 1, 0.0, learning_rate)[0],
            self.data.device,
        )
        return lora, {"samples": {site: value[None] for site, value in values.items()}}

    def _sghmc(self, name, num_chains, steps, num_samples, temperature) -> tuple:
        lora = self.data.lora()
        draws = self._chains(lora, num_chains, steps, num_samples, temperature)
        return lora, {"samples": {site: torch.stack([d[site] for d in draws]) for site in draws[0]}}

    def _chains(self, lora, num_chains, steps, num_samples, temperature, learning_rate=None):
        """Draws of chains from their own LoRA initialisations (B = 0), one dict per draw.

        ``num_samples`` draws per chain, evenly spaced over its second half (the last draw
        when ``num_samples`` is 1).
        """
        learning_rate = self.choices.learning_rate if learning_rate is None else learning_rate
        step_size, friction = sghmc_parameters(learning_rate, self.settings["momentum"])
        thin = max(1, (steps // 2) // num_samples) if num_samples > 1 else 1
        kernel = SGHMC(
            lora.model,
            step_size=step_size,
            friction=friction,
            temperature=temperature,
            thin=thin,
            # the recipe: SGD's learning rate chosen on validation, fixed in warm-up
            adapt_step_size=False,
            adapt_mass_matrix=False,
        )
        chains = Chains(
            kernel,
            num_samples=num_samples,
            warmup_steps=steps - thin * num_samples,
            num_chains=num_chains,
            init_params=lambda chain: _lora_initialisation(lora, 1000 * self.seed + chain),
            seed=1000 * self.seed,
            disable_progbar=not sys.stderr.isatty(),
        )
        chains.run(self.data.train_loader(self.seed), self.data.num_data)
        samples = chains.get_samples()
        count = len(next(iter(samples.values())))
        return [{site: value[i] for site, value in samples.items()} for i in range(count)]

    def _laplace(self) -> tuple:
        lora, sgd = self._sgd(self.choices.learning_rate)
        values = {site: value[0] for site, value in sgd["samples"].items()}
        guide = LaplaceGuide(lora.model, curvature=Kron(fisher="mc"))
        pyro.set_rng_seed(self.seed)
        guide.fit(
            self.data.train_loader(self.seed),
            self.data.num_data,
            map=values,
            mode_tolerance=None,
            progress=False,
        )
        guide.optimize_prior_precision("marglik", num_steps=self.settings["marglik_steps"])
        return lora, self._guide_draws(lora, guide, self.settings["laplace_samples"])

    def _blob(self, learning_rate: float) -> tuple:
        lora = self.data.lora(adapters_random="A")  # BLoB: A random, B a point estimate
        pyro.clear_param_store()
        torch.manual_seed(self.seed)
        for layer in lora.peft_model.modules():
            if isinstance(layer, LoraLayer):
                layer.reset_lora_parameters("default", True)
        guide = BLoBGuide(lora.model, prior_std=self.settings["prior_scale"])
        pyro.set_rng_seed(self.seed)
        fit_blob(
            lora.model,
            guide,
            self.data.train_loader(self.seed),
            self.data.num_data,
            num_steps=self.data.steps,
            lr=learning_rate,
            progress=False,
        )
        return lora, self._guide_draws(lora, guide, self.settings["blob_samples"])

    def _test(self, lora, batches: list[dict], posterior: dict) -> dict:
        """The scores of the last word of every sentence: the mean over its tokens, and
        (under ``"first"``) those of its first token alone, the paper's next token."""
        scores = {name: [] for name in ("total", "aleatoric", "epistemic", "nll")}
        first = {name: [] for name in scores}
        for batch in batches:
            result = lm.token_uncertainty(lora.model, batch, self.data.num_data, **posterior)
            start = (batch["labels"] != -100).int().argmax(dim=1)
            rows = torch.arange(len(start))
            for name, value in result.sequence("mean")._asdict().items():
                scores[name] += value.cpu().tolist()
            for name, value in result._asdict().items():
                first[name] += value[rows, start.to(value.device)].cpu().tolist()
        return {**scores, "first": first}

    def _validation_loss(self, lora, posterior: dict) -> float:
        """Next-token loss per token of the validation sentences under the model average."""
        total, tokens = 0.0, 0
        for batch in self.data.validation_batches():
            nll = lm.token_uncertainty(lora.model, batch, self.data.num_data, **posterior).nll
            scored = ~nll.isnan()
            total += float(nll[scored].sum())
            tokens += int(scored.sum())
        return total / tokens


def sghmc_parameters(learning_rate: float, momentum: float) -> tuple[float, float]:
    r"""SGHMC's step size :math:`\epsilon` and friction :math:`\alpha` (mass 1) whose
    :math:`T = 0` limit is SGD at ``learning_rate`` with ``momentum``.

    At :math:`T = 0`, :class:`~pyro_bdl.inference.SGHMC` is SGD with momentum
    :math:`1 - \epsilon\alpha` whose steps settle at :math:`\epsilon / \alpha` times the
    gradient (of the per-example loss): :math:`\epsilon\alpha = 1 - \mu` and
    :math:`\epsilon / \alpha = \eta`.

    Example::

        sghmc_parameters(0.01, 0.9)   # (0.0316, 3.16)
    """
    return math.sqrt(learning_rate * (1 - momentum)), math.sqrt((1 - momentum) / learning_rate)


def _lora_initialisation(lora, seed: int) -> dict[str, torch.Tensor]:
    """peft's own initialisation of every adapter (A random, B = 0), from ``seed``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for layer in lora.peft_model.modules():
            if isinstance(layer, LoraLayer):
                layer.reset_lora_parameters("default", True)
    return lora.net.init_values()


# -- summaries, table and figures ------------------------------------------------------------


def _one_draw(method: str) -> bool:
    return method in ("Base", "SGD")


def _summaries(cells: Mapping[str, Mapping[int, dict]]) -> dict:
    """Per seed and as mean ± sd: AUROC of TU and EU, the losses (Table 2's rows).

    ``table`` scores each last word by the mean over its tokens; ``first_token_table`` by
    its first token alone (the paper's next token, one letter with bytes).
    """
    per_seed, tables = {}, {"table": {}, "first_token_table": {}}
    for method, seeds in cells.items():
        per_seed[method] = {
            seed: {
                **_scores(method, cell),
                "first_token": _scores(method, {k: cell[k]["first"] for k in LANGUAGES}),
                "validation_loss": cell["validation_loss"],
                "cpu_time_s": cell["cpu_time_s"],
            }
            for seed, cell in seeds.items()
        }
        rows = list(per_seed[method].values())
        for name, part in (
            ("table", rows),
            ("first_token_table", [r["first_token"] for r in rows]),
        ):
            tables[name][method] = {
                "AUROC TU": mean_sd([r["auroc_total"] for r in part]),
                "AUROC EU": "-"
                if _one_draw(method)
                else mean_sd([r["auroc_epistemic"] for r in part]),
                "loss English": mean_sd([r["loss_english"] for r in part]),
                "loss Samoan": mean_sd([r["loss_samoan"] for r in part]),
            }
        tables["table"][method]["validation loss"] = mean_sd([r["validation_loss"] for r in rows])
    return {**tables, "per_seed": per_seed}


def _scores(method: str, cell: Mapping) -> dict:
    """One seed's AUROC of TU and EU and the mean losses, from its per-sentence scores."""
    return {
        "auroc_total": _auroc(cell, "total"),
        "auroc_epistemic": None if _one_draw(method) else _auroc(cell, "epistemic"),
        "loss_english": float(torch.tensor(cell["english"]["nll"]).mean()),
        "loss_samoan": float(torch.tensor(cell["samoan"]["nll"]).mean()),
    }


def _histograms(cells: Mapping[str, Mapping[int, dict]], out: Path) -> None:
    """TU and EU on English and Samoan, seeds pooled (Figures 7 and 10)."""

    def pooled(method: str, score: str) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(
            torch.tensor([v for cell in cells[method].values() for v in cell[language][score]])
            for language in LANGUAGES
        )

    figures = {
        "lm_ood_hist.png": ("SGD", "SGHMC-parallel"),
        "lm_ood_hist_all.png": ("Base", "SGHMC-serial", "Laplace", "BLoB"),
    }
    for name, methods in figures.items():
        panels = {}
        for method in methods:
            if method not in cells:
                continue
            panels[f"{method} TU"] = pooled(method, "total")
            if not _one_draw(method):
                panels[f"{method} EU"] = pooled(method, "epistemic")
        if panels:
            plot_uncertainty_histograms(panels, out / name, labels=("English", "Samoan"))


if __name__ == "__main__":  # python -m experiments.lm_ood [options]
    from experiments import main

    main(name="lm-ood")
