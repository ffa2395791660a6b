"""Bad inputs to the data entry points: each a named error, raised at the call.

Every case asserts the exception type and that the message names the argument.
"""

from pathlib import Path

import numpy as np
import pytest
import torch

from pyro_bdl.data import (
    CausalLMCollator,
    CausalMultipleChoiceCollator,
    ClassificationCollator,
    MultipleChoiceCollator,
    RecordDataset,
    TokenWindows,
    WordCollator,
    WordVocabulary,
    load,
    make_loader,
    split_words,
    token_windows,
)


@pytest.fixture
def data_dir(tmp_path):
    (tmp_path / "sst2").mkdir()
    (tmp_path / "sst2" / "train.tsv").write_text("sentence\tlabel\ngood\t1\nbad\t0\n")
    return tmp_path


LOAD = [
    ({"name": "mnist"}, ValueError, "name must be one of"),
    ({"name": None}, ValueError, "name must be one of"),
    ({"name": ["sst2"]}, ValueError, "name must be one of"),
    ({"data_dir": None}, TypeError, "data_dir must be a path"),
    ({"data_dir": 3}, TypeError, "data_dir must be a path"),
    ({"data_dir": "/no/such/dir"}, FileNotFoundError, "data_dir /no/such/dir is not a directory"),
    ({"split": "dev"}, ValueError, "split: sst2 has no split 'dev'"),
    ({"split": None}, ValueError, "split: sst2 has no split None"),
    ({"seed": -1}, ValueError, "seed must be an int >= 0"),
    ({"seed": 1.0}, TypeError, "seed must be an int"),
    ({"seed": True}, TypeError, "seed must be"),
    ({"limit": 0}, ValueError, "limit must be an int >= 1"),
    ({"limit": "10"}, TypeError, "limit must be an int"),
    ({"num_choices": 1}, ValueError, "num_choices must be an int >= 2"),
    ({"num_choices": 4}, ValueError, "num_choices applies to multiple-choice datasets only"),
    ({"name": "boolq", "test_fraction": 0.0}, ValueError, "test_fraction must be a number in"),
    ({"name": "boolq", "test_fraction": "0.2"}, TypeError, "test_fraction must be"),
    ({"name": "books", "test_fraction": float("nan")}, ValueError, "test_fraction must be"),
    ({"name": "flores", "split": "dev", "language": 5}, TypeError, "language must be"),
    ({"language": "eng_Latn"}, ValueError, "unknown option.*language"),
]


@pytest.mark.parametrize("options, error, message", LOAD, ids=str)
def test_load(data_dir, options, error, message):
    arguments = {"name": "sst2", "data_dir": data_dir, "split": "train", **options}
    with pytest.raises(error, match=message):
        load(arguments.pop("name"), arguments.pop("data_dir"), arguments.pop("split"), **arguments)


def test_load_takes_numpy_integers_and_paths(data_dir):
    data = load("sst2", str(data_dir), "train", seed=np.int64(1), limit=np.int32(1))
    assert len(data) == 1
    assert len(load("sst2", Path(data_dir) / "sst2", "train")) == 2


RECORDS = RecordDataset([{"text": "good film", "label": 1}, {"text": "bad", "label": 0}])

MAKE_LOADER = [
    ({"dataset": 3}, TypeError, "dataset must be a sized, indexable dataset"),
    ({"collate": "default"}, TypeError, "collate must be a collator"),
    ({"batch_size": 0}, ValueError, "batch_size must be an int >= 1"),
    ({"batch_size": 2.0}, TypeError, "batch_size must be an int"),
    ({"shuffle": "yes"}, TypeError, "shuffle must be True or False"),
    ({"seed": -3}, ValueError, "seed must be an int >= 0"),
]


@pytest.mark.parametrize("options, error, message", MAKE_LOADER, ids=str)
def test_make_loader(options, error, message):
    arguments = {"dataset": RECORDS, "collate": list, "batch_size": 2, **options}
    with pytest.raises(error, match=message):
        make_loader(arguments.pop("dataset"), arguments.pop("collate"), **arguments)


@pytest.mark.parametrize(
    "n, seed, error, message",
    [
        (0, 0, ValueError, "n must be an int >= 1"),
        (1.5, 0, TypeError, "n must be an int"),
        (None, 0, TypeError, "n must be"),
        (1, -1, ValueError, "seed must be an int >= 0"),
        (1, "0", TypeError, "seed must be"),
    ],
    ids=str,
)
def test_subset(n, seed, error, message):
    with pytest.raises(error, match=message):
        RECORDS.subset(n, seed)


