"""One way to feed minibatches to a model: DataLoader arguments become batches.

Every inference routine of pyro_bdl (SGMCMC kernels, the Laplace curvature pass,
VI training) is called with the model's own arguments, in which any
:class:`torch.utils.data.DataLoader` stands for "the next batch". This module makes
that substitution, cycling through epochs, or makes one pass over the data
(:class:`DataPass`), which for a model that subsamples with its own ``pyro.plate``
enumerates that plate's indices (:class:`SubsamplePlate`).

A plain ``DataLoader(TensorDataset(...))`` is iterated through
:func:`pyro_bdl.data.tensor_loader.sliced`: the same batches from the same random draws,
each taken by indexing the tensors instead of stacking its examples one by one (which,
for a small model on in-memory data, costs more than the model's step).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pyro
import torch
from pyro.poutine.messenger import Messenger
from pyro.poutine.util import site_is_subsample
from torch.utils.data import DataLoader, DistributedSampler

from pyro_bdl.data.tensor_loader import sliced

__all__ = ["Minibatches", "DataPass", "SubsamplePlate"]


class Minibatches:
    """The model arguments with each DataLoader replaced by one of its batches.

    A loader is iterated again when it ends (a new epoch); a ``DistributedSampler``'s
    epoch is then advanced (``set_epoch``), so that each epoch is shuffled afresh, the
    same on every rank, as a :class:`~pyro_bdl.data.TensorLoader`'s is. A plain loader
    over a ``TensorDataset`` gives its batches through
    :func:`~pyro_bdl.data.tensor_loader.sliced` (the same batches, by index).

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
            **{i: sliced(a) for i, a in enumerate(self.args) if isinstance(a, DataLoader)},
            **{k: sliced(v) for k, v in self.kwargs.items() if isinstance(v, DataLoader)},
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
                _advance_epoch(self._loaders[key])
        self._iterators[key] = iter(self._loaders[key])
        return next(self._iterators[key])

    def _substitute(self, batches: dict[int | str, Any]) -> tuple[tuple, dict]:
        args = tuple(batches.get(i, a) for i, a in enumerate(self.args))
        kwargs = {k: batches.get(k, v) for k, v in self.kwargs.items()}
        return args, kwargs


def _advance_epoch(loader: DataLoader) -> None:
    """Start a ``DistributedSampler``'s next epoch: left alone, it repeats one order."""
    sampler = getattr(loader.batch_sampler, "sampler", loader.sampler)
    if isinstance(sampler, DistributedSampler):
        sampler.set_epoch(sampler.epoch + 1)


class SubsamplePlate(Messenger):
    """Fix the indices of a plate that draws its own subsample, one chunk at a time.

    A model that subsamples with ``pyro.plate(name, N, subsample_size=B)`` draws ``B``
    random indices at every call; a method that must see every example once (a Laplace
    curvature pass) sets them instead, through the plate's own subsample site, to
    ``0..B-1``, ``B..2B-1``, ... The plate keeps its scale ``N / B``. The last chunk, when
    ``B`` does not divide ``N``, is the last ``B`` indices with the ones already seen
    masked out (the plate's subsample size is fixed), so each example counts once.

    Example::

        plate = SubsamplePlate.find(model, args, kwargs)   # None if the model has none
        for chunk in plate.chunks():
            with chunk:
                model(*args, **kwargs)

    :param str name: the plate's name.
    :param int size: ``N``.
    :param int subsample_size: ``B``.
    """

    def __init__(self, name: str, size: int, subsample_size: int):
        super().__init__()
        self.name, self.size, self.subsample_size = name, size, subsample_size
        self._indices: torch.Tensor | None = None
        self._keep: torch.Tensor | None = None

    @classmethod
    def find(cls, model: Callable, args: tuple, kwargs: dict) -> SubsamplePlate | None:
        """The plate of ``model`` (run on ``args``) that draws its own subsample, if any.

        :raises ValueError: if the model has more than one.
        """
        with torch.no_grad(), pyro.poutine.block():
            trace = pyro.poutine.trace(model).get_trace(*args, **kwargs)
        drawn = {
            name: site["fn"]
            for name, site in trace.nodes.items()
            if site["type"] == "sample"
            and site_is_subsample(site)
            and site["fn"].subsample_size is not None
            and site["fn"].subsample_size < site["fn"].size
        }
        if len(drawn) > 1:
            raise ValueError(
                f"the model subsamples with more than one plate {list(drawn)}; a pass over "
                "the data can enumerate the indices of one: subsample one plate, or pass "
                "the data as a DataLoader"
            )
        if not drawn:
            return None
        ((name, fn),) = drawn.items()
        return cls(name, fn.size, fn.subsample_size)

    @property
    def num_chunks(self) -> int:
        """Chunks in one pass, ``ceil(N / B)``."""
        return -(-self.size // self.subsample_size)

    def chunks(self) -> Iterator[SubsamplePlate]:
        """This messenger set to each chunk of indices in turn (use each as a context)."""
        for start in range(0, self.size, self.subsample_size):
            first = min(start, self.size - self.subsample_size)
            self._indices = torch.arange(first, first + self.subsample_size)
            self._keep = None if first == start else self._indices >= start
            yield self

    @property
    def kept(self) -> int:
        """Examples of the current chunk not seen before."""
        return self.subsample_size if self._keep is None else int(self._keep.sum())

    def _pyro_sample(self, msg: dict) -> None:
        if msg["name"] == self.name and site_is_subsample(msg):
            msg["value"] = self._indices.to(getattr(msg["fn"], "device", None))
            msg["done"] = True
        elif self._keep is not None:
            frame = next((f for f in msg["cond_indep_stack"] if f.name == self.name), None)
            if frame is not None:
                keep = self._keep.reshape((-1,) + (1,) * (-frame.dim - 1))
                msg["mask"] = keep if msg["mask"] is None else msg["mask"] & keep


class DataPass:
    """One pass over the whole data set of a model: what a curvature or full-batch pass iterates.

    The model's DataLoader arguments (see :class:`Minibatches`) give its batches; without
    any, a model that subsamples with its own plate (``pyro.plate("data", N,
    subsample_size=B)``) gives the chunks of that plate's indices (see
    :class:`SubsamplePlate`); a model with neither (data in its arguments or in a
    closure, ``pyro.condition``) is one run over all of it.

    Example::

        for args, kwargs, context in DataPass(model, args, kwargs):
            with context:
                model(*args, **kwargs)

    :param callable model: the Pyro model.
    :param tuple args: its positional arguments (DataLoaders stand for their batches).
    :param dict kwargs: its keyword arguments.
    """

    def __init__(self, model: Callable, args: tuple, kwargs: dict):
        self.batches = Minibatches(args, kwargs)
        self.plate = None
        if not self.batches.has_loaders:
            self.plate = SubsamplePlate.find(model, self.batches.args, self.batches.kwargs)

    @property
    def runs(self) -> int:
        """Model runs in one pass."""
        if self.plate is not None:
            return self.plate.num_chunks
        return self.batches.batches_per_epoch

    def __iter__(self) -> Iterator[tuple[tuple, dict, contextlib.AbstractContextManager]]:
        if self.plate is None:
            for args, kwargs in self.batches.one_pass():
                yield args, kwargs, contextlib.nullcontext()
            return
        for chunk in self.plate.chunks():
            yield self.batches.args, self.batches.kwargs, chunk
