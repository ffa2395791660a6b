"""
:func:`load`: one entry point for the datasets of the papers' experiments.

Every loader reads the standard public file formats from any directory and returns a
:class:`~pyro_bdl.data.records.RecordDataset` of plain records. Splits that the data
does not provide (BoolQ, the books) are cut deterministically from a seed or a fraction.
"""

from __future__ import annotations

import os
import random
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from pyro_bdl._checks import instance, integer, one_of, probability
from pyro_bdl.data.readers import (
    Row,
    find_file,
    iter_csv,
    iter_json_list,
    iter_jsonl,
    iter_tsv,
    missing,
    parse_rows,
    read_gutenberg,
    read_lines,
    require_file,
)
from pyro_bdl.data.records import Record, RecordDataset

_BINARY = {"0": 0, "1": 1}


def _label(value: Any, labels: Mapping[str, int], field: str = "label") -> int:
    """The integer label of a raw ``value`` (compared as text) under ``labels``."""
    key = str(value).strip()
    if key not in labels:
        raise ValueError(f"expected {field} {' or '.join(labels)}, found {value!r}")
    return labels[key]


def _check_fraction(test_fraction: float) -> None:
    probability("test_fraction", test_fraction, open_low=True, open_high=True)


def _text_record(row: dict, field: str) -> Record:
    """A binary text classification record from the text ``field`` and ``label``."""
    return {"text": row[field], "label": _label(row["label"], _BINARY)}


# --- IMDB ---------------------------------------------------------------------------


def _read_imdb(directory: Path, split: str) -> list[Record]:
    table = find_file(directory, [f"{split}.csv", f"{split}.csv.gz"])
    if table is not None:
        rows = iter_csv(table, ("label", "text"))
        return parse_rows(table, rows, partial(_text_record, field="text"))
    for root in (directory / "aclImdb", directory):
        if (root / split).is_dir():
            return _read_aclimdb(root / split)
    raise missing(
        "imdb",
        directory,
        f"{split}.csv, {split}.csv.gz or aclImdb/{split}/{{neg,pos}}/*.txt",
        "IMDB reviews as CSV 'id,label,rating,text' or the original aclImdb tree",
    )


def _read_aclimdb(folder: Path) -> list[Record]:
    """The original Maas et al. tree: one ``<id>_<rating>.txt`` file per review."""
    records = []
    for label, polarity in enumerate(("neg", "pos")):
        if not (folder / polarity).is_dir():
            raise missing("imdb", folder, f"{polarity}/", "aclImdb reviews, one .txt per review")
        for path in sorted((folder / polarity).glob("*.txt")):
            records.append({"text": path.read_text(encoding="utf-8"), "label": label})
    return records


# --- SST-2 --------------------------------------------------------------------------


def _read_sst2(directory: Path, split: str) -> list[Record]:
    # GLUE's SST-2 test file has no labels, so the labelled dev file is the test split.
    name = {"train": "train.tsv", "test": "dev.tsv"}[split]
    path = require_file("sst2", directory, [name], "GLUE SST-2 'sentence<TAB>label'")
    rows = iter_tsv(path, ("sentence", "label"))
    return parse_rows(path, rows, partial(_text_record, field="sentence"))


# --- WinoGrande ---------------------------------------------------------------------


def _read_winogrande(dataset: str, train_file: str, directory: Path, split: str) -> list[Record]:
    # WinoGrande's test labels are hidden, so the dev file is the test split.
    stem = train_file if split == "train" else "dev"
    path = require_file(
        dataset,
        directory,
        [f"{stem}.jsonl"],
        "WinoGrande jsonl with sentence, option1, option2 and answer or a -labels.lst",
    )
    rows = list(iter_jsonl(path))
    labels = directory / f"{stem}-labels.lst"
    if labels.is_file():
        rows = _attach_answers(path, rows, labels)
    return parse_rows(path, rows, _winogrande_record)


