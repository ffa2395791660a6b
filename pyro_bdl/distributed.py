"""torch.distributed plumbing shared by every method: rank, device, reductions, gathering.

pyro_bdl runs on the engine PyTorch users already launch, :mod:`torch.distributed`:
``torchrun`` (and so ``accelerate launch``, Slurm's ``srun torchrun`` and Kubernetes'
PyTorchJob) starts one process per device and sets ``RANK``, ``WORLD_SIZE`` and
``LOCAL_RANK``. Two uses share this module:

- **Chains across processes**: :class:`~pyro_bdl.inference.Chains` runs chain ``c`` on
  rank ``c mod W`` and :func:`gather_to_root` brings the kept draws and statistics to
  rank 0, as CPU tensors, one bounded chunk at a time.
- **Data parallelism**: every fit averages (or sums) across ranks what each rank
  computed on its shard of a ``DistributedSampler`` DataLoader with :func:`all_reduce_`
  (and the same seed on every rank keeps their random draws equal).

Without a process group (a plain ``python script.py``) every function is the identity
of a world of one process, so the same code runs both ways.

FSDP: the weights pyro_bdl samples or fits are replicated (their gradients averaged here);
a frozen base too large for one device may be sharded with FSDP2's ``fully_shard`` on the
base's modules, never on a module holding random or point sites (their tensors are
substituted whole by ``torch.func.functional_call``).

Example::

    import pyro_bdl as bdl
    bdl.distributed.init_process_group()          # joins the torchrun job, if any
    net.to(bdl.distributed.device())              # cuda:LOCAL_RANK, or the CPU
    if bdl.distributed.rank() == 0:
        print("world of", bdl.distributed.world_size())
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta

import numpy as np
import pyro
import pyro.optim
import torch
import torch.distributed as dist

__all__ = [
    "DataParallelOptim",
    "all_reduce_",
    "average_gradients_",
    "average_gradients_at_each_step",
    "broadcast_",
    "device",
    "gather_to_root",
    "init_process_group",
    "is_distributed",
    "mean_of_sums_",
    "launched_world_size",
    "local_rank",
    "rank",
    "shared_seed",
    "sum_across_ranks",
    "world_size",
]

#: The most bytes one message of :func:`gather_to_root` carries (a chunk of draws).
GATHER_CHUNK_BYTES = 64 * 2**20

_cpu_group = None


def is_distributed() -> bool:
    """Whether this process is one of several in an initialised process group."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    """This process's rank (0 without a process group)."""
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    """The number of processes in the job (1 without a process group)."""
    return dist.get_world_size() if is_distributed() else 1


def launched_world_size() -> int:
    """The ``WORLD_SIZE`` a launcher such as torchrun set (1 if none), initialised or not."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def local_rank() -> int:
    """This process's index on its machine, ``LOCAL_RANK`` (0 if unset)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def device() -> torch.device:
    """This process's device: ``cuda:LOCAL_RANK`` when CUDA is there, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank() % torch.cuda.device_count())
    return torch.device("cpu")


def init_process_group(backend: str | None = None, timeout_s: float = 1800.0) -> bool:
    """Join the job a launcher started, if any; return whether there are several processes.

    Reads torchrun's environment (``MASTER_ADDR``, ``RANK``, ``WORLD_SIZE``). The backend
    is ``"nccl"`` when CUDA is there (after ``torch.cuda.set_device(LOCAL_RANK)``), else
    ``"gloo"``. Does nothing if the group exists or no launcher set ``WORLD_SIZE``.

    Example::

        if bdl.distributed.init_process_group():
            sampler = DistributedSampler(train_set)

    :param str backend: ``"gloo"``, ``"nccl"`` or None for the default above.
    :param float timeout_s: how long a collective waits for the other ranks.
    """
    if dist.is_available() and dist.is_initialized():
        return is_distributed()
    if "WORLD_SIZE" not in os.environ or "MASTER_ADDR" not in os.environ:
        return False
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(device())
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return is_distributed()


def all_reduce_(tensors: Sequence[torch.Tensor], op: str = "sum") -> None:
    """Sum (``op="sum"``) or average (``op="mean"``) tensors across ranks, in place.

    Tensors of one dtype and device travel as one flat buffer: one collective per
    kind, not one per tensor (the bucketing of ``DistributedDataParallel``).

    :param tensors: the tensors to reduce, the same shapes on every rank.
    :param str op: ``"sum"`` or ``"mean"``.
    """
    if op not in ("sum", "mean"):
        raise ValueError(f'op must be "sum" or "mean", got {op!r}')
    if not is_distributed():
        return
    for bucket in _buckets(tensors):
        flat = torch.cat([t.detach().reshape(-1) for t in bucket])
        dist.all_reduce(flat)
        if op == "mean":
            flat /= dist.get_world_size()
        _copy_back(flat, bucket)


def broadcast_(tensors: Sequence[torch.Tensor], src: int = 0) -> None:
    """Overwrite ``tensors`` on every rank with rank ``src``'s values, in place."""
    if not is_distributed():
        return
    for bucket in _buckets(tensors):
        flat = torch.cat([t.detach().reshape(-1) for t in bucket])
        dist.broadcast(flat, src)
        _copy_back(flat, bucket)


