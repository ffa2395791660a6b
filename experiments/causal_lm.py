"""A pretrained causal LM (SmolLM2-135M) + LoRA on the papers' tasks, at CPU speed.

What the ``llm-learnability`` experiment and the ``calibration`` experiment's causal-LM
run (``--model smollm2``) share. The prompts end where the answer goes, and the answer
tokens' next-token logits score the choices
(``lora_model(base, "multiple_choice", label_token_ids=...)``, as Laplace-LoRA and BLoB).
LoRA goes on the queries and values of the last ``top_layers`` decoder layers only, so
that the layers below compute the same hidden states at every step: a
:class:`FrozenPrefix` computes them once per prompt, and every fit and prediction runs
the top layers alone on them. On the shared 2-core machine this is what makes a
fine-tune of a pretrained LM fit in minutes (LoRA on the last 16 of SmolLM2's 30 layers
learns SST-2 and IMDB; on the last two it learns nothing: ``docs/experiments.md``,
section 6).

:class:`CausalTask` and :class:`CausalNetwork` are the
:class:`~experiments.lora_finetune.Task` and :class:`~experiments.lora_finetune.Network`
of a causal LM: the calibration experiment's methods take either.

A task is scored in one of two ways (:class:`Prompting`): by the **answer tokens**, the
next-token logits of the labels at the end of the prompt (the papers' letters, or
`` negative`` / `` positive``), or by the **choice texts**, the log-probability of each
choice's own text after the question (:class:`~pyro_bdl.models.ChoiceTexts`, cloze
scoring): ``arc_easy_text`` is ARC-Easy scored so, which SmolLM2-135M answers well
above chance where it is at chance on the letters.

Example::

    task = CausalTask(TaskSpec("imdb", 256, 256, 128, batch_size=8, steps=32,
                               validation_size=128, lr=1e-3), data_dir, smollm2_directory())
    network = CausalNetwork(task, seed=0)
    theta_map = fine_tune_map(network, task, seed=0)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils.data import DataLoader

import pyro_bdl as bdl
from experiments.lora_finetune import (
    EVAL_BATCH_SIZE,
    LORA,
    PRIOR_SCALE,
    Network,
    Task,
    TaskSpec,
    quiet,
)
from pyro_bdl.data import RecordDataset, load
from pyro_bdl.data.prompts import answer_labels
from pyro_bdl.data.tokenize import (
    CausalChoiceTextCollator,
    CausalMultipleChoiceCollator,
    answer_token_ids,
)
from pyro_bdl.models import BayesianNet, ChoiceTexts, LoRAModel, lora_model
from pyro_bdl.models.heads import IGNORE_INDEX

__all__ = [
    "Prompting",
    "PROMPTS",
    "LABELS",
    "causal_lora",
    "FrozenPrefix",
    "CausalTask",
    "CausalNetwork",
    "causal_tokenizer",
    "load_causal_lm",
    "hidden_items",
    "collate_hidden",
    "hidden_loader",
    "whole_model_logits",
    "check_cut",
]


@dataclass(frozen=True)
class Prompting:
    """How a causal LM is asked a task's question, and how its answer is scored.

    :param str dataset: the :func:`pyro_bdl.data.load` name of the records.
    :param str template: the prompt (None: the papers' of :mod:`pyro_bdl.data.prompts`
        for the answer tokens; ``"Question: {context}\nAnswer:"`` for the choice texts).
    :param dict options: :func:`pyro_bdl.data.load`'s options.
    :param str scoring: ``"answer_tokens"`` (the labels' next-token logits) or
        ``"choice_text"`` (each choice's log-probability after the prompt).
    """

    dataset: str
    template: str | None = None
    options: dict = field(default_factory=dict)
    scoring: str = "answer_tokens"

    def label_token_ids(self, tokenizer, record: dict) -> list[int] | None:
        """The token id of each answer label (:data:`LABELS` or the letters of
        ``record``'s choices); None for the choice texts, which have no answer tokens."""
        if self.scoring == "choice_text":
            return None
        labels = LABELS.get(self.dataset) or answer_labels(record, self.dataset)
        return answer_token_ids(tokenizer, labels)

    def collator(self, tokenizer, max_length: int):
        """The collator of this task's records."""
        if self.scoring == "choice_text":
            return CausalChoiceTextCollator(tokenizer, self.dataset, max_length, self.template)
        return CausalMultipleChoiceCollator(
            tokenizer, self.dataset, max_length=max_length, template=self.template
        )


_REVIEW = "Review: {text}\nSentiment:"
#: task -> :class:`Prompting`. SST-2 and IMDB have no template in the papers: this one's
#: answer tokens (:data:`LABELS`) are SmolLM2's own top answers after it, zero shot.
#: BoolQ's passage comes first, so that a long one cut to the prompt length loses its
#: beginning, not the question.
PROMPTS = {
    "sst2": Prompting("sst2", _REVIEW),
    "imdb": Prompting("imdb", _REVIEW),
    "winogrande_s": Prompting("winogrande_s"),
    "obqa": Prompting("obqa"),
    "arc_easy": Prompting("arc_easy", options={"num_choices": 4}),
    "arc_easy_text": Prompting("arc_easy", options={"num_choices": 4}, scoring="choice_text"),
    "obqa_text": Prompting("obqa", scoring="choice_text"),
    "boolq": Prompting("boolq", "{passage}\nQuestion: {question}? Answer True or False.\nAnswer:"),
}
#: The answer labels of the tasks that have no letters (the others: ``" A"``, ``" B"``, ...).
LABELS = {"sst2": [" negative", " positive"], "imdb": [" negative", " positive"]}
#: How far the cut model's answer logits may be from the whole model's (float32).
CUT_TOLERANCE = 1e-3


class FrozenPrefix:
    """The decoder layers below the LoRA layers of a Llama-like causal LM, run once.

    ``FrozenPrefix(model, top_layers)`` cuts ``model`` (in place) to its last
    ``top_layers`` decoder layers, its final norm and head; :meth:`hidden` gives, for
    a batch of token ids, the hidden states that the removed layers would hand to the
    kept ones. The cut model fed with them (``inputs_embeds=``) computes what the whole
    model computes from the tokens: positions come from the attention mask, and the
    removed layers have no weights that LoRA on the kept layers changes.

    :param model: a ``transformers`` Llama-architecture causal LM (``model.model.layers``).
    :param int top_layers: decoder layers kept (the ones LoRA adapts).
    """

    def __init__(self, model, top_layers: int):
        inner = model.model
        layers = inner.layers
        if not 1 <= top_layers < len(layers):
            raise ValueError(f"top_layers must be in [1, {len(layers) - 1}], got {top_layers}")
        self.inner, self.config = inner, model.config
        self.bottom = layers[: len(layers) - top_layers]
        self.top = layers[len(layers) - top_layers :]
        self.norm = inner.norm
        inner.layers = self.top
        model.config.num_hidden_layers = top_layers
        if getattr(model.config, "layer_types", None):
            model.config.layer_types = model.config.layer_types[-top_layers:]

    @torch.no_grad()
    def hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """``(B, L, hidden)`` states entering the kept layers (left-padded prompts)."""
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        # transformers runs layers[: config.num_hidden_layers]: the count follows the cut.
        self.inner.layers, self.inner.norm = self.bottom, torch.nn.Identity()
        self.config.num_hidden_layers = len(self.bottom)
        try:
            out = self.inner(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=False,
            )
        finally:
            self.inner.layers, self.inner.norm = self.top, self.norm
            self.config.num_hidden_layers = len(self.top)
        return out.last_hidden_state


def causal_tokenizer(base: str | os.PathLike):
    """The tokenizer of the local causal LM ``base`` (a ``save_pretrained`` directory)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(base)


def load_causal_lm(base: str | os.PathLike):
    """The local causal LM ``base``, in eval mode, loaded without transformers' report."""
    from transformers import AutoModelForCausalLM

    with quiet():
        return AutoModelForCausalLM.from_pretrained(base).eval()


def causal_lora(
    model, prompting: Prompting, tokenizer, label_token_ids=None, **options
) -> LoRAModel:
    """:func:`~pyro_bdl.models.lora_model` of a (cut) causal LM for a task: the answer
    tokens' logits, or the choice texts' log-probabilities
    (:class:`~pyro_bdl.models.ChoiceTexts`, lifted around the peft model so that one call
    scores every choice with one draw). ``options`` go to ``lora_model``."""
    if prompting.scoring == "answer_tokens":
        return lora_model(
            model,
            "multiple_choice",
            label_token_ids=label_token_ids,
            tokenizer=tokenizer,
            **options,
        )
    lora = lora_model(model, "causal_lm", tokenizer=tokenizer, **options)
    # the same adapters and prior, lifted around the scorer of the choices
    net = bdl.lift(ChoiceTexts(lora.peft_model), lora.net.prior, random="lora_")
    return LoRAModel(BayesianNet(net), lora.peft_model, tokenizer, "multiple_choice")


def hidden_items(prefix: FrozenPrefix, collate, records, batch_size: int) -> list[dict]:
    """Each record's hidden states at the cut and its ``"label"``: ``"h"`` the prompt's
    states (unpadded), or for the choice texts a list of each choice's sequence's, with
    their ``"choice_tokens"``."""
    records = list(records)
    items = []
    for start in range(0, len(records), batch_size):
        batch = collate(records[start : start + batch_size])
        mask = batch["attention_mask"]
        flat = prefix.hidden(
            batch["input_ids"].reshape(-1, mask.shape[-1]), mask.reshape(-1, mask.shape[-1])
        )
        hidden = flat.reshape(*mask.shape, -1)
        for row in range(mask.shape[0]):
            keep = mask[row].bool()
            item = {"label": batch["labels"][row]}
            if mask.dim() == 2:
                item["h"] = hidden[row, keep].clone()
            else:
                choices = range(mask.shape[1])
                item["h"] = [hidden[row, c, keep[c]].clone() for c in choices]
                item["choice_tokens"] = [batch["choice_tokens"][row, c, keep[c]] for c in choices]
            items.append(item)
    return items


def _left_pad(sequences: list[torch.Tensor], fill: float = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(N, L, ...)`` left-padded with ``fill``, and the ``(N, L)`` attention mask."""
    length = max(len(sequence) for sequence in sequences)
    first = sequences[0]
    padded = first.new_full((len(sequences), length, *first.shape[1:]), fill)
    mask = torch.zeros(len(sequences), length, dtype=torch.long)
    for row, sequence in enumerate(sequences):
        padded[row, length - len(sequence) :] = sequence
        mask[row, length - len(sequence) :] = 1
    return padded, mask


def collate_hidden(items: list[dict]) -> dict[str, torch.Tensor]:
    """Left-pad cached hidden states: the batch the cut model takes (``(B, L, H)``
    ``inputs_embeds``, or ``(B, C, L, H)`` with ``choice_tokens`` for the choice texts)."""
    labels = torch.stack([item["label"] for item in items])
    if "choice_tokens" not in items[0]:
        embeds, mask = _left_pad([item["h"] for item in items])
        return {"inputs_embeds": embeds, "attention_mask": mask, "labels": labels}
    shape = (len(items), len(items[0]["h"]))
    embeds, mask = _left_pad([h for item in items for h in item["h"]])
    tokens, _ = _left_pad([t for item in items for t in item["choice_tokens"]], IGNORE_INDEX)
    return {
        "inputs_embeds": embeds.reshape(*shape, *embeds.shape[1:]),
        "attention_mask": mask.reshape(*shape, -1),
        "choice_tokens": tokens.reshape(*shape, -1),
        "labels": labels,
    }


def hidden_loader(items: list[dict], batch_size: int, seed: int | None = None) -> DataLoader:
    """Batches of cached prompts; shuffled (by ``seed``) for training, otherwise shortest
    first, as :meth:`~experiments.lora_finetune.Task.eval_loader`'s: in the records' order
    58 % of a batch of 32 of ARC-Easy's choice texts is padding, shortest first 4 %."""
    if seed is not None:
        generator = torch.Generator().manual_seed(seed)
        return DataLoader(
            items, batch_size, shuffle=True, collate_fn=collate_hidden, generator=generator
        )
    order = sorted(range(len(items)), key=lambda i: _longest(items[i]))
    return DataLoader(items, batch_size, sampler=order, collate_fn=collate_hidden)


def _longest(item: dict) -> int:
    """The length of an item's longest sequence (its prompt, or its longest choice's)."""
    hidden = item["h"]
    return max(map(len, hidden)) if isinstance(hidden, list) else len(hidden)


def whole_model_logits(model, collate, records, ids: list[int] | None = None) -> torch.Tensor:
    """The classes' logits of the whole model (before it is cut), for the cut's check: the
    answer tokens' (``ids``) at the prompts' last position, or the choice texts' scores."""
    batch = collate(list(records))
    inputs = {key: value for key, value in batch.items() if key != "labels"}
    with torch.no_grad():
        if "choice_tokens" in inputs:
            return ChoiceTexts(model)(**inputs)
        position_ids = (inputs["attention_mask"].cumsum(-1) - 1).clamp(min=0)
        logits = model(**inputs, position_ids=position_ids, use_cache=False).logits
    return logits[:, -1, ids]


def check_cut(reference: torch.Tensor, items: list[dict], model) -> float:
    """The largest difference between a cut model's answer logits, on the first
    ``len(reference)`` of ``items`` (cached states), and ``reference``, the whole model's
    (:func:`whole_model_logits`), with the adapters at their initial values; refused
    above :data:`CUT_TOLERANCE`."""
    batch = collate_hidden(items[: len(reference)])
    del batch["labels"]
    with torch.no_grad(), model.net.fixed(model.net.init_values()):
        logits = model(batch)
    error = float((reference - logits.to(reference.device)).abs().max())
    if error > CUT_TOLERANCE:
        raise RuntimeError(
            f"the cut model's answer logits differ by {error:.3g} from the whole model's "
            f"(tolerance {CUT_TOLERANCE}): the frozen prefix is not exact for this base"
        )
    return error


class CausalTask(Task):
    """A :class:`~experiments.lora_finetune.Task` for a causal LM: the same subsets, as
    batches of the hidden states that the frozen layers below the adapted ones give.

    The prompts (:data:`PROMPTS`) are run through the base's frozen layers once, here;
    the loaders batch the cached states (``inputs_embeds``, left-padded), which every
    :class:`CausalNetwork` of the task takes.

    :param TaskSpec spec: the sizes and training length (``spec.lr``: the recipe's
        learning rate for this model).
    :param data_dir: the folder holding the datasets.
    :param base: a local causal LM directory (e.g.
        :func:`~pyro_bdl.models.smollm2.smollm2_directory`).
    :param int top_layers: the decoder layers LoRA adapts (the last ones).
    :param str shift: another task of :data:`PROMPTS` whose test questions the methods are
        also scored on, never trained or tuned on (the papers' distribution shift: BLoB's
        Table 2, Laplace-LoRA's out-of-distribution tables); it must score its answers as
        this task does. None: none.
    :param int shift_size: how many of ``shift``'s test questions (a seeded subset; None:
        all).
    """

    def __init__(
        self,
        spec: TaskSpec,
        data_dir: str | os.PathLike,
        base: str | os.PathLike,
        top_layers: int,
        shift: str | None = None,
        shift_size: int | None = None,
    ):
        for name in (spec.dataset, shift):
            if name is not None and name not in PROMPTS:
                raise ValueError(
                    f"{name}: a causal LM's task needs a prompt; choose one of {list(PROMPTS)}"
                )
        self.base, self.top_layers = Path(base), top_layers
        self.prompting = PROMPTS[spec.dataset]
        super().__init__(spec, data_dir, causal_tokenizer(base))
        self.label_token_ids = self.prompting.label_token_ids(self.tokenizer, self.train[0])
        if self.label_token_ids is not None:
            self.num_classes = len(self.label_token_ids)
        model = load_causal_lm(base)
        #: the whole model's class logits of two training prompts: each network checks its cut
        self.reference = whole_model_logits(
            model, self.collate, [self.train[0], self.train[1]], self.label_token_ids
        )
        prefix = FrozenPrefix(model, top_layers)
        self._items = {
            split: hidden_items(prefix, self.collate, getattr(self, split), spec.batch_size)
            for split in ("train", "validation", "test")
        }
        #: ``shift``'s test questions (None: no shift)
        self.shift, self.shift_name = None, shift
        if shift is not None:
            prompting = PROMPTS[shift]
            self.shift = load(
                prompting.dataset, data_dir, "test", limit=shift_size, **prompting.options
            )
            self._check_shift(shift, prompting)
            collate = prompting.collator(self.tokenizer, spec.max_length)
            self._items["shift"] = hidden_items(prefix, collate, self.shift, spec.batch_size)

    def _check_shift(self, shift: str, prompting: Prompting) -> None:
        """Refuse a shift whose answers this task's network cannot score."""
        if prompting.scoring == "choice_text":
            choices = len(self.shift[0]["choices"])
            same = self.prompting.scoring == "choice_text" and choices == self.num_classes
        else:
            same = prompting.label_token_ids(self.tokenizer, self.shift[0]) == self.label_token_ids
        if not same:
            raise ValueError(
                f"shift={shift!r} scores its answers otherwise than {self.spec.dataset!r} "
                f"({prompting.scoring} against {self.prompting.scoring}, or other answer "
                "tokens or number of choices); choose a task that this one's network can answer"
            )

    def items(self, split: str) -> list[dict]:
        """The cached states of the ``"train"``, ``"validation"``, ``"test"`` or
        ``"shift"`` subset."""
        return self._items[split]

    def _load(self, split: str, limit: int | None = None) -> RecordDataset:
        prompting = self.prompting
        return load(prompting.dataset, self.data_dir, split, limit=limit, **prompting.options)

    def _collator(self):
        return self.prompting.collator(self.tokenizer, self.spec.max_length)

    def train_loader(self, seed: int) -> DataLoader:
        """Shuffled minibatches of the training prompts' cached states."""
        return hidden_loader(self._items["train"], self.spec.batch_size, seed)

    def eval_loader(self, records=None) -> DataLoader:
        """Batches of the test subset's cached states (or of ``records``: the task's own
        training, validation, test or shift subset)."""
        records = self.test if records is None else records
        for split in self._items:
            if records is getattr(self, split):
                return hidden_loader(self._items[split], EVAL_BATCH_SIZE)
        raise ValueError(
            "CausalTask.eval_loader takes the task's own train, validation, test or shift "
            "records: only their hidden states are cached"
        )

    def shift_loader(self) -> DataLoader | None:
        """Batches of the shift's questions (None: the task has no shift)."""
        return None if self.shift is None else self.eval_loader(self.shift)

    def sizes(self) -> dict[str, int]:
        sizes = super().sizes()
        if self.shift is not None:
            sizes["shift"] = len(self.shift)
        return sizes


class CausalNetwork(Network):
    """A fresh causal LM + LoRA for a :class:`CausalTask`, and its Pyro model.

    The base's last ``task.top_layers`` decoder layers, its norm and head (frozen), with
    LoRA (rank 8, alpha 16, dropout 0.1) on their queries and values; the random sites
    are the adapters, with the IID prior :math:`\\mathcal{N}(0, 0.2^2)` of every method
    of the table. ``torch.manual_seed(seed)`` fixes the LoRA A initialisation. Its models
    take the task's batches of cached states; the answer tokens' logits, or the choice
    texts' log-probabilities, are the classes (:func:`causal_lora`). Refuses a cut that
    does not compute the whole model's.

    :param CausalTask task: the task.
    :param int seed: the seed of the initialisation.
    :param device: where the network lives.
    """

    def __init__(self, task: CausalTask, seed: int, device: str | torch.device = "cpu"):
        torch.manual_seed(seed)
        self.device = torch.device(device)
        base = load_causal_lm(task.base)
        FrozenPrefix(base, task.top_layers)
        with quiet():
            self.lora = causal_lora(
                base,
                task.prompting,
                task.tokenizer,
                task.label_token_ids,
                prior_scale=PRIOR_SCALE,
                **LORA,
            )
        self.lora.peft_model.to(self.device)
        self.module = self.lora.net.module  # the peft model, or ChoiceTexts around it
        self.model, self.net = self.lora.model, self.lora.net
        self.likelihood = self.model.head
        check_cut(task.reference, task.items("train"), self.model)
