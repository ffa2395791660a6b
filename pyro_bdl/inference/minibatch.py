"""One way to feed minibatches to a model: DataLoader arguments become batches.

Every inference routine of pyro_bdl (SGMCMC kernels, the Laplace curvature pass,
VI training) is called with the model's own arguments, in which any
:class:`torch.utils.data.DataLoader` stands for "the next batch". This module makes
that substitution, cycling through epochs, or makes one pass over the data.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader

__all__ = ["Minibatches"]


class Minibatches:
    """The model arguments with each DataLoader replaced by one of its batches.

    Example::

        batches = Minibatches((train_loader, num_data), {})
        args, kwargs = batches.next()     # (batch, num_data), {}

    :param tuple args: the model's positional arguments.
    :param dict kwargs: the model's keyword arguments.
    """

    def __init__(self, args: tuple, kwargs: dict):
        self.args = tuple(args)
        self.kwargs = dict(kwargs)
        self._loaders: dict[int | str, DataLoader] = {
            **{i: a for i, a in enumerate(self.args) if isinstance(a, DataLoader)},
            **{k: v for k, v in self.kwargs.items() if isinstance(v, DataLoader)},
        }
        for key, loader in self._loaders.items():
            if len(loader) == 0:
                where = f"argument {key}" if isinstance(key, int) else f"keyword {key!r}"
                raise ValueError(f"the DataLoader passed as {where} yields no batches")
        self._iterators: dict[int | str, Iterator] = {}
        self._peeked: tuple[tuple, dict] | None = None
        self.epoch = 0

    @property
    def has_loaders(self) -> bool:
        """Whether any argument is a DataLoader."""
        return bool(self._loaders)

    @property
    def batches_per_epoch(self) -> int:
        """Batches in one pass (the shortest loader's length; 1 without loaders)."""
        return min((len(loader) for loader in self._loaders.values()), default=1)

    def next(self) -> tuple[tuple, dict]:
        """The arguments for the next step, starting a new epoch when a loader ends."""
        if self._peeked is not None:
            batch, self._peeked = self._peeked, None
            return batch
        return self._substitute({key: self._next_batch(key) for key in self._loaders})

    def peek(self) -> tuple[tuple, dict]:
        """The arguments the next call of :meth:`next` will return."""
        if self._peeked is None:
            self._peeked = self.next()
        return self._peeked

    def one_pass(self) -> Iterator[tuple[tuple, dict]]:
        """Arguments for every batch of one epoch (loaders in lockstep)."""
        if not self._loaders:
            yield self.args, self.kwargs
            return
        keys = list(self._loaders)
        for batches in zip(*(self._loaders[key] for key in keys)):
            yield self._substitute(dict(zip(keys, batches)))

    def _next_batch(self, key: int | str) -> Any:
        iterator = self._iterators.get(key)
        if iterator is not None:
            try:
                return next(iterator)
            except StopIteration:
                self.epoch += 1
        self._iterators[key] = iter(self._loaders[key])
        return next(self._iterators[key])

    def _substitute(self, batches: dict[int | str, Any]) -> tuple[tuple, dict]:
        args = tuple(batches.get(i, a) for i, a in enumerate(self.args))
        kwargs = {k: batches.get(k, v) for k, v in self.kwargs.items()}
        return args, kwargs
