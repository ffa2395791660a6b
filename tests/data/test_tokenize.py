import pytest
import torch

from pyro_bdl.data import (
    CausalChoiceTextCollator,
    CausalLMCollator,
    CausalMultipleChoiceCollator,
    ClassificationCollator,
    MultipleChoiceCollator,
    TokenWindows,
    answer_token_ids,
    choice_pairs,
    format_prompt,
    load,
    make_loader,
    token_windows,
)


def _records(data_root, name, split, n):
    data = load(name, data_root, split)
    return [data[i] for i in range(n)]


def _assert_right_padded(mask):
    # Every row is ones then zeros, and the longest row has no padding.
    lengths = mask.sum(dim=1)
    expected = torch.arange(mask.shape[1]) < lengths[:, None]
    assert torch.equal(mask.bool(), expected)
    assert lengths.max() == mask.shape[1]


def test_classification_batch(data_root, minilm_tokenizer):
    records = _records(data_root, "sst2", "test", 5)
    batch = ClassificationCollator(minilm_tokenizer, max_length=128)(records)
    assert set(batch) == {"input_ids", "attention_mask", "token_type_ids", "labels"}
    assert all(tensor.dtype == torch.long for tensor in batch.values())
    assert (
        batch["input_ids"].shape
        == batch["attention_mask"].shape
        == (5, batch["input_ids"].shape[1])
    )
    assert batch["labels"].tolist() == [r["label"] for r in records]
    _assert_right_padded(batch["attention_mask"])
    pad = minilm_tokenizer.pad_token_id
    assert torch.equal(batch["input_ids"] == pad, batch["attention_mask"] == 0)
    assert torch.all(batch["input_ids"][:, 0] == minilm_tokenizer.cls_token_id)


def test_classification_truncates_long_reviews(data_root, minilm_tokenizer):
    records = _records(data_root, "imdb", "train", 4)
    batch = ClassificationCollator(minilm_tokenizer, max_length=64)(records)
    assert batch["input_ids"].shape == (4, 64)
    assert torch.all(batch["input_ids"][:, -1] == minilm_tokenizer.sep_token_id)


def test_boolq_is_a_text_pair(data_root, minilm_tokenizer):
    records = _records(data_root, "boolq", "test", 3)
    collate = ClassificationCollator(minilm_tokenizer, 96, text_fields=("question", "passage"))
    batch = collate(records)
    assert batch["input_ids"].shape == (3, 96)
    # The passage is the second segment.
    assert batch["token_type_ids"].max() == 1 and batch["token_type_ids"][:, 0].max() == 0
    with pytest.raises(
        ValueError, match=r"no field text .*text_fields=.*\('question', 'passage'\) for BoolQ"
    ):
        ClassificationCollator(minilm_tokenizer)(records)


def test_encoder_multiple_choice_batch(data_root, minilm_tokenizer):
    records = _records(data_root, "obqa", "test", 3)
    batch = MultipleChoiceCollator(minilm_tokenizer, "obqa", max_length=64)(records)
    assert set(batch) == {"input_ids", "attention_mask", "token_type_ids", "labels"}
    length = batch["input_ids"].shape[2]
    assert batch["input_ids"].shape == batch["token_type_ids"].shape == (3, 4, length)
    assert batch["labels"].tolist() == [r["label"] for r in records]
    # Row (record 1, choice 2) is the pair (question, choice 2) of record 1.
    ids = batch["input_ids"][1, 2][batch["attention_mask"][1, 2].bool()].tolist()
    question, choice = records[1]["question"], records[1]["choices"][2]
    assert ids == minilm_tokenizer(question, choice)["input_ids"]


def test_encoder_multiple_choice_refuses_mixed_choice_counts(data_root, minilm_tokenizer):
    records = load("arc_easy", data_root, "train")
    mixed = [records[0], next(r for r in records if len(r["choices"]) == 5)]
    with pytest.raises(ValueError, match=r"mixes records with \[4, 5\] choices.*num_choices"):
        MultipleChoiceCollator(minilm_tokenizer, "arc_easy")(mixed)
    batch = MultipleChoiceCollator(minilm_tokenizer, "winogrande_m")(
        _records(data_root, "winogrande_m", "train", 2)
    )
    assert batch["input_ids"].shape[:2] == (2, 2)