def shared_seed(seed: int | None = None) -> int:
    """``seed``, or a fresh random seed drawn on rank 0 and the same on every rank."""
    if seed is not None:
        return seed
    value = torch.randint(0, 2**62, (1,), dtype=torch.int64)
    if is_distributed():
        dist.broadcast(value, 0, group=_cpu_group_for_collectives())
    return int(value)


def sum_across_ranks(*values: float | torch.Tensor) -> tuple:
    """``values`` (numbers or tensors) summed over the ranks; numbers come back as floats."""
    if not is_distributed():
        return values
    tensors = [torch.as_tensor(v, dtype=torch.float64).detach().clone() for v in values]
    all_reduce_(tensors)
    return tuple(t.to(v) if torch.is_tensor(v) else float(t) for t, v in zip(tensors, values))


# -- data parallelism: one way to average gradients ---------------------------------------
#
# Each rank's minibatch log joint is scaled N / B_local, an unbiased estimate of the full
# data's; their average over W ranks is the estimate of the global batch of W * B_local
# examples, exactly what one process computes with that batch. Every fit averages its
# gradients right before its update, in an order fixed across ranks (by parameter name, or
# the optimiser's own list), bucketed by dtype and device.


def average_gradients_(params: Sequence[torch.Tensor]) -> None:
    """Average the ``.grad`` of ``params`` across ranks, in place (a missing one counts as 0).

    :param params: leaf tensors, in the same order on every rank.
    """
    if not is_distributed():
        return
    for param in params:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
    all_reduce_([param.grad for param in params], op="mean")


def mean_of_sums_(tensors: Sequence[torch.Tensor], count: int) -> int:
    """Turn each rank's sums of ``count`` terms into their mean over every rank's, in place.

    Gradient accumulation sums the gradients of a step's microbatches; dividing by the
    number of microbatches on all ranks gives the mean gradient of the step's whole batch,
    as ``DistributedDataParallel`` with ``no_sync`` and a loss divided by the accumulation
    steps does. Every rank holds the same ``count`` (the launchers' samplers give each rank
    the same number of batches, which ``DistributedDataParallel`` assumes too).

    :param tensors: the sums, the same shapes on every rank.
    :param int count: the terms each rank summed.
    :return: the number of terms of all ranks.
    """
    all_reduce_(tensors)
    total = count * world_size()
    if total != 1:
        torch._foreach_div_(list(tensors), float(total))
    return total


def average_gradients_at_each_step(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Make ``optimizer.step()`` first average its parameters' gradients across ranks.

    A step pre-hook, registered once; without a process group it does nothing. Returns the
    optimiser.
    """
    if is_distributed() and not getattr(optimizer, "_pyro_bdl_averaged", False):

        def average(optimizer, args, kwargs):
            average_gradients_([p for group in optimizer.param_groups for p in group["params"]])

        optimizer.register_step_pre_hook(average)
        optimizer._pyro_bdl_averaged = True
    return optimizer


class DataParallelOptim(pyro.optim.PyroOptim):
    """A ``pyro.optim`` optimiser that averages its parameters' gradients across ranks.

    What ``pyro.optim.HorovodOptimizer`` does for Horovod, on ``torch.distributed``: at
    each ``SVI.step`` the parameters' gradients are averaged (in the order of their names,
    the same on every rank), then the wrapped optimiser steps. pyro_bdl's fits
    (``fit_map``, ``LaplaceGuide.fit``, the baselines) wrap their optimiser in it; wrap
    yours for an SVI loop of your own. Without a process group it is the wrapped optimiser.

    Example::

        optim = bdl.distributed.DataParallelOptim(pyro.optim.Adam({"lr": 1e-3}))
        svi = SVI(model, MeanFieldGuide(model), optim, TraceMeanField_ELBO())

    :param pyro.optim.PyroOptim pyro_optim: the optimiser to wrap.
    """

    def __init__(self, pyro_optim: pyro.optim.PyroOptim):
        if isinstance(pyro_optim, DataParallelOptim):
            pyro_optim = pyro_optim.wrapped
        self.wrapped = pyro_optim
        super().__init__(
            pyro_optim.pt_optim_constructor, pyro_optim.pt_optim_args, pyro_optim.pt_clip_args
        )

    def __call__(self, params, *args, **kwargs) -> None:
        params = sorted(params, key=pyro.get_param_store().param_name)
        average_gradients_(params)
        super().__call__(params, *args, **kwargs)


def _buckets(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[tuple, list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    return list(groups.values())


def _copy_back(flat: torch.Tensor, bucket: list[torch.Tensor]) -> None:
    """Copy the pieces of ``flat`` into ``bucket``'s tensors (leaves requiring grad too)."""
    pieces = flat.split([t.numel() for t in bucket])
    with torch.no_grad():
        torch._foreach_copy_(bucket, [piece.view_as(t) for piece, t in zip(pieces, bucket)])