def _attach_answers(path: Path, rows: list[Row], labels: Path) -> list[Row]:
    """Put the answers of a ``*-labels.lst`` file (one per line) into the jsonl rows."""
    answers = [line.strip() for line in read_lines(labels)]
    if len(answers) != len(rows):
        raise ValueError(
            f"{labels}: expected {len(rows)} labels, one per record of {path.name}, "
            f"found {len(answers)}"
        )
    attached = []
    for (where, row), answer in zip(rows, answers, strict=True):
        if row.get("answer", "") not in ("", answer):
            raise ValueError(
                f"{path} {where}: answer {row['answer']!r} disagrees with {answer!r} in {labels}"
            )
        attached.append((where, {**row, "answer": answer}))
    return attached


def _winogrande_record(row: dict) -> Record:
    if "_" not in row["sentence"]:
        raise ValueError(f"expected a sentence with a '_' blank, found {row['sentence']!r}")
    return {
        "sentence": row["sentence"],
        "choices": [row["option1"], row["option2"]],
        "label": _label(row["answer"], {"1": 0, "2": 1}, "answer"),
    }


# --- Multiple-choice QA: ARC and OpenBookQA -----------------------------------------

_INSTRUCTION = "Please choose the correct answer to the question: "
_ANSWER_FORMAT = "Answer format: "
_OBQA_COLUMNS = ("ID", "Question Stem", "Choices", "Complete Question", "Answer Key")


def _letter(index: int) -> str:
    return chr(ord("A") + index)


def _enumerated(text: str, marker: Callable[[int], str]) -> list[str]:
    """
    Split ``"M0 text M1 text ..."`` into the texts, where ``marker(i)`` is the i-th
    marker (``"(A) "``, ``"Answer1: "``); markers are looked for in order, so a marker
    repeated inside a choice stays part of that choice.
    """
    if not text.startswith(marker(0)):
        raise ValueError(f"expected choices starting with {marker(0)!r}, found {text[:80]!r}")
    starts = [0]
    while (found := text.find(" " + marker(len(starts)), starts[-1])) != -1:
        starts.append(found + 1)
    ends = [start - 1 for start in starts[1:]] + [len(text)]
    return [
        text[start + len(marker(i)) : end].strip()
        for i, (start, end) in enumerate(zip(starts, ends, strict=True))
    ]


def _instruction_record(row: dict) -> Record:
    """LLM-Adapters' instruction format: the choices are spelled out in the prompt."""
    parts = row["instruction"].split("\n\n")
    if len(parts) != 3 or not parts[0].startswith(_INSTRUCTION):
        raise ValueError(
            f"expected an instruction '{_INSTRUCTION}<question>\\n\\nAnswer1: .. AnswerK: ..\\n\\n"
            f"{_ANSWER_FORMAT}answer1/../answerK', found {row['instruction'][:80]!r}"
        )
    choices = _enumerated(parts[1], lambda i: f"Answer{i + 1}: ")
    listed = parts[2].removeprefix(_ANSWER_FORMAT).split("/")
    if len(listed) != len(choices):
        raise ValueError(f"expected {len(listed)} choices ({parts[2]!r}), found {len(choices)}")
    return {
        "question": parts[0].removeprefix(_INSTRUCTION),
        "choices": choices,
        "label": _label(row["answer"], {name: i for i, name in enumerate(listed)}, "answer"),
    }


def _ai2_record(row: dict) -> Record:
    """AI2's ARC / OpenBookQA jsonl; ``answerKey`` is a choice label ("A".."E" or "1".."5")."""
    question = row["question"]
    if not isinstance(question, dict):
        raise ValueError(
            "expected 'question' to be an object with 'stem' and 'choices' (AI2 format), "
            f"found {type(question).__name__}"
        )
    choices = question["choices"]
    keys = {str(choice["label"]): i for i, choice in enumerate(choices)}
    return {
        "question": question["stem"],
        "choices": [choice["text"] for choice in choices],
        "label": _label(row["answerKey"], keys, "answerKey"),
    }


def _obqa_tsv_record(row: dict) -> Record:
    choices = _enumerated(row["Choices"], lambda i: f"({_letter(i)}) ")
    keys = {_letter(i): i for i in range(len(choices))}
    return {
        "question": row["Question Stem"],
        "choices": choices,
        "label": _label(row["Answer Key"], keys, "Answer Key"),
    }


