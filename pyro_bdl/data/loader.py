"""Reproducible minibatches: a :class:`~torch.utils.data.DataLoader` with a seeded generator."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from pyro_bdl._checks import function, instance, integer


def make_loader(
    dataset: Dataset,
    collate: Callable[[list[Any]], dict[str, torch.Tensor]],
    batch_size: int,
    shuffle: bool = False,
    seed: int = 0,
    **kwargs: Any,
) -> DataLoader:
    """
    A DataLoader whose shuffling comes from its own ``torch.Generator`` seeded with
    ``seed``, so the batch order is the same on every run and independent of the global
    torch seed.

    Example::

        >>> from pyro_bdl.data import RecordDataset
        >>> data = RecordDataset([{"label": i} for i in range(6)])
        >>> collate = lambda records: [r["label"] for r in records]
        >>> list(make_loader(data, collate, batch_size=3, shuffle=True, seed=0))
        [[5, 1, 0], [3, 2, 4]]

    :param dataset: e.g. a :class:`~pyro_bdl.data.records.RecordDataset`.
    :param collate: a collator of :mod:`pyro_bdl.data` (records to a batch).
    :param int batch_size: records per batch.
    :param bool shuffle: draw a new order every epoch (from the seeded generator).
    :param int seed: seed of the generator.
    :param kwargs: passed to :class:`~torch.utils.data.DataLoader` (``drop_last``,
        ``num_workers``, ...).
    """
    if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise TypeError(
            "dataset must be a sized, indexable dataset such as load(...) returns, got "
            f"{type(dataset).__name__}"
        )
    function("collate", collate, "a collator (records -> batch), e.g. ClassificationCollator")
    batch_size = integer("batch_size", batch_size, low=1)
    instance("shuffle", shuffle, bool, "True or False")
    seed = integer("seed", seed, low=0)
    generator = torch.Generator().manual_seed(seed)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        collate_fn=collate,
        generator=generator,
        **kwargs,
    )