def _cpu_group_for_collectives():
    """A gloo group for CPU tensors (the default group if it is gloo already).

    NCCL moves only CUDA tensors; gathering draws as CPU tensors through it would copy
    every chunk to the GPU and back, so CPU traffic gets its own gloo group, created
    once, collectively.
    """
    global _cpu_group
    if dist.get_backend() == "gloo":
        return None
    if _cpu_group is None:
        _cpu_group = dist.new_group(backend="gloo")
    return _cpu_group


# -- gathering kept draws ---------------------------------------------------------------

Item = Mapping[str, torch.Tensor]  # name -> tensor of shape (n, ...), n draws


def gather_to_root(
    items: Mapping[int, Item],
    num_items: int,
    owner: Callable[[int], int] | None = None,
    chunk_bytes: int | None = None,
) -> list[dict[str, torch.Tensor]] | None:
    """Bring every rank's items (chains, ensemble members) to rank 0, in item order.

    Item ``i`` lives on rank ``owner(i)`` (default ``i mod W``) as a dict of tensors (on any
    device) that share a leading dimension (draws). Each owner sends a small JSON header
    (names, shapes, dtypes; never a pickle) and then the tensors in slices of at most
    ``chunk_bytes`` along the leading dimension, copied to the CPU a slice at a time; rank
    0 receives each slice in place into the result, so no rank holds more than one chunk
    in flight beyond its own items and rank 0's result.

    Example::

        chains = gather_to_root({c: draws[c] for c in mine}, num_chains)
        if chains is not None:               # rank 0
            grouped = {k: torch.stack([c[k] for c in chains]) for k in chains[0]}

    :param dict items: this rank's items, item index -> dict of arrays.
    :param int num_items: the number of items on all ranks together.
    :param owner: item index -> rank that holds it.
    :param int chunk_bytes: the most bytes of one message (default ``GATHER_CHUNK_BYTES``).
    :return: on rank 0 the list of all items as dicts of CPU tensors; None on other ranks.
        Without a process group, the items as CPU tensors.
    """
    owner = owner or (lambda i: i % world_size())
    chunk_bytes = chunk_bytes or GATHER_CHUNK_BYTES
    me = rank()
    group = _cpu_group_for_collectives() if is_distributed() else None
    gathered = [] if me == 0 else None
    for index in range(num_items):
        source = owner(index)
        if source == me:
            if index not in items:
                raise KeyError(f"gather_to_root: item {index} belongs to this rank but is missing")
            if me == 0:
                gathered.append({k: v.detach().cpu() for k, v in items[index].items()})
            else:
                _send_item(items[index], group, chunk_bytes)
        elif me == 0:
            gathered.append(_receive_item(source, group, chunk_bytes))
    return gathered


def _header(item: Item) -> dict:
    return {
        name: [list(value.shape), str(value.dtype).removeprefix("torch.")]
        for name, value in item.items()
    }


def _send_item(item: Item, group, chunk_bytes: int) -> None:
    encoded = json.dumps(_header(item)).encode()
    dist.send(torch.tensor([len(encoded)], dtype=torch.int64), 0, group=group)
    dist.send(torch.frombuffer(bytearray(encoded), dtype=torch.uint8), 0, group=group)
    for value in item.values():
        for start, stop in _slices(value.shape, value.element_size(), chunk_bytes):
            dist.send(value[start:stop].detach().cpu().contiguous(), 0, group=group)


def _receive_item(source: int, group, chunk_bytes: int) -> dict[str, torch.Tensor]:
    length = torch.empty(1, dtype=torch.int64)
    dist.recv(length, source, group=group)
    encoded = torch.empty(int(length), dtype=torch.uint8)
    dist.recv(encoded, source, group=group)
    header = json.loads(bytes(encoded.numpy()).decode())
    item = {}
    for name, (shape, dtype) in header.items():
        value = torch.empty(shape, dtype=getattr(torch, dtype))
        for start, stop in _slices(value.shape, value.element_size(), chunk_bytes):
            dist.recv(value[start:stop], source, group=group)
        item[name] = value
    return item


def _slices(shape: Sequence[int], itemsize: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """Ranges of the leading dimension holding at most ``chunk_bytes`` each (at least one row)."""
    if len(shape) == 0:
        raise ValueError("gather_to_root: arrays need a leading dimension (draws)")
    row_bytes = max(1, itemsize * int(np.prod(shape[1:], dtype=np.int64)))
    step = max(1, chunk_bytes // row_bytes)
    return [(start, min(start + step, shape[0])) for start in range(0, shape[0], step)]
