"""Run a function on W real processes joined by a gloo process group, as torchrun would."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pyro_bdl import distributed


def run_ranks(
    fn: Callable,
    *args,
    world_size: int = 2,
    timeout_s: float = 300.0,
    start_method: str = "fork",
) -> None:
    """Call ``fn(rank, *args)`` in ``world_size`` processes with torchrun's variables.

    Forked by default, not spawned: the children need not import torch and pyro again
    (seconds each). ``start_method="spawn"`` starts them afresh, for work that does not
    survive a fork of a parent that has computed with several threads (``fn`` must then be
    importable by name).
    Raises ``torch.multiprocessing.ProcessRaisedException`` / ``ProcessExitedException``
    if a rank fails (the others are then terminated), and ``TimeoutError`` if the ranks
    are not done within ``timeout_s`` seconds, so that a hang fails its test.
    """
    port = _free_port()
    context = mp.start_processes(
        _entry,
        args=(fn, world_size, port, args),
        nprocs=world_size,
        join=False,
        start_method=start_method,
    )
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=max(deadline - time.monotonic(), 0.0)):
        if time.monotonic() >= deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"the {world_size} ranks did not finish in {timeout_s:g} s")


def _entry(rank: int, fn: Callable, world_size: int, port: int, args: tuple) -> None:
    # The parent's OpenMP thread pool does not survive fork: the child's first parallel
    # region waits forever at libgomp's team barrier. One thread per rank never enters one
    # (and two ranks share the two cores anyway).
    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    distributed.init_process_group("gloo", timeout_s=60)
    try:
        fn(rank, *args)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