def _read_choice_file(path: Path) -> list[Record]:
    """One reader for ARC and OpenBookQA, dispatching on the file's format."""
    if path.suffix == ".json":
        return parse_rows(path, iter_json_list(path), _instruction_record)
    if path.suffix == ".jsonl":
        return parse_rows(path, iter_jsonl(path), _ai2_record)
    return parse_rows(path, iter_tsv(path, _OBQA_COLUMNS), _obqa_tsv_record)


def _read_arc(dataset: str, prefix: str, directory: Path, split: str) -> list[Record]:
    official = {"train": "Train", "validation": "Dev", "test": "Test"}[split]
    names = [
        f"{prefix}_{split}.json",
        f"{prefix}-{official}.jsonl",
        f"{prefix}/{prefix}-{official}.jsonl",
    ]
    what = "ARC as instruction JSON (Answer1..AnswerK) or AI2 jsonl"
    return _read_choice_file(require_file(dataset, directory, names, what))


def _read_obqa(directory: Path, split: str) -> list[Record]:
    stem = {"train": "train", "validation": "dev", "test": "test"}[split]
    what = "OpenBookQA as TSV with '(A) .. (D)' choices and 'Answer Key', or AI2 jsonl"
    return _read_choice_file(
        require_file("obqa", directory, [f"{stem}.tsv", f"{stem}.jsonl"], what)
    )


# --- BoolQ --------------------------------------------------------------------------


def _boolq_record(row: dict) -> Record:
    return {
        "question": row["question"],
        "passage": row["passage"],
        "label": _label(row["label"], {"False": 0, "True": 1}),
    }


def _read_boolq(
    directory: Path, split: str, *, seed: int, test_fraction: float = 0.2
) -> list[Record]:
    what = "SuperGLUE BoolQ jsonl with question, passage and label"
    official_train = find_file(directory, ["train.jsonl"])
    if official_train is not None and split == "train":
        return parse_rows(official_train, iter_jsonl(official_train), _boolq_record)
    path = require_file("boolq", directory, ["val.jsonl"], what)
    records = parse_rows(path, iter_jsonl(path), _boolq_record)
    if official_train is not None:
        return records
    _check_fraction(test_fraction)
    held_out = set(
        random.Random(seed).sample(range(len(records)), round(len(records) * test_fraction))
    )
    return [record for i, record in enumerate(records) if (i in held_out) == (split == "test")]


# --- Books --------------------------------------------------------------------------

# Gutenberg file names: "1342.txt", "1342-0.txt" (UTF-8), "1342-8.txt" (Latin-1), "pg1342.txt".
_BOOK_FILE = re.compile(r"^(?:pg)?(\d+)(?:-\d+)?\.txt$")


def _book_files(directory: Path) -> dict[str, Path]:
    files: dict[str, Path] = {}
    for path in sorted(directory.glob("*.txt")):
        match = _BOOK_FILE.match(path.name)
        if match is None:
            continue
        if match.group(1) in files:
            raise ValueError(
                f"books: book {match.group(1)} has two files in {directory}: "
                f"{files[match.group(1)].name} and {path.name}; keep one"
            )
        files[match.group(1)] = path
    return dict(sorted(files.items(), key=lambda item: int(item[0])))


def _book_part(text: str, split: str, test_fraction: float) -> str:
    """The first ``1 - test_fraction`` of the text (train) or the rest (test), cut at a space."""
    cut = re.compile(r"\s").search(text, len(text) - round(len(text) * test_fraction))
    cut_at = len(text) if cut is None else cut.start()
    return (text[:cut_at] if split == "train" else text[cut_at:]).strip()


def _read_books(
    directory: Path,
    split: str,
    *,
    book: str | int | Sequence[str | int] | None = None,
    test_fraction: float = 0.15,
) -> list[Record]:
    _check_fraction(test_fraction)
    files = _book_files(directory)
    if not files:
        raise missing(
            "books", directory, "<id>.txt or <id>-0.txt", "Project Gutenberg plain-text books"
        )
    chosen = list(files) if book is None else [book] if isinstance(book, str | int) else book
    wanted = [str(b) for b in chosen]
    unknown = [b for b in wanted if b not in files]
    if unknown:
        raise ValueError(
            f"books: no book {', '.join(unknown)} in {directory}; available: {', '.join(files)}"
        )
    return [
        {"book": b, "text": _book_part(read_gutenberg(files[b]), split, test_fraction)}
        for b in wanted
    ]