@pytest.mark.parametrize(("name", "last"), [("arc_challenge", ":"), ("boolq", ".")])
def test_causal_batch_is_left_padded_and_ends_with_the_prompt(
    data_root, word_tokenizer, name, last
):
    records = _records(data_root, name, "test", 4)
    batch = CausalMultipleChoiceCollator(word_tokenizer, name, max_length=4096)(records)
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    assert all(tensor.dtype == torch.long for tensor in batch.values())
    mask = batch["attention_mask"]
    _assert_right_padded(mask.flip(1))
    # The tokenizer's trailing [EOS] is dropped, its leading [BOS] kept.
    assert torch.all(batch["input_ids"][:, -1] == word_tokenizer.convert_tokens_to_ids(last))
    starts = mask.shape[1] - mask.sum(1)
    assert torch.all(batch["input_ids"][torch.arange(4), starts] == word_tokenizer.bos_token_id)
    # No pad token: padding uses [EOS], masked out.
    assert torch.all(batch["input_ids"][mask == 0] == word_tokenizer.eos_token_id)
    first = word_tokenizer(format_prompt(records[0], name))["input_ids"][:-1]
    assert batch["input_ids"][0][mask[0].bool()].tolist() == first
    assert batch["labels"].tolist() == [r["label"] for r in records]


def test_causal_batch_keeps_the_end_of_long_prompts(data_root, word_tokenizer, minilm_tokenizer):
    records = _records(data_root, "obqa", "test", 2)
    batch = CausalMultipleChoiceCollator(word_tokenizer, "obqa", max_length=8)(records)
    assert batch["input_ids"].shape == (2, 8)
    answer = word_tokenizer.convert_tokens_to_ids(["Answer", ":"])
    assert batch["input_ids"][:, -2:].tolist() == [answer, answer]
    # A BERT tokenizer appends [SEP]; the prompt's own last token must still come last.
    bert = CausalMultipleChoiceCollator(minilm_tokenizer, "obqa", max_length=16)(records)
    assert bert["input_ids"].shape == (2, 16)
    assert torch.all(bert["input_ids"][:, -1] == minilm_tokenizer.convert_tokens_to_ids(":"))


def test_causal_batch_takes_a_template_of_ones_own(data_root, minilm_tokenizer):
    # A format string (with {choices}, the lettered list), a function, and a dataset without
    # a template of the papers' (SST-2) all give the prompt a reader would write by hand.
    obqa = _records(data_root, "obqa", "test", 2)
    template = "Q: {question}\n{choices}\nAnswer:"
    batch = CausalMultipleChoiceCollator(minilm_tokenizer, "obqa", template=template)(obqa)
    letters = " ".join(f"{'ABCD'[i]}. {c.rstrip('.')}." for i, c in enumerate(obqa[0]["choices"]))
    by_hand = minilm_tokenizer(f"Q: {obqa[0]['question']}\n{letters}\nAnswer:")["input_ids"][:-1]
    assert batch["input_ids"][0][batch["attention_mask"][0].bool()].tolist() == by_hand
    sst2 = _records(data_root, "sst2", "test", 3)
    for prompt in ("Review: {text} Sentiment:", lambda r: f"Review: {r['text']} Sentiment:"):
        batch = CausalMultipleChoiceCollator(minilm_tokenizer, "sst2", template=prompt)(sst2)
        expected = minilm_tokenizer(f"Review: {sst2[2]['text']} Sentiment:")["input_ids"][:-1]
        assert batch["input_ids"][2][batch["attention_mask"][2].bool()].tolist() == expected
        assert batch["labels"].tolist() == [r["label"] for r in sst2]


def test_a_template_naming_a_missing_field_says_which(data_root, minilm_tokenizer):
    collate = CausalMultipleChoiceCollator(minilm_tokenizer, "sst2", template="{sentence}:")
    with pytest.raises(ValueError, match="'sentence'.*fields: text, label"):
        collate(_records(data_root, "sst2", "test", 1))


def test_answer_token_ids(word_tokenizer, minilm_tokenizer):
    ids = answer_token_ids(word_tokenizer, [" A", " B", " C", " D"])
    assert word_tokenizer.convert_ids_to_tokens(ids) == ["A", "B", "C", "D"]
    assert word_tokenizer.convert_ids_to_tokens(
        answer_token_ids(word_tokenizer, [" False", " True"])
    ) == [
        "False",
        "True",
    ]
    assert minilm_tokenizer.convert_ids_to_tokens(answer_token_ids(minilm_tokenizer, [" A"])) == [
        "a"
    ]


@pytest.mark.parametrize(
    ("labels", "message"),
    [
        (
            [" A", " antidisestablishmentarianism"],
            r"' antidisestablishmentarianism' must be a single token.* 8 tokens",
        ),
        ([" A B"], r"' A B' must be a single token .* 2 tokens"),
    ],
)
def test_answer_token_ids_refuses_multi_token_labels(minilm_tokenizer, labels, message):
    with pytest.raises(ValueError, match=message):
        answer_token_ids(minilm_tokenizer, labels)


def test_answer_token_ids_refuses_unknown_labels(word_tokenizer):
    with pytest.raises(ValueError, match="' Maybe' is the unknown token"):
        answer_token_ids(word_tokenizer, [" True", " Maybe"])


