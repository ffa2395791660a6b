import json

import pytest
import torch

from pyro_bdl.data import WordCollator, WordVocabulary, load, split_words


@pytest.fixture(scope="module")
def imdb_vocabulary(data_root):
    return WordVocabulary.build((r["text"] for r in load("imdb", data_root, "train")), 20_000)


def test_split_words_lowercases_and_drops_html_breaks():
    assert split_words("Don't watch it.<br /><br />BAD film!<BR>2 stars") == [
        "don't",
        "watch",
        "it",
        "bad",
        "film",
        "2",
        "stars",
    ]


def test_build_ranks_by_frequency_then_alphabet():
    vocab = WordVocabulary.build(["b a c", "c b", "c d"], vocab_size=5)
    assert vocab.words == ["c", "b", "a"]
    assert len(vocab) == 5
    assert vocab.index == {"c": 2, "b": 3, "a": 4}


def test_encode_keeps_the_last_words_and_pads_in_front():
    vocab = WordVocabulary(["one", "two", "three"])
    assert vocab.encode("one two", length=4) == [0, 0, 2, 3]
    assert vocab.encode("one two three one unknown", length=3) == [4, 2, 1]
    assert vocab.encode("", length=2) == [0, 0]


def test_vocab_size_must_exceed_the_reserved_indices():
    with pytest.raises(ValueError, match="vocab_size must be an int >= 3, got 2"):
        WordVocabulary.build(["a"], vocab_size=2)


def test_save_and_load_round_trip(tmp_path):
    vocab = WordVocabulary.build(["the cat sat", "the dog"], vocab_size=4)
    vocab.save(tmp_path / "vocab.json")
    again = WordVocabulary.load(tmp_path / "vocab.json")
    assert again.words == vocab.words == ["the", "cat"]
    assert again.encode("the dog sat") == vocab.encode("the dog sat")
    (tmp_path / "bad.json").write_text(json.dumps(["the", "cat"]))
    with pytest.raises(ValueError, match=r"bad\.json: expected a JSON object"):
        WordVocabulary.load(tmp_path / "bad.json")


def test_imdb_vocabulary_and_batches(data_root, imdb_vocabulary):
    assert len(imdb_vocabulary) == 20_000
    assert imdb_vocabulary.words[:3] == ["the", "and", "a"]
    assert "br" not in imdb_vocabulary.index  # <br /> is markup, not a word
    test = load("imdb", data_root, "test")
    records = [test[i] for i in range(8)]
    batch = WordCollator(imdb_vocabulary)(records)
    assert set(batch) == {"input_ids", "labels"}
    assert batch["input_ids"].shape == (8, 100) and batch["input_ids"].dtype == torch.long
    assert batch["labels"].tolist() == [r["label"] for r in records]
    assert 0 <= batch["input_ids"].min() and batch["input_ids"].max() < 20_000
    # The review's last word is the batch row's last index.
    last_word = split_words(records[0]["text"])[-1]
    assert batch["input_ids"][0, -1] == imdb_vocabulary.index.get(last_word, 1)
