import gzip
import json
from collections import Counter
from pathlib import Path

import pytest

from pyro_bdl.data import DATASETS, RecordDataset, load

# Row counts of shared/data/README.md.
README_COUNTS = [
    ("imdb", "train", 25_000),
    ("imdb", "test", 25_000),
    ("sst2", "train", 67_349),
    ("sst2", "test", 872),
    ("winogrande_xs", "train", 160),
    ("winogrande_s", "train", 640),
    ("winogrande_m", "train", 2_558),
    ("winogrande_m", "test", 1_267),
    ("arc_easy", "train", 2_251),
    ("arc_easy", "test", 2_376),
    ("arc_challenge", "train", 1_119),
    ("arc_challenge", "test", 1_172),
    ("obqa", "train", 4_957),
    ("obqa", "validation", 500),
    ("obqa", "test", 500),
    ("flores", "dev", 997),
    ("flores", "devtest", 1_012),
]


@pytest.mark.parametrize(("name", "split", "rows"), README_COUNTS)
def test_row_counts_match_the_readme(data_root, name, split, rows):
    records = load(name, data_root, split)
    assert isinstance(records, RecordDataset)
    assert len(records) == rows
    assert len(list(records)) == rows


@pytest.mark.parametrize("name", ["imdb", "sst2", "boolq"])
def test_binary_labels_take_both_values(data_root, name):
    labels = Counter(record["label"] for record in load(name, data_root, "test"))
    assert set(labels) == {0, 1}


def test_imdb_is_balanced_and_labelled_positive_as_one(data_root):
    train = load("imdb", data_root, "train")
    assert Counter(r["label"] for r in train) == {0: 12_500, 1: 12_500}
    # The first review of the CSV: "Story of a man who has unnatural feelings for a pig",
    # rated 3 / 10, so negative.
    assert train[0]["text"].startswith("Story of a man who has unnatural feelings for a pig.")
    assert train[0]["label"] == 0


@pytest.mark.parametrize(
    ("name", "choices"),
    [("winogrande_xs", {2}), ("winogrande_s", {2}), ("winogrande_m", {2}), ("obqa", {4})],
)
def test_multiple_choice_records(data_root, name, choices):
    for split in ("train", "test"):
        records = load(name, data_root, split)
        assert {len(r["choices"]) for r in records} == choices
        assert {r["label"] for r in records} == set(range(max(choices)))


@pytest.mark.parametrize(
    ("name", "split", "irregular"),
    # Laplace-LoRA, appendix D: ARC-C train has 1 three- and 1 five-choice question,
    # ARC-E train 6 and 4.
    [("arc_challenge", "train", {3: 1, 5: 1}), ("arc_easy", "train", {3: 6, 5: 4})],
)
def test_arc_choice_counts_and_num_choices_filter(data_root, name, split, irregular):
    records = load(name, data_root, split)
    counts = Counter(len(r["choices"]) for r in records)
    assert {k: v for k, v in counts.items() if k != 4} == irregular
    assert all(0 <= r["label"] < len(r["choices"]) for r in records)
    four = load(name, data_root, split, num_choices=4)
    assert len(four) == len(records) - sum(irregular.values())
    assert {len(r["choices"]) for r in four} == {4}


def test_arc_record_from_the_instruction_format(data_root):
    record = load("arc_easy", data_root, "train")[0]
    assert record == {
        "question": "Which factor will most likely cause a person to develop a fever?",
        "choices": [
            "a leg muscle relaxing after exercise",
            "a bacterial population in the bloodstream",
            "several viral particles on the skin",
            "carbohydrates being digested in the stomach",
        ],
        "label": 1,
    }


def test_obqa_record_from_the_tsv(data_root):
    record = load("obqa", data_root, "train")[0]
    assert record == {
        "question": "The sun is responsible for",
        "choices": [
            "puppies learning new tricks",
            "children growing up and getting old",
            "flowers wilting in a vase",
            "plants sprouting, blooming and wilting",
        ],
        "label": 3,
    }


def test_winogrande_sizes_share_the_dev_set_as_test(data_root):
    tests = [load(f"winogrande_{size}", data_root, "test") for size in ("xs", "s", "m")]
    assert list(tests[0]) == list(tests[1]) == list(tests[2])
    first = tests[0][0]
    assert first["sentence"].startswith("Sarah was a much better surgeon than Maria so _")
    assert first["choices"] == ["Sarah", "Maria"]
    assert first["label"] == 1  # answer "2" in dev.jsonl and dev-labels.lst