# --- FLORES -------------------------------------------------------------------------


def _read_flores(directory: Path, split: str, *, language: str = "eng_Latn") -> list[Record]:
    path = require_file(
        "flores",
        directory,
        [f"{language}.{split}", f"{split}/{language}.{split}"],
        "FLORES-200 sentences, one per line, line-aligned across languages",
    )
    return [{"id": i, "text": line} for i, line in enumerate(read_lines(path))]


# --- Registry -----------------------------------------------------------------------


@dataclass(frozen=True)
class _Source:
    folder: str
    splits: tuple[str, ...]
    read: Callable[..., list[Record]]
    options: tuple[str, ...] = ()
    seeded: bool = False
    multiple_choice: bool = False


_TRAIN_TEST = ("train", "test")
_SOURCES = {
    "imdb": _Source("imdb", _TRAIN_TEST, _read_imdb),
    "sst2": _Source("sst2", _TRAIN_TEST, _read_sst2),
    **{
        f"winogrande_{size}": _Source(
            "winogrande",
            _TRAIN_TEST,
            partial(_read_winogrande, f"winogrande_{size}", f"train_{size}"),
            multiple_choice=True,
        )
        for size in ("xs", "s", "m")
    },
    "arc_easy": _Source(
        "arc",
        ("train", "validation", "test"),
        partial(_read_arc, "arc_easy", "ARC-Easy"),
        multiple_choice=True,
    ),
    "arc_challenge": _Source(
        "arc",
        ("train", "validation", "test"),
        partial(_read_arc, "arc_challenge", "ARC-Challenge"),
        multiple_choice=True,
    ),
    "obqa": _Source("obqa", ("train", "validation", "test"), _read_obqa, multiple_choice=True),
    "boolq": _Source("boolq", _TRAIN_TEST, _read_boolq, ("test_fraction",), seeded=True),
    "books": _Source("books", _TRAIN_TEST, _read_books, ("book", "test_fraction")),
    "flores": _Source("flores", ("dev", "devtest"), _read_flores, ("language",)),
}

#: The names :func:`load` accepts.
DATASETS: tuple[str, ...] = tuple(_SOURCES)


def _dataset_directory(data_dir: Path, folder: str) -> Path:
    """``data_dir/folder`` when it exists, else ``data_dir`` itself (the dataset's own folder)."""
    if not data_dir.is_dir():
        raise FileNotFoundError(f"data_dir {data_dir} is not a directory")
    return data_dir / folder if (data_dir / folder).is_dir() else data_dir


