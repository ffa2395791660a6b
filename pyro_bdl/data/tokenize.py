"""
Collators that turn records into batches of tensors for Hugging Face models, and token
windows for causal language modelling. Every collator is a callable for the
``collate_fn`` of :class:`torch.utils.data.DataLoader`; batches are dicts of tensors
padded dynamically to the longest sequence of the batch (see :mod:`pyro_bdl.data`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch.utils.data import Dataset

from pyro_bdl._checks import function, instance, integer, one_of
from pyro_bdl.data.prompts import (
    MULTIPLE_CHOICE,
    PROMPTED,
    choice_pairs,
    fill_template,
    format_prompt,
)
from pyro_bdl.data.records import Record, labels_tensor

Batch = dict[str, torch.Tensor]
_MODEL_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


def _model_inputs(encoding: Any) -> Batch:
    """The tensors a model takes from a tokenizer's output, as int64."""
    return {key: encoding[key].long() for key in _MODEL_INPUTS if key in encoding}


def _check_records(records: Sequence[Record]) -> None:
    if isinstance(records, dict) or not records:
        raise ValueError(
            "records must be a non-empty list of records (dicts from pyro_bdl.data.load), got "
            f"{'an empty list' if not records else 'a single dict'}"
        )


def _pad_id(tokenizer: Any) -> int:
    # Padded positions are masked out, so any id serves; causal LMs often have no pad token.
    pad_id = (
        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    )
    if pad_id is None:
        raise ValueError(
            "the tokenizer has neither a pad_token_id nor an eos_token_id; set "
            "tokenizer.pad_token to any token of its vocabulary (padding is masked out)"
        )
    return pad_id


class ClassificationCollator:
    """
    Batches text (or text-pair) classification records for an encoder.

    Batch: ``input_ids``, ``attention_mask`` (and ``token_type_ids`` when the tokenizer
    makes them) of shape ``(B, L)``, ``labels`` of shape ``(B,)``, all ``torch.long``;
    ``L`` is the longest sequence of the batch, at most ``max_length``.

    Example::

        collate = ClassificationCollator(tokenizer, max_length=128)
        train = load("sst2", data_dir, "train")
        batch = collate([train[i] for i in range(8)])
        boolq = ClassificationCollator(tokenizer, 256, text_fields=("question", "passage"))

    :param tokenizer: a Hugging Face tokenizer.
    :param int max_length: longer sequences are truncated to this many tokens.
    :param text_fields: the record's text field, or two fields tokenized as a text pair
        (``("question", "passage")`` for BoolQ).
    """

    def __init__(
        self, tokenizer: Any, max_length: int = 128, text_fields: Sequence[str] = ("text",)
    ):
        function("tokenizer", tokenizer, "a Hugging Face tokenizer")
        if isinstance(text_fields, str):
            text_fields = (text_fields,)
        if len(text_fields) not in (1, 2) or not all(isinstance(f, str) for f in text_fields):
            raise ValueError(f"text_fields must name one or two fields, got {text_fields!r}")
        self.tokenizer = tokenizer
        self.max_length = integer("max_length", max_length, low=1)
        self.text_fields = tuple(text_fields)

    def __call__(self, records: Sequence[Record]) -> Batch:
        _check_records(records)
        absent = [field for field in self.text_fields if field not in records[0]]
        if absent:
            raise ValueError(
                f"records have no field {', '.join(absent)} (fields: {', '.join(records[0])}); "
                "pass text_fields=... naming the text, e.g. ('question', 'passage') for BoolQ"
            )
        texts = [[record[field] for record in records] for field in self.text_fields]
        encoding = self.tokenizer(
            *texts,
            padding=True,
            truncation=True,
            max_length=self.max_length,
            return_tensors="pt",
        )
        return {**_model_inputs(encoding), "labels": labels_tensor(records)}