def test_winogrande_train_s_reads_the_answer_field(data_root):
    # train_s has no labels file: the answers come from the jsonl.
    assert not (data_root / "winogrande" / "train_s-labels.lst").exists()
    labels = Counter(r["label"] for r in load("winogrande_s", data_root, "train"))
    assert set(labels) == {0, 1}


def _boolq_keys(records):
    return Counter((r["question"], r["passage"], r["label"]) for r in records)


def test_boolq_split_is_seeded_and_disjoint(data_root):
    raw = [json.loads(line) for line in (data_root / "boolq" / "val.jsonl").open()]
    everything = Counter((r["question"], r["passage"], int(r["label"])) for r in raw)
    train, test = load("boolq", data_root, "train"), load("boolq", data_root, "test")
    assert len(train) + len(test) == len(raw) == 3_270
    assert len(test) == round(0.2 * 3_270)
    assert _boolq_keys(train) + _boolq_keys(test) == everything
    assert not set(_boolq_keys(train)) & set(_boolq_keys(test))
    assert list(load("boolq", data_root, "test")) == list(test)
    assert list(load("boolq", data_root, "test", seed=1)) != list(test)
    assert len(load("boolq", data_root, "test", test_fraction=0.5)) == 1_635


def test_boolq_uses_an_official_train_file_when_present(tmp_path):
    row = {"question": "is it", "passage": "It is.", "idx": 0}
    (tmp_path / "train.jsonl").write_text(json.dumps({**row, "label": True}) + "\n")
    (tmp_path / "val.jsonl").write_text(json.dumps({**row, "label": False}) + "\n" * 2)
    assert [r["label"] for r in load("boolq", tmp_path, "train")] == [1]
    assert [r["label"] for r in load("boolq", tmp_path, "test")] == [0]


def test_limit_is_a_seeded_subset(data_root):
    full = load("sst2", data_root, "test")
    subset = load("sst2", data_root, "test", limit=100, seed=3)
    assert len(subset) == 100
    assert list(load("sst2", data_root, "test", limit=100, seed=3)) == list(subset)
    assert list(load("sst2", data_root, "test", limit=100, seed=4)) != list(subset)
    assert all(record in list(full) for record in subset)
    assert len(load("sst2", data_root, "test", limit=10_000)) == len(full)


def test_books_keep_the_last_fifteen_percent_for_test(data_root):
    train = load("books", data_root, "train")
    test = load("books", data_root, "test")
    assert [r["book"] for r in train] == ["98", "345", "1342", "1400", "2701"]
    for part, held in zip(train, test, strict=True):
        fraction = len(held["text"]) / (len(part["text"]) + len(held["text"]))
        assert fraction == pytest.approx(0.15, abs=1e-3)
        assert "PROJECT GUTENBERG" not in part["text"] + held["text"]
    pride = load("books", data_root, "train", book="1342")
    assert len(pride) == 1
    assert pride[0]["text"].startswith("PRIDE AND PREJUDICE\n\nBy Jane Austen")
    ending = load("books", data_root, "test", book=1342)[0]["text"]
    assert ending.endswith("had been the means of uniting them.")
    order = load("books", data_root, "test", book=["2701", "98"])
    assert [r["book"] for r in order] == ["2701", "98"]


def test_flores_languages_are_line_aligned(data_root):
    english = load("flores", data_root, "devtest")
    samoan = load("flores", data_root, "devtest", language="smo_Latn")
    assert len(english) == len(samoan) == 1_012
    assert [r["id"] for r in english] == [r["id"] for r in samoan] == list(range(1_012))
    assert samoan[0]["text"] != english[0]["text"]
    assert english[0]["text"].startswith('"We now have 4-month-old mice')


def test_data_dir_may_be_the_dataset_folder_itself(data_root):
    assert len(load("sst2", data_root / "sst2", "test")) == 872


# --- the original formats, on tiny synthetic files --------------------------------------


def test_aclimdb_tree(tmp_path):
    reviews = {("train", "pos", "0_9.txt"): "Great<br />film", ("train", "neg", "1_2.txt"): "Dull"}
    reviews[("train", "neg", "0_3.txt")] = "Bad"
    for parts, text in reviews.items():
        (tmp_path / "aclImdb" / parts[0] / parts[1]).mkdir(parents=True, exist_ok=True)
        (tmp_path / "aclImdb").joinpath(*parts).write_text(text)
    (tmp_path / "aclImdb" / "train" / "unsup").mkdir()
    records = load("imdb", tmp_path, "train")
    assert list(records) == [
        {"text": "Bad", "label": 0},
        {"text": "Dull", "label": 0},
        {"text": "Great<br />film", "label": 1},
    ]


