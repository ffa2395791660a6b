"""A list-like :class:`torch.utils.data.Dataset` of plain records (dicts)."""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

from pyro_bdl._checks import integer

Record = dict[str, Any]


class RecordDataset(Dataset):
    """
    The records of one split of a dataset, in file order.

    A record is a plain dict: text fields, a ``choices`` list for multiple choice and an
    integer ``label``. The dataset is indexable, sized and iterable, so it plugs into
    :class:`torch.utils.data.DataLoader` with any collator of :mod:`pyro_bdl.data`.

    Example::

        >>> data = RecordDataset([{"text": "good", "label": 1}, {"text": "bad", "label": 0}])
        >>> len(data), data[0]["label"]
        (2, 1)
        >>> len(data.subset(1, seed=0))
        1

    :param records: the records, kept in the given order.
    """

    def __init__(self, records: Sequence[Record]):
        self._records = list(records)

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, index: int) -> Record:
        return self._records[index]

    def __iter__(self) -> Iterator[Record]:
        return iter(self._records)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self)} records)"

    def subset(self, n: int, seed: int = 0) -> RecordDataset:
        """
        A seeded random subset of at most ``n`` records, kept in their original order.

        The same ``seed`` always selects the same records; asking for more records than
        there are returns all of them.

        :param int n: how many records to keep (at least 1).
        :param int seed: seed of the random selection.
        :return: a new dataset with ``min(n, len(self))`` records.
        """
        n = integer("n", n, low=1)
        seed = integer("seed", seed, low=0)
        chosen = random.Random(seed).sample(range(len(self)), min(n, len(self)))
        return RecordDataset([self._records[i] for i in sorted(chosen)])


def labels_tensor(records: Sequence[Record]) -> torch.Tensor:
    """The ``label`` of each record as a ``(B,)`` ``torch.long`` tensor, for collators."""
    if not records:
        raise ValueError("records: a batch needs at least one record, got none")
    unlabelled = [i for i, record in enumerate(records) if "label" not in record]
    if unlabelled:
        raise ValueError(
            f"records {unlabelled[:5]} of the batch have no 'label' (fields: "
            f"{', '.join(records[unlabelled[0]])}); records come from pyro_bdl.data.load"
        )
    return torch.tensor([record["label"] for record in records], dtype=torch.long)