class MultipleChoiceCollator:
    """
    Batches multiple-choice records for an encoder that scores each (context, choice) pair
    of :func:`~pyro_bdl.data.prompts.choice_pairs`.

    Batch: ``input_ids``, ``attention_mask`` (and ``token_type_ids``) of shape
    ``(B, C, L)`` with ``C`` choices per record, ``labels`` of shape ``(B,)``, all
    ``torch.long``. All records of a batch need the same number of choices: load ARC with
    ``num_choices=4`` to drop its few 3- and 5-choice questions.

    Example::

        collate = MultipleChoiceCollator(tokenizer, "obqa", max_length=128)

    :param tokenizer: a Hugging Face tokenizer.
    :param str dataset_name: ``winogrande_*``, ``arc_easy``, ``arc_challenge`` or ``obqa``.
    :param int max_length: each pair is truncated to this many tokens.
    """

    def __init__(self, tokenizer: Any, dataset_name: str, max_length: int = 128):
        function("tokenizer", tokenizer, "a Hugging Face tokenizer")
        self.tokenizer = tokenizer
        self.dataset_name = one_of("dataset_name", dataset_name, MULTIPLE_CHOICE)
        self.max_length = integer("max_length", max_length, low=1)

    def __call__(self, records: Sequence[Record]) -> Batch:
        _check_records(records)
        pairs = [choice_pairs(record, self.dataset_name) for record in records]
        counts = sorted({len(choices) for choices in pairs})
        if len(counts) > 1:
            raise ValueError(
                f"a batch mixes records with {counts} choices; load {self.dataset_name} with "
                f"num_choices=... so that every record has the same number"
            )
        flat = [pair for choices in pairs for pair in choices]
        encoding = self.tokenizer(
            [context for context, _ in flat],
            [choice for _, choice in flat],
            padding=True,
            truncation=True,
            max_length=self.max_length,
            return_tensors="pt",
        )
        shape = (len(records), counts[0], -1)
        inputs = {key: value.view(shape) for key, value in _model_inputs(encoding).items()}
        return {**inputs, "labels": labels_tensor(records)}


def answer_token_ids(tokenizer: Any, labels: Sequence[str], context: str = "Answer:") -> list[int]:
    """
    The token id of each answer label as it follows a prompt ending in ``context``.

    The label is tokenized after ``context`` and read off as the tokens that follow it,
    so a tokenizer that marks word starts (GPT-2's ``Ġ``, SentencePiece's ``▁``) gives
    the id the model predicts after the prompt.

    Example::

        ids = answer_token_ids(tokenizer, answer_labels(record, "arc_easy"))
        scores = model(**batch).logits[:, -1, ids]  # (B, number of choices)

    :param tokenizer: a Hugging Face tokenizer.
    :param labels: label texts from :func:`~pyro_bdl.data.prompts.answer_labels`.
    :param str context: the end of the prompt that the labels follow.
    :raises ValueError: when a label is not exactly one token, or is the unknown token.
    """
    prefix = tokenizer(context, add_special_tokens=False)["input_ids"]
    ids = []
    for label in labels:
        full = tokenizer(context + label, add_special_tokens=False)["input_ids"]
        tokens = full[len(prefix) :]
        if full[: len(prefix)] != prefix or len(tokens) != 1:
            raise ValueError(
                f"answer label {label!r} must be a single token after {context!r}, but this "
                f"tokenizer makes it {len(tokens)} tokens {tokenizer.convert_ids_to_tokens(tokens)}"
                "; use a tokenizer (model) whose vocabulary holds the label as one token"
            )
        if tokens[0] == tokenizer.unk_token_id:
            raise ValueError(f"answer label {label!r} is the unknown token for this tokenizer")
        ids.append(tokens[0])
    return ids


def _without_trailing_special(ids: list[int], special: list[int]) -> list[int]:
    """Drop the special tokens a tokenizer appends (EOS, SEP): the answer comes next."""
    end = len(ids)
    while end > 0 and special[end - 1]:
        end -= 1
    return ids[:end]


class CausalMultipleChoiceCollator:
    """
    Batches records as prompts (:func:`~pyro_bdl.data.prompts.format_prompt`) for a causal
    LM that answers with the logits of the answer tokens at the last position.

    Batch: ``input_ids`` and ``attention_mask`` of shape ``(B, L)``, LEFT-padded so that
    position ``-1`` holds every prompt's last token (leading special tokens such as BOS are
    kept, trailing ones such as EOS dropped); ``labels`` of shape ``(B,)`` indexes
    the record's :func:`~pyro_bdl.data.prompts.answer_labels` (token ids from
    :func:`answer_token_ids`). A prompt longer than ``max_length`` loses its beginning.

    Example::

        collate = CausalMultipleChoiceCollator(tokenizer, "arc_easy", max_length=512)
        ids = answer_token_ids(tokenizer, [" A", " B", " C", " D"])
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits[:, -1, ids]

    :param tokenizer: a Hugging Face tokenizer (padding is done here, on the left, with the
        pad token or else the end-of-sequence token).
    :param str dataset_name: ``winogrande_*``, ``arc_easy``, ``arc_challenge``, ``obqa`` or
        ``boolq``.
    :param int max_length: prompts keep their last ``max_length`` tokens.
    :param template: a prompt of one's own instead of the papers': a format string over
        the record's fields, in which ``{choices}`` is the lettered list ``"A. x. B. y."``
        (e.g. ``"{passage}\\nQuestion: {question}?\\nAnswer:"`` for BoolQ, which keeps the
        question when a long passage is cut, or ``"Review: {text}\\nSentiment:"`` for
        SST-2, a dataset without a template of its own), or a function record -> prompt.
        With a template, ``dataset_name`` may be any dataset.
    """

    def __init__(
        self,
        tokenizer: Any,
        dataset_name: str,
        max_length: int = 512,
        template: str | Callable[[Record], str] | None = None,
    ):
        function("tokenizer", tokenizer, "a Hugging Face tokenizer")
        self.tokenizer = tokenizer
        if template is None:
            self.dataset_name = one_of("dataset_name", dataset_name, PROMPTED)
            self.prompt = partial(format_prompt, dataset_name=dataset_name)
        elif isinstance(template, str):
            self.dataset_name = dataset_name
            self.prompt = partial(fill_template, template)
        else:
            function("template", template, "a format string or a function record -> prompt")
            self.dataset_name = dataset_name
            self.prompt = template
        self.max_length = integer("max_length", max_length, low=1)
        self.pad_id = _pad_id(tokenizer)

    def __call__(self, records: Sequence[Record]) -> Batch:
        _check_records(records)
        prompts = [self.prompt(record) for record in records]
        # verbose=False: the full prompt may exceed model_max_length before it is cut here.
        encoding = self.tokenizer(prompts, return_special_tokens_mask=True, verbose=False)
        sequences = [
            _without_trailing_special(ids, special)[-self.max_length :]
            for ids, special in zip(
                encoding["input_ids"], encoding["special_tokens_mask"], strict=True
            )
        ]
        length = max(len(ids) for ids in sequences)
        input_ids = torch.full((len(records), length), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(records), length), dtype=torch.long)
        for row, ids in enumerate(sequences):
            input_ids[row, length - len(ids) :] = torch.tensor(ids, dtype=torch.long)
            attention_mask[row, length - len(ids) :] = 1
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "labels": labels_tensor(records),
        }