def test_token_windows_cover_a_book(data_root, minilm_tokenizer):
    text = load("books", data_root, "test", book="1342")[0]["text"][:20_000]
    ids = minilm_tokenizer(text, add_special_tokens=False)["input_ids"]
    windows = token_windows(text, minilm_tokenizer, window=256)
    assert len(windows) == -(-len(ids) // 256)
    assert torch.cat([w["input_ids"] for w in windows]).tolist() == ids
    assert {len(windows[i]["input_ids"]) for i in range(len(windows) - 1)} == {256}
    overlapping = token_windows(text, minilm_tokenizer, window=256, stride=128)
    for before, after in zip(overlapping, list(overlapping)[1:]):
        assert torch.equal(before["input_ids"][128:], after["input_ids"][:128])
    assert overlapping[len(overlapping) - 1]["input_ids"][-1].item() == ids[-1]
    assert overlapping[len(overlapping) - 2]["input_ids"][-1].item() != ids[-1]


@pytest.mark.parametrize(
    ("length", "window", "stride", "starts"),
    [(10, 4, None, [0, 4, 8]), (8, 4, None, [0, 4]), (10, 4, 2, [0, 2, 4, 6]), (3, 4, 1, [0])],
)
def test_window_starts(length, window, stride, starts):
    windows = TokenWindows(torch.arange(length), window, stride)
    assert [w["input_ids"][0].item() for w in windows] == starts
    assert windows[len(windows) - 1]["input_ids"][-1].item() == length - 1


@pytest.mark.parametrize(("window", "stride"), [(0, None), (4, 5), (4, 0)])
def test_window_arguments_are_checked(window, stride):
    with pytest.raises(ValueError, match=r"(window|stride) must be an int"):
        TokenWindows(torch.arange(10), window, stride)


def test_causal_lm_batch_from_windows(word_tokenizer):
    windows = TokenWindows(torch.arange(3, 13), window=4)
    loader = make_loader(windows, CausalLMCollator(word_tokenizer), batch_size=3)
    [batch] = list(loader)
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    assert batch["input_ids"].shape == batch["labels"].shape == (3, 4)
    assert batch["input_ids"].tolist() == [[3, 4, 5, 6], [7, 8, 9, 10], [11, 12, 2, 2]]
    assert batch["attention_mask"].tolist()[2] == [1, 1, 0, 0]
    assert batch["labels"].tolist()[2] == [11, 12, -100, -100]
    assert torch.equal(batch["labels"][:2], batch["input_ids"][:2])


@pytest.mark.parametrize("name", ["arc_easy", "winogrande_s"])
def test_choice_text_batch_marks_each_choice_at_the_end_of_its_sequence(
    data_root, minilm_tokenizer, name
):
    options = {"num_choices": 4} if name == "arc_easy" else {}
    records = list(load(name, data_root, "train", limit=3, **options))
    batch = CausalChoiceTextCollator(minilm_tokenizer, name, max_length=96)(records)
    count = len(records[0]["choices"])
    assert batch["input_ids"].shape[:2] == (3, count) and batch["labels"].tolist() == [
        r["label"] for r in records
    ]
    assert batch["choice_tokens"].shape == batch["attention_mask"].shape
    for b, record in enumerate(records):
        for c, (_, choice) in enumerate(choice_pairs(record, name)):  # WinoGrande: + the rest
            scored = batch["choice_tokens"][b, c] != -100
            text = minilm_tokenizer.decode(batch["choice_tokens"][b, c, scored])
            assert text == minilm_tokenizer.decode(
                minilm_tokenizer(" " + choice)["input_ids"][1:-1]
            )
            # left-padded: the choice's tokens are the last, after a real prompt
            assert scored[-int(scored.sum()) :].all() and batch["attention_mask"][b, c, -1] == 1
            first = int(torch.nonzero(batch["attention_mask"][b, c])[0])
            prompt = minilm_tokenizer.decode(batch["input_ids"][b, c, first:][~scored[first:]])
            if name == "arc_easy":
                assert prompt.startswith("[CLS] question :") and prompt.endswith("answer :")


def test_choice_text_batch_cuts_the_prompt_first_and_refuses_ragged_choices(
    data_root, minilm_tokenizer
):
    records = list(load("arc_easy", data_root, "train", limit=2, num_choices=4))
    batch = CausalChoiceTextCollator(minilm_tokenizer, "arc_easy", max_length=6)(records)
    assert batch["input_ids"].shape[-1] == 6
    assert (batch["choice_tokens"] != -100).sum(-1).max() <= 5  # one prompt token kept
    mixed = list(load("arc_easy", data_root, "train", limit=400))
    three = next(r for r in mixed if len(r["choices"]) == 3)
    four = next(r for r in mixed if len(r["choices"]) == 4)
    with pytest.raises(ValueError, match="different numbers of choices"):
        CausalChoiceTextCollator(minilm_tokenizer, "arc_easy")([three, four])
    with pytest.raises(ValueError, match="dataset_name"):
        CausalChoiceTextCollator(minilm_tokenizer, "sst2")
