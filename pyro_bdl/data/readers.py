"""
Readers for the file formats behind :func:`pyro_bdl.data.load`.

Each reader yields ``(location, row)`` pairs ("line 3", "item 7"), and :func:`parse_rows`
turns rows into records, so that every malformed row raises an error that names the file,
the line, what was expected and what was found.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from pyro_bdl.data.records import Record

Row = tuple[str, Any]

# Gutenberg headers vary ("*** START OF THIS PROJECT GUTENBERG EBOOK X ***",
# "***START OF THE PROJECT GUTENBERG EBOOK X***"); only the marker words are stable.
_GUTENBERG_START = re.compile(r"^\*\*\*\s*START OF .*$", re.MULTILINE)
_GUTENBERG_END = re.compile(r"^\*\*\*\s*END OF .*$", re.MULTILINE)
# Boilerplate that sits inside the markers: the transcribers' credit paragraph at the
# start and the "End of (the) Project Gutenberg EBook of ..." line at the end.
_GUTENBERG_CREDIT = re.compile(r"\AProduced by .*?(?:\n\s*\n|\Z)", re.DOTALL)
_GUTENBERG_CLOSING = re.compile(r"^End of (?:the )?Project Gutenberg.*\Z", re.MULTILINE | re.DOTALL)


def listing(directory: Path) -> str:
    """The sorted entry names of ``directory`` for error messages ("nothing" when empty)."""
    if not directory.is_dir():
        return "no such directory"
    names = sorted(entry.name for entry in directory.iterdir())
    return ", ".join(names) if names else "nothing"


def missing(dataset: str, directory: Path, expected: str, what: str) -> FileNotFoundError:
    """
    The error for a dataset file that is not where it should be.

    :param str dataset: the dataset name, e.g. ``"sst2"``.
    :param Path directory: where the file was looked for.
    :param str expected: the file name(s) looked for.
    :param str what: the format expected, e.g. ``"GLUE SST-2 'sentence<TAB>label'"``.
    """
    return FileNotFoundError(
        f"{dataset}: expected {expected} in {directory} ({what}), found: {listing(directory)}"
    )


def find_file(directory: Path, names: Sequence[str]) -> Path | None:
    """The first of ``names`` (relative paths) that is a file in ``directory``, else ``None``."""
    for name in names:
        if (directory / name).is_file():
            return directory / name
    return None


def require_file(dataset: str, directory: Path, names: Sequence[str], what: str) -> Path:
    """Like :func:`find_file`, but a missing file raises the error of :func:`missing`."""
    path = find_file(directory, names)
    if path is None:
        expected = names[0] if len(names) == 1 else "one of " + ", ".join(names)
        raise missing(dataset, directory, expected, what)
    return path


def parse_rows(path: Path, rows: Iterable[Row], parse: Callable[[Any], Record]) -> list[Record]:
    """
    Apply ``parse`` to every row, locating any failure in ``path``.

    ``parse`` raises :class:`ValueError` for a bad value and :class:`KeyError` for a missing
    field; both come back as one :class:`ValueError` that names the file and the line.

    :param Path path: the file the rows come from.
    :param rows: ``(location, row)`` pairs from one of the ``iter_*`` readers.
    :param parse: maps one row to a record.
    """
    records = []
    for where, row in rows:
        try:
            records.append(parse(row))
        except KeyError as err:
            found = ", ".join(row) if isinstance(row, dict) else type(row).__name__
            raise ValueError(f"{path} {where}: expected field {err}, found: {found}") from None
        except ValueError as err:
            raise ValueError(f"{path} {where}: {err}") from None
    return records


def read_lines(path: Path) -> list[str]:
    """The lines of a UTF-8 text file without their line ends (no trailing empty line)."""
    # split("\n") rather than splitlines(): sentences may contain U+2028 and friends.
    lines = path.read_text(encoding="utf-8-sig").split("\n")
    return lines[:-1] if lines and lines[-1] == "" else lines


def iter_jsonl(path: Path) -> Iterator[Row]:
    """One JSON object per non-empty line."""
    for number, line in enumerate(read_lines(path), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} line {number}: expected a JSON object, found {err}") from None
        if not isinstance(row, dict):
            raise ValueError(
                f"{path} line {number}: expected a JSON object, found {type(row).__name__}"
            )
        yield f"line {number}", row


def iter_json_list(path: Path) -> Iterator[Row]:
    """The objects of a file holding one JSON list of objects."""
    try:
        items = json.loads(path.read_text(encoding="utf-8-sig"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: expected a JSON list of objects, found {err}") from None
    if not isinstance(items, list):
        raise ValueError(f"{path}: expected a JSON list of objects, found {type(items).__name__}")
    for number, item in enumerate(items, start=1):
        if not isinstance(item, dict):
            raise ValueError(f"{path} item {number}: expected an object, found {item!r:.80}")
        yield f"item {number}", item


def iter_tsv(path: Path, columns: Sequence[str]) -> Iterator[Row]:
    """
    The rows of a tab-separated file whose first line is the header ``columns``.

    Fields are split on tabs only (no quoting), as GLUE and OpenBookQA write them.
    """
    lines = read_lines(path)
    header = "\t".join(columns)
    if not lines or lines[0].rstrip() != header:
        found = repr(lines[0]) if lines else "an empty file"
        raise ValueError(f"{path} line 1: expected the header {header!r}, found {found}")
    for number, line in enumerate(lines[1:], start=2):
        fields = line.split("\t")
        if len(fields) != len(columns):
            raise ValueError(
                f"{path} line {number}: expected {len(columns)} tab-separated fields "
                f"({', '.join(columns)}), found {len(fields)}"
            )
        yield f"line {number}", dict(zip(columns, fields, strict=True))


def iter_csv(path: Path, required: Sequence[str]) -> Iterator[Row]:
    """
    The rows of a CSV file with a header (gzip-compressed when the name ends in ``.gz``).

    :param required: columns the header must contain; others are passed through.
    """
    raw = gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")
    with raw, io.TextIOWrapper(raw, encoding="utf-8-sig", newline="") as text:
        reader = csv.DictReader(text)
        header = reader.fieldnames or []
        absent = [column for column in required if column not in header]
        if absent:
            raise ValueError(
                f"{path} line 1: expected columns {', '.join(required)}, "
                f"found {', '.join(header) or 'an empty file'}"
            )
        for row in reader:
            # reader.line_num is the line the record ends on: reviews span lines.
            yield f"line {reader.line_num}", row


def read_gutenberg(path: Path) -> str:
    """
    The body of a Project Gutenberg text: what lies between its ``*** START OF`` and
    ``*** END OF`` marker lines, without the licence header and footer, and without the
    boilerplate just inside them (a leading "Produced by ..." credit paragraph, a closing
    "End of the Project Gutenberg EBook ..." line).

    Line ends are normalised to ``\\n`` and a byte-order mark is dropped.

    :param Path path: the book's ``.txt`` file.
    """
    text = path.read_text(encoding="utf-8-sig")
    start = _GUTENBERG_START.search(text)
    if start is None:
        raise ValueError(
            f"{path}: expected a Project Gutenberg text with a '*** START OF' marker line, "
            "found none"
        )
    end = _GUTENBERG_END.search(text, start.end())
    if end is None:
        line = text.count("\n", 0, start.start()) + 1
        raise ValueError(
            f"{path}: expected an '*** END OF' marker line after the '*** START OF' marker "
            f"on line {line}, found none"
        )
    body = _GUTENBERG_CREDIT.sub("", text[start.end() : end.start()].strip())
    return _GUTENBERG_CLOSING.sub("", body).strip()