class CausalChoiceTextCollator:
    """
    Batches multiple-choice records for a causal LM that scores each choice by its own
    text (cloze scoring): one sequence per (question, choice), the prompt followed by the
    choice, whose tokens' log-probabilities
    (:class:`~pyro_bdl.models.ChoiceTexts`) score it.

    This is how small causal LMs answer multiple-choice questions that they cannot answer
    with a letter (SmolLM2-135M is at chance on ARC-Easy's letters and answers half of its
    questions by their text); the papers' letter scoring is
    :class:`CausalMultipleChoiceCollator`. The (context, choice) texts are
    :func:`~pyro_bdl.data.prompts.choice_pairs`' (for WinoGrande the sentence up to the
    blank, then the option and the rest of the sentence).

    Batch: ``input_ids`` and ``attention_mask`` of shape ``(B, C, L)``, LEFT-padded;
    ``choice_tokens`` ``(B, C, L)``, the choice's token ids at its own positions (the last
    ones of its sequence) and ``-100`` elsewhere; ``labels`` ``(B,)``, the right choice. A
    sequence longer than ``max_length`` loses the beginning of its prompt.

    Example::

        collate = CausalChoiceTextCollator(tokenizer, "arc_easy", max_length=128)
        lora = lora_model(base, "causal_lm")
        model = BayesianNet(bdl.lift(ChoiceTexts(lora.peft_model), prior, random="lora_"))

    :param tokenizer: a Hugging Face tokenizer (padding is done here, on the left, with the
        pad token or else the end-of-sequence token).
    :param str dataset_name: ``winogrande_*``, ``arc_easy``, ``arc_challenge`` or ``obqa``.
    :param int max_length: tokens per sequence.
    :param str template: the prompt, a format string over ``{context}``, the question
        (default ``"Question: {context}\\nAnswer:"``; WinoGrande's default is the
        sentence up to the blank itself). Each choice follows it after a space.
    """

    def __init__(
        self,
        tokenizer: Any,
        dataset_name: str,
        max_length: int = 512,
        template: str | None = None,
    ):
        function("tokenizer", tokenizer, "a Hugging Face tokenizer")
        self.tokenizer = tokenizer
        self.dataset_name = one_of("dataset_name", dataset_name, MULTIPLE_CHOICE)
        if template is None:
            sentence = dataset_name.startswith("winogrande")
            template = "{context}" if sentence else "Question: {context}\nAnswer:"
        self.template = instance("template", template, str, "a format string over {context}")
        self.max_length = integer("max_length", max_length, low=2)
        self.pad_id = _pad_id(tokenizer)

    def _sequence(self, context: str, choice: str) -> tuple[list[int], int]:
        """The prompt's and the choice's token ids, cut to ``max_length``; the choice's length."""
        encoding = self.tokenizer(
            self.template.format(context=context), return_special_tokens_mask=True, verbose=False
        )
        prompt = _without_trailing_special(encoding["input_ids"], encoding["special_tokens_mask"])
        answer = self.tokenizer(" " + choice, add_special_tokens=False)["input_ids"]
        answer = answer[-(self.max_length - 1) :]  # at least one prompt token conditions it
        return (prompt + answer)[-self.max_length :], len(answer)

    def __call__(self, records: Sequence[Record]) -> Batch:
        _check_records(records)
        sequences = [
            [
                self._sequence(context, choice)
                for context, choice in choice_pairs(r, self.dataset_name)
            ]
            for r in records
        ]
        choices = {len(row) for row in sequences}
        if len(choices) != 1:
            raise ValueError(
                f"records with different numbers of choices ({sorted(choices)}) cannot share a "
                "batch; load them with num_choices=... (ARC) or batch them apart"
            )
        length = max(len(ids) for row in sequences for ids, _ in row)
        shape = (len(records), choices.pop(), length)
        input_ids = torch.full(shape, self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros(shape, dtype=torch.long)
        choice_tokens = torch.full(shape, -100, dtype=torch.long)
        for b, row in enumerate(sequences):
            for c, (ids, answer) in enumerate(row):
                input_ids[b, c, length - len(ids) :] = torch.tensor(ids, dtype=torch.long)
                attention_mask[b, c, length - len(ids) :] = 1
                choice_tokens[b, c, length - answer :] = input_ids[b, c, length - answer :]
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "choice_tokens": choice_tokens,
            "labels": labels_tensor(records),
        }