def load(
    name: str,
    data_dir: str | Path,
    split: str,
    *,
    seed: int = 0,
    limit: int | None = None,
    num_choices: int | None = None,
    **options: Any,
) -> RecordDataset:
    """
    Load one split of a dataset as a :class:`~pyro_bdl.data.records.RecordDataset`.

    ``data_dir`` is either a root holding one folder per dataset (``imdb/``, ``sst2/``,
    ``winogrande/``, ``arc/``, ``obqa/``, ``boolq/``, ``books/``, ``flores/``) or that
    dataset's folder itself. Records come in file order; shuffle in the loader.

    Splits, the file each reads, and the record fields:

    - ``imdb``: train, test (``{split}.csv[.gz]`` or ``aclImdb/{split}/{neg,pos}/*.txt``);
      ``text``, ``label`` (1 = positive).
    - ``sst2``: train (``train.tsv``), test (GLUE ``dev.tsv``: the test file has no labels);
      ``text``, ``label``.
    - ``winogrande_xs``, ``winogrande_s``, ``winogrande_m``: train (``train_xs.jsonl``,
      ``train_s.jsonl``, ``train_m.jsonl``), test (``dev.jsonl``: test labels are hidden);
      ``sentence`` (with a ``_`` blank), ``choices`` (2), ``label``.
    - ``arc_easy``, ``arc_challenge``: train, test, and validation (AI2's Dev file, in the
      AI2 jsonl release only); ``question``, ``choices`` (3 to 5), ``label``.
    - ``obqa``: train, validation (``dev``), test; ``question``, ``choices`` (4), ``label``.
    - ``boolq``: train, test: a seeded split of ``val.jsonl`` (``test_fraction=0.2`` of it
      is test); with a ``train.jsonl`` beside it, train.jsonl / val.jsonl instead;
      ``question``, ``passage``, ``label`` (1 = True).
    - ``books``: train (the first 85% of each book), test (the last 15%, cut at a space;
      ``test_fraction=0.15``); ``book`` (the Gutenberg id), ``text``.
    - ``flores``: dev, devtest (``{language}.{split}`` or ``{split}/{language}.{split}``,
      ``language="eng_Latn"``); ``id`` (the line number, aligned across languages), ``text``.

    ARC is read from the instruction JSON (``ARC-Easy_train.json``) or AI2's jsonl
    (``ARC-Easy-Train.jsonl``); OpenBookQA from its TSV or AI2 jsonl; WinoGrande labels
    from ``{file}-labels.lst`` when present, else from the ``answer`` field. Books are
    the text between the Gutenberg ``*** START OF`` / ``*** END OF`` markers, one record
    per book (all books, ordered by id, unless ``book`` picks some); cut a text into
    training windows with :func:`pyro_bdl.data.tokenize.token_windows`.

    Example::

        >>> train = load("sst2", "data", "train", limit=2000, seed=1)
        >>> test = load("boolq", "data", "test", seed=0)
        >>> part = load("books", "data", "train", book="1342")[0]["text"]
        >>> samoan = load("flores", "data", "devtest", language="smo_Latn")

    :param str name: one of :data:`DATASETS`.
    :param data_dir: the data root or the dataset's folder.
    :param str split: one of the dataset's splits (above).
    :param int seed: seed of the BoolQ split and of the ``limit`` subset.
    :param int limit: keep a seeded random subset of at most ``limit`` records.
    :param int num_choices: multiple choice only: keep the questions with exactly this many
        choices (Laplace-LoRA drops ARC's few 3- and 5-choice questions with ``4``).
    :param options: the dataset's own options: ``test_fraction`` (boolq, books), ``book``
        (books: one Gutenberg id or a list, in the order wanted), ``language`` (flores).
    :raises ValueError: for an unknown name, split or option, or a malformed file.
    :raises FileNotFoundError: when a file is missing, naming what was expected.
    """
    one_of("name", name, DATASETS)
    if not isinstance(data_dir, (str, os.PathLike)):
        raise TypeError(
            f"data_dir must be a path (str or pathlib.Path), got {type(data_dir).__name__}"
        )
    source = _SOURCES[name]
    if not isinstance(split, str) or split not in source.splits:
        raise ValueError(
            f"split: {name} has no split {split!r}; valid splits: {', '.join(source.splits)}"
        )
    seed = integer("seed", seed, low=0)
    if limit is not None:
        limit = integer("limit", limit, low=1)
    if num_choices is not None:
        num_choices = integer("num_choices", num_choices, low=2)
    unknown = sorted(set(options) - set(source.options))
    if unknown:
        accepted = ", ".join(source.options) or "no dataset options"
        raise ValueError(
            f"{name} got unknown option(s) {', '.join(unknown)}; it accepts {accepted}"
        )
    if "test_fraction" in options:
        _check_fraction(options["test_fraction"])
    if "language" in options:
        instance("language", options["language"], str, "a FLORES language code like 'eng_Latn'")
    if num_choices is not None and not source.multiple_choice:
        raise ValueError(f"num_choices applies to multiple-choice datasets only, not {name}")
    if source.seeded:
        options["seed"] = seed
    records = source.read(_dataset_directory(Path(data_dir), source.folder), split, **options)
    if num_choices is not None:
        records = [record for record in records if len(record["choices"]) == num_choices]
    dataset = RecordDataset(records)
    return dataset if limit is None else dataset.subset(limit, seed)