def test_imdb_csv_with_quoted_multiline_reviews(tmp_path):
    text = 'id,label,rating,text\n0,1,8,"Fine, ""really""\nfine"\n1,0,2,Poor\n'
    with gzip.open(tmp_path / "test.csv.gz", "wt") as handle:
        handle.write(text)
    assert list(load("imdb", tmp_path, "test")) == [
        {"text": 'Fine, "really"\nfine', "label": 1},
        {"text": "Poor", "label": 0},
    ]


def _ai2(stem, labels, texts, key):
    choices = [{"text": t, "label": label} for t, label in zip(texts, labels, strict=True)]
    return json.dumps({"id": "q", "question": {"stem": stem, "choices": choices}, "answerKey": key})


def test_arc_ai2_jsonl_with_letter_and_digit_keys(tmp_path):
    folder = tmp_path / "ARC-Challenge"
    folder.mkdir()
    lines = [
        _ai2("Which is a gas?", "ABCD", ["ice", "steam", "rock", "wood"], "B"),
        _ai2("Pick three.", "123", ["one", "two", "three"], "3"),
    ]
    (folder / "ARC-Challenge-Dev.jsonl").write_text("\n".join(lines) + "\n")
    records = load("arc_challenge", tmp_path, "validation")
    assert list(records) == [
        {"question": "Which is a gas?", "choices": ["ice", "steam", "rock", "wood"], "label": 1},
        {"question": "Pick three.", "choices": ["one", "two", "three"], "label": 2},
    ]


def test_obqa_ai2_jsonl(tmp_path):
    line = _ai2("The sun is", "ABCD", ["cold", "hot", "wet", "blue"], "B")
    (tmp_path / "dev.jsonl").write_text(line + "\n")
    [record] = load("obqa", tmp_path, "validation")
    assert record == {
        "question": "The sun is",
        "choices": ["cold", "hot", "wet", "blue"],
        "label": 1,
    }


def _winogrande_row(answer=None):
    row = {"qID": "x", "sentence": "Ann beat Bo so _ won.", "option1": "Ann", "option2": "Bo"}
    return json.dumps(row if answer is None else {**row, "answer": answer})


def test_winogrande_labels_file_supplies_missing_answers(tmp_path):
    (tmp_path / "train_xs.jsonl").write_text(_winogrande_row() + "\n" + _winogrande_row() + "\n")
    (tmp_path / "train_xs-labels.lst").write_text("1\n2\n")
    assert [r["label"] for r in load("winogrande_xs", tmp_path, "train")] == [0, 1]


def test_winogrande_labels_file_must_agree_with_answers(tmp_path):
    (tmp_path / "dev.jsonl").write_text(_winogrande_row("1") + "\n")
    (tmp_path / "dev-labels.lst").write_text("2\n")
    with pytest.raises(ValueError, match=r"dev\.jsonl line 1: answer '1' disagrees .*dev-labels"):
        load("winogrande_m", tmp_path, "test")


def test_winogrande_labels_file_must_have_one_label_per_record(tmp_path):
    (tmp_path / "dev.jsonl").write_text(_winogrande_row("1") + "\n")
    (tmp_path / "dev-labels.lst").write_text("1\n2\n")
    with pytest.raises(ValueError, match=r"dev-labels\.lst: expected 1 labels.*found 2"):
        load("winogrande_m", tmp_path, "test")


def test_flores_original_layout(tmp_path):
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "smo_Latn.dev").write_text("Talofa\u2028lava.\nFa'afetai.\n")
    records = load("flores", tmp_path, "dev", language="smo_Latn")
    assert list(records) == [
        {"id": 0, "text": "Talofa\u2028lava."},
        {"id": 1, "text": "Fa'afetai."},
    ]


# --- errors --------------------------------------------------------------------------


def test_missing_file_names_what_was_expected_and_found(tmp_path):
    (tmp_path / "sst2").mkdir()
    (tmp_path / "sst2" / "dev.tsv").write_text("sentence\tlabel\n")
    (tmp_path / "sst2" / "README").write_text("")
    with pytest.raises(FileNotFoundError) as error:
        load("sst2", tmp_path, "train")
    message = str(error.value)
    assert message.startswith(f"sst2: expected train.tsv in {tmp_path / 'sst2'}")
    assert "sentence<TAB>label" in message
    assert message.endswith("found: README, dev.tsv")