def test_classification_collator(minilm_tokenizer):
    cases = [
        (lambda: ClassificationCollator("bert"), TypeError, "tokenizer must be"),
        (lambda: ClassificationCollator(minilm_tokenizer, 0), ValueError, "max_length must be"),
        (lambda: ClassificationCollator(minilm_tokenizer, 8.0), TypeError, "max_length must be"),
        (
            lambda: ClassificationCollator(minilm_tokenizer, text_fields=("a", "b", "c")),
            ValueError,
            "text_fields must name one or two fields",
        ),
        (
            lambda: ClassificationCollator(minilm_tokenizer, text_fields=[1]),
            ValueError,
            "text_fields must name",
        ),
        (
            lambda: ClassificationCollator(minilm_tokenizer)([]),
            ValueError,
            "records must be a non-empty",
        ),
        (
            lambda: ClassificationCollator(minilm_tokenizer)(RECORDS[0]),
            ValueError,
            "records must be a non-empty list",
        ),
        (
            lambda: ClassificationCollator(minilm_tokenizer)([{"sentence": "x", "label": 0}]),
            ValueError,
            "no field text.*text_fields",
        ),
        (
            lambda: ClassificationCollator(minilm_tokenizer)([{"text": "x"}]),
            ValueError,
            "records .* have no 'label'",
        ),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()
    assert ClassificationCollator(minilm_tokenizer, text_fields="text")(list(RECORDS))[
        "labels"
    ].shape == (2,)


def test_multiple_choice_collators(minilm_tokenizer, word_tokenizer):
    record = {"question": "q?", "choices": ["a", "b"], "label": 0}
    cases = [
        (
            lambda: MultipleChoiceCollator(minilm_tokenizer, "sst2"),
            ValueError,
            "dataset_name must be one of",
        ),
        (
            lambda: MultipleChoiceCollator(minilm_tokenizer, "boolq"),
            ValueError,
            "dataset_name must be one of",
        ),
        (lambda: MultipleChoiceCollator(None, "obqa"), TypeError, "tokenizer must be"),
        (
            lambda: MultipleChoiceCollator(minilm_tokenizer, "obqa", -1),
            ValueError,
            "max_length must be",
        ),
        (
            lambda: MultipleChoiceCollator(minilm_tokenizer, "obqa")([]),
            ValueError,
            "records must be",
        ),
        (
            lambda: CausalMultipleChoiceCollator(word_tokenizer, "imdb"),
            ValueError,
            "dataset_name must be one of",
        ),
        (
            lambda: CausalMultipleChoiceCollator(word_tokenizer, "obqa", 0),
            ValueError,
            "max_length must be",
        ),
        (
            lambda: CausalMultipleChoiceCollator(word_tokenizer, "obqa", "512"),
            TypeError,
            "max_length must be",
        ),
        (lambda: CausalMultipleChoiceCollator("gpt2", "obqa"), TypeError, "tokenizer must be"),
        (
            lambda: CausalMultipleChoiceCollator(word_tokenizer, "obqa")(record),
            ValueError,
            "records must be",
        ),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()


@pytest.mark.parametrize(
    "tokens, window, stride, error, message",
    [
        (torch.arange(10), 0, None, ValueError, "window must be an int >= 1"),
        (torch.arange(10), 4.0, None, TypeError, "window must be an int"),
        (torch.arange(10), 4, 5, ValueError, r"stride must be an int in \[1, 4\]"),
        (torch.arange(10), 4, True, TypeError, "stride must be"),
        ([1, 2, 3], 2, None, TypeError, "tokens must be a 1-D tensor of token ids"),
        (torch.zeros(2, 5, dtype=torch.long), 2, None, TypeError, "tokens must be a 1-D tensor"),
        # float token ids (fixed values: a test id must be the same in every process)
        (torch.linspace(0, 1, 10), 2, None, TypeError, "tokens must be a 1-D tensor of token ids"),
        (torch.arange(0), 2, None, ValueError, "empty token sequence"),
    ],
    ids=str,
)
def test_token_windows(tokens, window, stride, error, message):
    with pytest.raises(error, match=message):
        TokenWindows(tokens, window, stride)


def test_token_windows_of_a_text_and_the_causal_lm_collator(word_tokenizer):
    with pytest.raises(TypeError, match="text must be a string"):
        token_windows(["a", "book"], word_tokenizer, 4)
    with pytest.raises(TypeError, match="tokenizer must be"):
        token_windows("a book", "gpt2", 4)
    with pytest.raises(ValueError, match="window must be"):
        token_windows("a book", word_tokenizer, -4)
    collate = CausalLMCollator(word_tokenizer)
    with pytest.raises(ValueError, match="items must be a non-empty list"):
        collate([])
    with pytest.raises(ValueError, match="items must be a non-empty list"):
        collate([torch.arange(3)])


def test_vocabulary_and_word_collator():
    vocabulary = WordVocabulary.build(["a good film", "a bad film"], vocab_size=5)
    cases = [
        (lambda: WordVocabulary.build("a good film", 5), TypeError, "texts must be an iterable"),
        (lambda: WordVocabulary.build(["a"], 2), ValueError, "vocab_size must be an int >= 3"),
        (lambda: WordVocabulary.build(["a"], 5.0), TypeError, "vocab_size must be an int"),
        (lambda: WordVocabulary("abc"), TypeError, "words must be a list of strings"),
        (lambda: WordVocabulary(["a", "a"]), ValueError, "words must be distinct"),
        (lambda: vocabulary.encode("a film", length=0), ValueError, "length must be an int >= 1"),
        (lambda: vocabulary.encode(["a", "film"]), TypeError, "text must be a string"),
        (lambda: split_words(None), TypeError, "text must be a string"),
        (lambda: WordCollator(["a", "film"]), TypeError, "vocabulary must be a WordVocabulary"),
        (lambda: WordCollator(vocabulary, length=-1), ValueError, "length must be an int >= 1"),
        (lambda: WordCollator(vocabulary)([]), ValueError, "records must be a non-empty list"),
        (lambda: WordCollator(vocabulary)([{"text": "a film"}]), ValueError, "have no 'label'"),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()
