"""Minibatches of tensors held in memory, taken by indexing rather than collating.

PyTorch's ``DataLoader(TensorDataset(X, y), batch_size=B, shuffle=True)`` fetches the
``B`` examples of a batch one at a time and stacks them (``default_collate``): for a small
model on in-memory data the loader, not the model, is the cost (25 to 30 times the step
of a 26-weight linear regression on 5,000 examples). Here every batch is taken from each
tensor in one indexing operation:

- :class:`TensorLoader` is a :class:`~torch.utils.data.DataLoader` over tensors (a tuple,
  a dict or one tensor), reshuffled every pass (from torch's global generator, or from
  its own seed), with ``DistributedSampler``-style sharding across the ranks of a
  torchrun job;
- :func:`sliced` gives a plain ``DataLoader`` over a ``TensorDataset`` the same speed,
  batch for batch: :class:`~pyro_bdl.inference.Minibatches` applies it to every loader
  it is given, so the documented pattern is fast wherever a DataLoader is accepted.

Both are real DataLoaders (no worker processes: indexing in memory needs none), built
from the two hooks PyTorch has for this, a batch sampler and a dataset's
``__getitems__``: :class:`EpochBatches` draws each pass's batches of indices at once,
:class:`SlicedTensors` takes a batch of every tensor in one ``index_select`` (or a view,
for a contiguous batch).
"""

from __future__ import annotations

import numbers
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, TensorDataset, default_collate

from pyro_bdl import distributed
from pyro_bdl._checks import instance, integer

__all__ = ["EpochBatches", "SlicedTensors", "TensorLoader", "sliced"]

#: What a batch sampler of this module yields: a contiguous range, or indices.
Index = slice | torch.Tensor

_SEED_FOR_SHARDS = (
    "seed: sharded and shuffled, every rank must draw the same order: give a seed (an int, "
    "the same on every rank)"
)


class SlicedTensors(Dataset):
    """Tensors that share their first dimension, indexed all at once.

    ``data[index]`` and ``data.__getitems__(indices)`` (what a DataLoader calls for a
    batch) give ``data``'s structure (a tensor, a tuple or list of tensors, a dict of
    tensors) with every tensor indexed along its first dimension: by an ``int`` one
    example, by a ``slice`` a view, by a list or tensor of indices a copy in one
    ``index_select`` per tensor.

    Example::

        >>> data = SlicedTensors({"x": torch.arange(6.0).reshape(3, 2), "y": torch.arange(3)})
        >>> data.__getitems__([2, 0])["y"]
        tensor([2, 0])

    :param data: a tensor, a tuple or list of tensors, or a dict of tensors, all with the
        same first dimension ``N >= 1`` and on one device.
    """

    def __init__(self, data: torch.Tensor | Sequence[torch.Tensor] | Mapping[str, torch.Tensor]):
        if torch.is_tensor(data):
            tensors = {None: data}
        elif isinstance(data, Mapping):
            tensors = dict(data)
        elif isinstance(data, (tuple, list)):
            tensors = dict(enumerate(data))
        else:
            raise TypeError(
                "data must be a tensor, a tuple or list of tensors or a dict of tensors, got "
                f"{type(data).__name__}"
            )
        if not tensors:
            raise ValueError("data holds no tensor: give at least one")
        for key, tensor in tensors.items():
            where = "data" if key is None else f"data[{key!r}]"
            instance(where, tensor, torch.Tensor, "a tensor")
            if tensor.dim() == 0:
                raise ValueError(f"{where} is a scalar: each tensor needs a first (example) axis")
        lengths = {len(t) for t in tensors.values()}
        devices = {t.device for t in tensors.values()}
        if len(lengths) > 1:
            raise ValueError(
                "data's tensors must have the same first dimension (one row per example), got "
                + ", ".join(f"{key!r}: {len(t)}" for key, t in tensors.items())
            )
        if len(devices) > 1:
            raise ValueError(
                f"data's tensors must be on one device, got {sorted(map(str, devices))}: "
                "move them with .to(device)"
            )
        (self.num_data,) = lengths
        if self.num_data == 0:
            raise ValueError("data has no example (its tensors' first dimension is 0)")
        (self.device,) = devices
        self._kind = type(data) if isinstance(data, (tuple, list)) else None
        self._tensors = tensors

    def __len__(self) -> int:
        return self.num_data

    def __getitem__(self, index: int | slice | torch.Tensor | Sequence[int]) -> Any:
        if isinstance(index, (slice, numbers.Integral)):
            return self._structure({k: t[index] for k, t in self._tensors.items()})
        index = torch.as_tensor(index, dtype=torch.long, device=self.device)
        return self._structure({k: t.index_select(0, index) for k, t in self._tensors.items()})

    #: A DataLoader's batch: the same indexing, once per tensor (not once per example).
    __getitems__ = __getitem__

    def _structure(self, parts: dict) -> Any:
        if None in parts:
            return parts[None]
        if self._kind is not None:
            return self._kind(parts.values())
        return parts