def test_missing_arc_validation_lists_the_candidates(data_root):
    with pytest.raises(FileNotFoundError, match="ARC-Easy-Dev.jsonl") as error:
        load("arc_easy", data_root, "validation")
    assert "ARC-Easy_train.json" in str(error.value)  # the listing of what is there


def test_missing_data_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere is not a directory"):
        load("imdb", tmp_path / "nowhere", "train")


def test_malformed_tsv_line_names_file_and_line(tmp_path):
    (tmp_path / "train.tsv").write_text("sentence\tlabel\ngood\t1\nno label here\n")
    with pytest.raises(ValueError) as error:
        load("sst2", tmp_path, "train")
    assert str(error.value) == (
        f"{tmp_path / 'train.tsv'} line 3: expected 2 tab-separated fields "
        "(sentence, label), found 1"
    )


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("sentence\tlabel\ngood\t7\n", r"train\.tsv line 2: expected label 0 or 1, found '7'"),
        ("text\tlabel\ngood\t1\n", r"train\.tsv line 1: expected the header 'sentence\\tlabel'"),
    ],
)
def test_bad_tsv_values_name_file_and_line(tmp_path, content, message):
    (tmp_path / "train.tsv").write_text(content)
    with pytest.raises(ValueError, match=message):
        load("sst2", tmp_path, "train")


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", r"val\.jsonl line 2: expected a JSON object"),
        ('{"question": "q", "label": true}', r"val\.jsonl line 2: expected field 'passage'"),
        ('{"question": "q", "passage": "p", "label": 1}', r"line 2: expected label False or True"),
    ],
)
def test_malformed_jsonl_line_names_file_and_line(tmp_path, line, message):
    good = json.dumps({"question": "q", "passage": "p", "label": True})
    (tmp_path / "val.jsonl").write_text(f"{good}\n{line}\n")
    with pytest.raises(ValueError, match=message):
        load("boolq", tmp_path, "test")


def test_malformed_instruction_and_choices(tmp_path):
    bad = {"instruction": "Choose: which?", "input": "", "output": "", "answer": "answer1"}
    (tmp_path / "ARC-Easy_test.json").write_text(json.dumps([bad]))
    with pytest.raises(ValueError, match=r"ARC-Easy_test\.json item 1: expected an instruction"):
        load("arc_easy", tmp_path, "test")
    columns = "ID\tQuestion Stem\tChoices\tComplete Question\tAnswer Key"
    (tmp_path / "test.tsv").write_text(f"{columns}\n1\tq\tA) x B) y\tq\tA\n")
    with pytest.raises(ValueError, match=r"test\.tsv line 2: expected choices starting with"):
        load("obqa", tmp_path, "test")


def test_unknown_book_lists_the_available_ones(data_root):
    with pytest.raises(ValueError, match="no book 11 in .*available: 98, 345, 1342, 1400, 2701"):
        load("books", data_root, "train", book="11")


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (dict(name="mnist", split="train"), "name must be one of 'imdb', 'sst2'.*got 'mnist'"),
        (dict(name="sst2", split="validation"), "sst2 has no split 'validation'; valid splits: "),
        (dict(name="flores", split="train"), "valid splits: dev, devtest"),
        (dict(name="sst2", split="train", language="x"), "unknown option.*accepts no dataset"),
        (dict(name="books", split="train", langage="x"), "langage; it accepts book, test_frac"),
        (dict(name="sst2", split="train", num_choices=4), "multiple-choice datasets only"),
        (
            dict(name="boolq", split="train", test_fraction=1.5),
            r"test_fraction must be a number in \(0, 1\)",
        ),
    ],
)
def test_bad_arguments_say_what_is_valid(data_root, call, message):
    with pytest.raises(ValueError, match=message):
        load(data_dir=data_root, **call)


def test_every_name_is_loadable(data_root):
    split = {"flores": "dev"}
    for name in DATASETS:
        assert len(load(name, data_root, split.get(name, "test"), limit=3)) >= 1


def test_book_files_are_found_by_gutenberg_names(tmp_path):
    body = "*** START OF THE PROJECT GUTENBERG EBOOK X ***\nText of the book.\n*** END OF X ***\n"
    for name in ("pg12.txt", "7-0.txt", "notes.txt"):
        Path(tmp_path, name).write_text(body)
    assert [r["book"] for r in load("books", tmp_path, "train")] == ["7", "12"]
    Path(tmp_path, "12.txt").write_text(body)
    with pytest.raises(ValueError, match="book 12 has two files .*: 12.txt and pg12.txt; keep one"):
        load("books", tmp_path, "train")
