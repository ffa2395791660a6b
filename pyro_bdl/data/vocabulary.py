"""
A word-level vocabulary and collator for the CNN-LSTM on IMDB (posteriors' cold-posterior
experiment, after Wenzel et al., 2020), which reads reviews as 100 word indices.

Words are lower-cased, HTML line breaks ``<br />`` are removed and words are runs of
letters and digits (with inner apostrophes: "don't"). Index 0 is padding, 1 an
out-of-vocabulary word. A review is cut and padded as Keras' ``pad_sequences`` does by
default (``padding="pre"``, ``truncating="pre"``): it keeps its LAST ``length`` words and
is padded at the front.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from pyro_bdl._checks import instance, integer
from pyro_bdl.data.records import Record, labels_tensor

PAD = 0
OOV = 1
_RESERVED = 2
_BREAK = re.compile(r"<br\s*/?>", re.IGNORECASE)
_WORD = re.compile(r"[a-z0-9]+(?:'[a-z0-9]+)*")


def split_words(text: str) -> list[str]:
    """
    The lower-cased words of a text, HTML line breaks removed.

    Example::

        >>> split_words("Don't watch it.<br /><br />BAD film!")
        ["don't", 'watch', 'it', 'bad', 'film']

    :param str text: the text.
    """
    instance("text", text, str, "a string")
    return _WORD.findall(_BREAK.sub(" ", text).lower())


class WordVocabulary:
    """
    The most frequent words of a training split, as indices ``2 .. vocab_size - 1``.

    ``len(vocabulary) == vocab_size`` counts the two reserved indices (0 padding, 1
    out-of-vocabulary), so it is the row count of the embedding, as with Keras'
    ``num_words``. Ties in frequency go to the alphabetically first word.

    Example::

        >>> vocab = WordVocabulary.build(["a good film", "a bad film", "a film"], vocab_size=4)
        >>> vocab.words
        ['a', 'film']
        >>> vocab.encode("a great film", length=5)
        [0, 0, 2, 1, 3]

    :param words: the words of indices 2, 3, ... in order.
    """

    def __init__(self, words: Sequence[str]):
        if isinstance(words, str) or not all(isinstance(word, str) for word in words):
            raise TypeError("words must be a list of strings, the words of indices 2, 3, ...")
        if len(set(words)) != len(words):
            raise ValueError("words must be distinct: each word has one index")
        self.words = list(words)
        self.index = {word: i for i, word in enumerate(self.words, start=_RESERVED)}

    def __len__(self) -> int:
        return len(self.words) + _RESERVED

    @classmethod
    def build(cls, texts: Iterable[str], vocab_size: int = 20_000) -> WordVocabulary:
        """
        The vocabulary of the ``vocab_size - 2`` most frequent words of ``texts``.

        :param texts: the training texts, e.g. ``(r["text"] for r in load("imdb", d, "train"))``.
        :param int vocab_size: indices in all, the two reserved ones included.
        """
        if isinstance(texts, str):
            raise TypeError("texts must be an iterable of texts, not one string")
        vocab_size = integer("vocab_size", vocab_size, low=_RESERVED + 1)
        counts = Counter(word for text in texts for word in split_words(text))
        ranked = sorted(counts, key=lambda word: (-counts[word], word))
        return cls(ranked[: vocab_size - _RESERVED])

    def encode(self, text: str, length: int = 100) -> list[int]:
        """
        Exactly ``length`` indices: the text's last ``length`` words, front-padded with 0.

        :param str text: the text.
        :param int length: the sequence length (100 for the CNN-LSTM).
        """
        length = integer("length", length, low=1)
        ids = [self.index.get(word, OOV) for word in split_words(text)][-length:]
        return [PAD] * (length - len(ids)) + ids

    def save(self, path: str | Path) -> None:
        """Write the vocabulary as JSON (``{"words": [...]}``, index order from 2)."""
        Path(path).write_text(json.dumps({"words": self.words}), encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> WordVocabulary:
        """Read a vocabulary written by :meth:`save`."""
        content = json.loads(Path(path).read_text(encoding="utf-8"))
        if not isinstance(content, dict) or not isinstance(content.get("words"), list):
            raise ValueError(f"{path}: expected a JSON object {{'words': [...]}} written by save()")
        return cls(content["words"])


class WordCollator:
    """
    Batches text classification records as word indices for the CNN-LSTM.

    Batch: ``input_ids`` of shape ``(B, length)`` and ``labels`` of shape ``(B,)``, both
    ``torch.long``.

    Example::

        vocab = WordVocabulary.build(r["text"] for r in load("imdb", data_dir, "train"))
        collate = WordCollator(vocab)  # the test split uses the training vocabulary too

    :param WordVocabulary vocabulary: built from the training split.
    :param int length: words per review (100).
    """

    def __init__(self, vocabulary: WordVocabulary, length: int = 100):
        self.vocabulary = instance(
            "vocabulary", vocabulary, WordVocabulary, "a WordVocabulary (WordVocabulary.build)"
        )
        self.length = integer("length", length, low=1)

    def __call__(self, records: Sequence[Record]) -> dict[str, torch.Tensor]:
        if isinstance(records, dict) or not records:
            raise ValueError("records must be a non-empty list of records with 'text'")
        input_ids = [self.vocabulary.encode(record["text"], self.length) for record in records]
        return {
            "input_ids": torch.tensor(input_ids, dtype=torch.long),
            "labels": labels_tensor(records),
        }