class EpochBatches(Sampler[Index]):
    """The batches of indices of one pass over ``num_data`` examples, a pass at a time.

    Each iteration is one pass (epoch): without ``shuffle`` the examples in order, in
    contiguous slices; with it a fresh permutation per pass, cut into batches. The
    permutation is drawn from torch's global generator (``seed=None``, as a DataLoader
    without a generator draws it: ``pyro.set_rng_seed`` fixes it, and each of
    :class:`~pyro_bdl.inference.Chains`' chains, seeded apart, draws its own) or from a
    generator seeded with ``(seed, epoch)`` (a NumPy ``SeedSequence`` of the two, so that
    loaders of different seeds never share a pass), which never touches the global one.
    One batch that holds every example is the slice of all of them even with ``shuffle``:
    the order within a batch means nothing to a likelihood that sums over its examples,
    and permuting them would copy the whole data set at every step (as long as the
    model's step, measured on 100,000 examples).

    Sharded over ``num_replicas`` ranks (with a ``seed``) it is PyTorch's
    ``DistributedSampler``: every rank draws the same permutation, pads it by repeating
    its first examples to a multiple of ``num_replicas`` (or with ``drop_last`` cuts it to
    one) and keeps every ``num_replicas``-th example from its ``rank`` on, so the ranks'
    shards are disjoint and the ``k``-th batches of the W ranks together hold the
    examples of the ``k``-th batch of W times the size in one process (where W divides
    ``num_data``). ``epoch`` counts the passes begun; :meth:`set_epoch` sets the next one,
    as ``DistributedSampler.set_epoch`` does, and each pass advances it.

    Example::

        >>> batches = EpochBatches(5, 2, shuffle=False)
        >>> list(batches), len(batches)
        ([slice(0, 2, None), slice(2, 4, None), slice(4, 5, None)], 3)

    :param int num_data: the examples ``N``.
    :param int batch_size: examples per batch (per rank).
    :param bool shuffle: a new random order every pass.
    :param bool drop_last: drop the last batch when it is smaller than ``batch_size``
        (and, sharded, the examples that would not give every rank an equal share)
        instead of keeping it (and padding).
    :param seed: seed of the permutations (an int), or None for the global generator.
    :param int num_replicas: ranks sharing the data (1: no sharding).
    :param int rank: this rank, ``0 <= rank < num_replicas``.
    :param device: where the index tensors are made (the data's device).
    """

    def __init__(
        self,
        num_data: int,
        batch_size: int,
        *,
        shuffle: bool = False,
        drop_last: bool = False,
        seed: int | None = None,
        num_replicas: int = 1,
        rank: int = 0,
        device: torch.device | str = "cpu",
    ):
        self.num_data = integer("num_data", num_data, low=1)
        self.batch_size = integer("batch_size", batch_size, low=1)
        self.shuffle = instance("shuffle", shuffle, bool, "True or False")
        self.drop_last = instance("drop_last", drop_last, bool, "True or False")
        self.seed = None if seed is None else integer("seed", seed, low=0)
        self.num_replicas = integer("num_replicas", num_replicas, low=1)
        if self.num_replicas > 1 and self.shuffle and self.seed is None:
            raise ValueError(_SEED_FOR_SHARDS)
        self.rank = integer("rank", rank, low=0, high=self.num_replicas - 1)
        self.device = torch.device(device)
        self.epoch = 0
        if len(self) == 0:
            raise ValueError(
                f"batch_size={self.batch_size} with drop_last=True leaves no batch of the "
                f"{self._shard_size} examples{' of each rank' if num_replicas > 1 else ''}: "
                "give a smaller batch_size or drop_last=False"
            )

    @property
    def _shard_size(self) -> int:
        """Examples of this rank per pass (all of them without sharding)."""
        if self.drop_last:
            return self.num_data // self.num_replicas
        return -(-self.num_data // self.num_replicas)

    def __len__(self) -> int:
        if self.drop_last:
            return self._shard_size // self.batch_size
        return -(-self._shard_size // self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass the pass ``epoch`` (with a ``seed``, its permutation is drawn
        from ``(seed, epoch)``), as ``DistributedSampler.set_epoch``.

        :param int epoch: the pass, ``>= 0``.
        """
        self.epoch = integer("epoch", epoch, low=0)

    def __iter__(self) -> Iterator[Index]:
        epoch, self.epoch = self.epoch, self.epoch + 1
        stop = len(self) * self.batch_size
        if self.num_replicas == 1 and (not self.shuffle or self.batch_size >= self.num_data):
            # Contiguous batches, taken as views: the in-order pass, or one batch of all.
            for start in range(0, min(stop, self.num_data), self.batch_size):
                yield slice(start, min(start + self.batch_size, self.num_data))
            return
        indices = self._indices(epoch)[:stop]
        # One transfer per pass, not one per batch (a synchronous copy would wait for the
        # device at every step): from pinned memory, queued behind the work already there.
        if self.device.type == "cuda":
            indices = indices.pin_memory().to(self.device, non_blocking=True)
        else:
            indices = indices.to(self.device)
        for start in range(0, len(indices), self.batch_size):
            yield indices[start : start + self.batch_size]

    def _indices(self, epoch: int) -> torch.Tensor:
        """This rank's examples of pass ``epoch``, in drawn order, on the CPU."""
        if self.shuffle and self.seed is None:
            order = torch.randperm(self.num_data)
        elif self.shuffle:
            # The state of a SeedSequence of (seed, epoch): distinct for distinct pairs,
            # where DistributedSampler's seed + epoch gives seed 0's pass 1 to seed 1's pass 0.
            state = np.random.SeedSequence([self.seed, epoch]).generate_state(1, np.uint64)
            generator = torch.Generator().manual_seed(int(state[0]))
            order = torch.randperm(self.num_data, generator=generator)
        else:
            order = torch.arange(self.num_data)
        if self.num_replicas == 1:
            return order
        total = self._shard_size * self.num_replicas
        order = order.repeat(-(-total // self.num_data))[:total]
        return order[self.rank :: self.num_replicas]


class TensorLoader(DataLoader):
    """A DataLoader over tensors in memory: every batch in one indexing operation per tensor.

    ``TensorLoader((X, y), batch_size=B, shuffle=True)`` gives what
    ``DataLoader(TensorDataset(X, y), batch_size=B, shuffle=True)`` does, batches of
    ``X`` and ``y``, without fetching and stacking ``B`` examples one by one: on a small
    model the step then costs what it costs with the tensors passed directly
    (``benchmarks/data_path.py``). Batches have the structure of ``data``: a tuple (list,
    dict) of tensors gives tuples (lists, dicts), one tensor gives tensors; they are on
    the tensors' device (a GPU too) and, where a batch is a contiguous range (no
    ``shuffle``, or one batch of every example), views of them: nothing is copied.

    Its passes (epochs) are those of :class:`~pyro_bdl.data.tensor_loader.EpochBatches`:
    reshuffled every pass, from torch's global generator as a plain DataLoader's (so
    ``pyro.set_rng_seed`` fixes the order, and each of :class:`~pyro_bdl.inference.Chains`'
    chains has its own), or with ``seed`` from a generator of its own, seeded by
    ``(seed, pass)``, which never touches the global one (as
    :func:`~pyro_bdl.data.make_loader`'s); one batch of every example is the data as given,
    unpermuted (a likelihood sums over it). The last batch is kept smaller or, with
    ``drop_last``, dropped. With ``shard=True``, under a torchrun job, each rank takes a
    disjoint shard as with a ``DistributedSampler`` (a ``seed``, the same on every rank;
    reshuffled every pass, :meth:`set_epoch` as its), for the data-parallel fits and
    kernels of :mod:`pyro_bdl.distributed`; leave it False for
    :class:`~pyro_bdl.inference.Chains`, whose chains each need all the data. Make the
    loader after :func:`pyro_bdl.distributed.init_process_group`.

    ``len(loader)`` is the batches per pass; ``loader.batch_sampler`` (an
    :class:`~pyro_bdl.data.tensor_loader.EpochBatches`) holds ``batch_size``,
    ``drop_last`` and ``epoch`` (``loader.batch_size`` is None, as for any DataLoader
    given a batch sampler).

    Example::

        >>> X, y = torch.randn(1000, 26), torch.randn(1000)
        >>> loader = TensorLoader((X, y), batch_size=64, shuffle=True, seed=0)
        >>> x_batch, y_batch = next(iter(loader))
        >>> len(loader), tuple(x_batch.shape)
        (16, (64, 26))

    :param data: a tensor, a tuple or list of tensors, or a dict of tensors, with the same
        first dimension (the examples) and on one device.
    :param int batch_size: examples per batch (per rank, sharded).
    :param bool shuffle: a new random order every pass.
    :param bool drop_last: drop a last batch smaller than ``batch_size``.
    :param seed: seed of the shuffling (an int), or None to draw it from torch's global
        generator (not with ``shard``).
    :param bool shard: give each rank of the torchrun job its own shard (a job of one
        process: all the data).
    """

    def __init__(
        self,
        data: torch.Tensor | Sequence[torch.Tensor] | Mapping[str, torch.Tensor],
        batch_size: int = 1,
        shuffle: bool = False,
        *,
        drop_last: bool = False,
        seed: int | None = None,
        shard: bool = False,
    ):
        dataset = SlicedTensors(data)
        instance("shard", shard, bool, "True or False")
        if shard and shuffle and seed is None:  # here too in a job of one process
            raise ValueError(_SEED_FOR_SHARDS)
        if shard and distributed.launched_world_size() > 1 and not distributed.is_distributed():
            raise RuntimeError(
                f"shard=True in a job of WORLD_SIZE={distributed.launched_world_size()} "
                "without a process group: call bdl.distributed.init_process_group() before "
                "making the loader"
            )
        batches = EpochBatches(
            len(dataset),
            batch_size,
            shuffle=shuffle,
            drop_last=drop_last,
            seed=seed,
            num_replicas=distributed.world_size() if shard else 1,
            rank=distributed.rank() if shard else 0,
            device=dataset.device,
        )
        super().__init__(dataset, batch_sampler=batches, collate_fn=_as_is)

    def __iter__(self) -> Iterator[Any]:
        # A batch is ready after one indexing per tensor. PyTorch's iterator around it (a
        # profiler range per batch, a seed per pass for worker processes this loader has
        # none of) would cost as much again: 45 us a batch, measured on the shared machine.
        take = self.dataset.__getitems__
        for index in self.batch_sampler:
            yield take(index)

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass the pass ``epoch``
        (:meth:`~pyro_bdl.data.tensor_loader.EpochBatches.set_epoch`).

        :param int epoch: the pass, ``>= 0``.
        """
        self.batch_sampler.set_epoch(epoch)


def sliced(loader: DataLoader) -> DataLoader:
    """``loader``, or for a plain DataLoader over a ``TensorDataset`` the same batches by index.

    A plain loader (the ``DataLoader`` class itself over a ``TensorDataset``, with the
    default collate function and no worker processes) fetches and stacks its examples one
    by one. The loader returned takes each batch of every tensor in one ``index_select``
    instead, with the same batch sampler and the same generator: it draws the same random
    numbers at the same moments (the global ones too, if the loader has no generator of
    its own) and gives the same batches, in the same order, equal to the last bit (a list
    of tensors, as ``default_collate`` gives). Any other loader is returned as it is.

    Example::

        >>> plain = DataLoader(TensorDataset(torch.arange(4)), batch_size=3)
        >>> [batch for batch in sliced(plain)]
        [[tensor([0, 1, 2])], [tensor([3])]]

    :param loader: a DataLoader.
    """
    plain = (
        type(loader) is DataLoader
        and type(loader.dataset) is TensorDataset
        and loader.batch_sampler is not None
        and loader.collate_fn is default_collate
        and loader.num_workers == 0
        and len(loader.dataset) > 0
        and len({tensor.device for tensor in loader.dataset.tensors}) == 1
    )
    if not plain:
        return loader
    return DataLoader(
        SlicedTensors(list(loader.dataset.tensors)),
        batch_sampler=loader.batch_sampler,
        collate_fn=_as_is,
        generator=loader.generator,
        pin_memory=loader.pin_memory,
        pin_memory_device=loader.pin_memory_device,
    )


def _as_is(batch: Any) -> Any:
    """The collate function of a dataset whose ``__getitems__`` returns the batch."""
    return batch