class TokenWindows(Dataset):
    """
    A token sequence cut into windows of ``window`` tokens, starting every ``stride`` tokens.

    Windows start at ``0, stride, 2 * stride, ...`` up to the first one that reaches the end
    of the text, so every token is covered and only the last window may be shorter. Each
    item is ``{"input_ids": LongTensor}``; batch them with :class:`CausalLMCollator`.

    :param torch.Tensor tokens: the token ids, 1-D.
    :param int window: tokens per window.
    :param int stride: tokens between window starts (``window``: no overlap).
    """

    def __init__(self, tokens: torch.Tensor, window: int, stride: int | None = None):
        if not torch.is_tensor(tokens) or tokens.dim() != 1 or tokens.is_floating_point():
            raise TypeError(
                "tokens must be a 1-D tensor of token ids, got "
                f"{tuple(tokens.shape) if torch.is_tensor(tokens) else type(tokens).__name__}"
            )
        window = integer("window", window, low=1)
        stride = window if stride is None else integer("stride", stride, low=1, high=window)
        if len(tokens) == 0:
            raise ValueError("cannot cut windows from an empty token sequence")
        self.tokens = tokens
        self.window = window
        # One window at 0, then one per stride until a window reaches the last token.
        count = 1 + -(-max(len(tokens) - window, 0) // stride)
        self.starts = range(0, count * stride, stride)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        start = self.starts[index]
        return {"input_ids": self.tokens[start : start + self.window]}


def token_windows(
    text: str, tokenizer: Any, window: int, stride: int | None = None
) -> TokenWindows:
    """
    Tokenize a long text (a book) without special tokens and cut it into windows.

    Example::

        book = load("books", data_dir, "train", book="1342")[0]["text"]
        windows = token_windows(book, tokenizer, window=512)
        loader = make_loader(windows, CausalLMCollator(tokenizer), batch_size=4)

    :param str text: the text.
    :param tokenizer: a Hugging Face tokenizer.
    :param int window: tokens per window.
    :param int stride: tokens between window starts; less than ``window`` overlaps them.
    """
    instance("text", text, str, "a string (e.g. a book's text)")
    function("tokenizer", tokenizer, "a Hugging Face tokenizer")
    # verbose=False: a whole book is far longer than model_max_length, by design.
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    return TokenWindows(torch.tensor(ids, dtype=torch.long), window, stride)


class CausalLMCollator:
    """
    Batches token windows for causal language modelling.

    Batch: ``input_ids``, ``attention_mask`` and ``labels`` of shape ``(B, L)``, all
    ``torch.long``; ``labels`` equals ``input_ids`` (the model shifts them) except at
    padding, which is right-padding set to ``-100`` so the loss ignores it.

    :param tokenizer: a Hugging Face tokenizer, for its pad (or end-of-sequence) token id.
    """

    def __init__(self, tokenizer: Any):
        self.pad_id = _pad_id(tokenizer)

    def __call__(self, items: Sequence[dict[str, torch.Tensor]]) -> Batch:
        if not items or not all(isinstance(item, dict) and "input_ids" in item for item in items):
            raise ValueError(
                "items must be a non-empty list of {'input_ids': tensor} windows, as "
                "TokenWindows gives them"
            )
        length = max(len(item["input_ids"]) for item in items)
        input_ids = torch.full((len(items), length), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(items), length), dtype=torch.long)
        for row, item in enumerate(items):
            input_ids[row, : len(item["input_ids"])] = item["input_ids"]
            attention_mask[row, : len(item["input_ids"])] = 1
        labels = input_ids.masked_fill(attention_mask == 0, -100)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
