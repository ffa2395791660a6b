"""A chain on disk: its kept draws and its state, so an interrupted run resumes.

Layout of chain ``c``'s directory under the kernel's ``checkpoint``::

    chain_<c>/state.safetensors   parameters, auxiliary state (momenta, thermostat), the
                                  warm-up adaptation (mass, squared gradients) and RNG
                                  states as plain tensors; settings, counters and the
                                  adapted step size as JSON in the file's metadata
    chain_<c>/draws.zarr/         the kept draws and statistics, a chunked array store
                                  (:mod:`~pyro_bdl.inference.sgmcmc.store`)

Loading never runs code: the state is safetensors (a JSON header and raw numbers, not a
pickle), the draws a zarr format 3 store of plain numbers, so a checkpoint directory from
someone else cannot execute anything on resume. A directory holding the pickled
``state.pt`` of earlier versions is refused.

The state is written atomically (a new file replacing the old) every ``checkpoint_every``
iterations, whenever a chunk of draws is full, and when the chain ends; the draws are
written just before it, so the store never holds draws that the state does not know. A
kernel set up on a directory that holds a state with the same settings replays the
finished iterations to ``pyro.infer.MCMC`` (kept draws are read back, nothing is
recomputed) and continues from the saved state; draws kept after the last saved state are
recomputed. The DataLoader order after a resume is a fresh shuffle, so a resumed chain is a
valid continuation rather than a bit-identical one.

A data-parallel chain (``MCMC`` under torchrun) is written by rank 0 and resumed by every
rank from the same directory, which must then be on a shared file system.

The chain resumes on the device its parameters are on now (the saved tensors are read to
the CPU and copied in: ``map_location`` in effect); the RNG state of that device is
restored when it was saved from the same kind of device.
"""

from __future__ import annotations

import inspect
import json
import multiprocessing
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from pyro_bdl import distributed
from pyro_bdl.inference.sgmcmc.store import DrawStore

__all__ = ["Checkpoint", "DistributedChainsError", "chain_number", "read_state"]

_FORMAT = "pyro_bdl.sgmcmc.checkpoint/2"


class Checkpoint:
    """The on-disk record of one chain of an SGMCMC kernel.

    Nothing is read or written until the chain's first step (:meth:`replaying`), so a
    kernel set up only to learn its transforms (``pyro.infer.MCMC`` does this in its main
    process after running chains in worker processes) never touches the directory.

    :param Path root: the kernel's checkpoint directory.
    :param kernel: the :class:`~pyro_bdl.inference.sgmcmc.base.SGMCMCKernel` it records.
    :param int chain: the chain's number; its directory is ``root / f"chain_{chain}"``.
    """

    def __init__(self, root: Path, kernel, chain: int = 0):
        self.directory = Path(root) / f"chain_{chain}"
        self.kernel = kernel
        self.chain = chain
        self.resume_iteration = 0
        self._saved_iteration = 0
        self._draws: DrawStore | None = None
        self._replay_block: tuple[int, dict[str, torch.Tensor]] | None = None

    @property
    def state_path(self) -> Path:
        return self.directory / "state.safetensors"

    @property
    def num_draws(self) -> int:
        """Draws kept so far (written or waiting to be)."""
        return 0 if self._draws is None else len(self._draws)

    def settings(self) -> dict:
        kernel = self.kernel
        settings = {
            **kernel.hyperparameters(),
            "warmup_steps": kernel.run.warmup_steps,
            "sites": {name: list(theta.shape) for name, theta in kernel.state.params.items()},
        }
        return json.loads(json.dumps(settings))  # as it reads back from disk

    # -- opening and restoring -------------------------------------------------------

    def _open(self) -> None:
        legacy = self.directory / "state.pt"
        if legacy.exists():
            raise ValueError(
                f"checkpoint: {legacy} is a pickled state of an earlier pyro_bdl; it is not "
                "loaded because unpickling can run arbitrary code. Start a new checkpoint "
                "directory"
            )
        # A data-parallel chain is one chain on every rank: rank 0 writes it, and every
        # rank resumes from the same directory (a shared file system).
        self._writer = not self.kernel.run.data_parallel or distributed.rank() == 0
        if self._writer:
            self.directory.mkdir(parents=True, exist_ok=True)
        self._draws = DrawStore(self.directory / "draws.zarr", self.chain)
        if self.state_path.exists():
            self._restore()
        elif self._writer:
            self._draws.truncate(0)

    def _restore(self) -> None:
        tensors, state = read_state(self.state_path)
        settings = self.settings()
        if state["settings"] != settings:
            raise ValueError(
                f"checkpoint: {self.directory} holds a chain with settings {state['settings']}, "
                f"not {settings}; use a new directory for a different run"
            )
        kernel = self.kernel
        chain = kernel.state
        with torch.no_grad():
            for name, theta in chain.params.items():
                theta.copy_(tensors[f"theta/{name}"])
            for name, target in chain.auxiliary().items():
                if isinstance(target, list):
                    saved = [tensors[f"aux/{name}/{i}"] for i in range(len(target))]
                    torch._foreach_copy_(target, [s.to(t.device) for s, t in zip(saved, target)])
                else:
                    target.copy_(tensors[f"aux/{name}"])
        if chain.adaptation is not None:
            prefix = "adaptation/"
            chain.adaptation.load_state(
                {k.removeprefix(prefix): t for k, t in tensors.items() if k.startswith(prefix)},
                state.get("adaptation"),
            )
        chain.step = state["step"]
        _set_rng_state(tensors, chain.theta[0].device)
        num_draws = state["num_draws"]
        if self._draws.num_written < num_draws:
            raise ValueError(
                f"checkpoint: {self.directory} has a state after {num_draws} draws but its "
                f"store holds {self._draws.num_written}; the store was changed or lost"
            )
        self._draws.truncate(num_draws)
        stats = self._draws.stats(num_draws)
        kernel.kept.stats = {key: stats.get(key, []) for key in kernel.kept.stats}
        self.resume_iteration = self._saved_iteration = state["iteration"]

    # -- the chain's steps -------------------------------------------------------------

    def replaying(self, iteration: int) -> bool:
        """Whether ``iteration`` was finished before the saved state (opens the record)."""
        if self._draws is None:
            self._open()
        return iteration < self.resume_iteration

    def replay(self, iteration: int) -> dict[str, torch.Tensor]:
        """What the kernel returned at a finished iteration (unconstrained values)."""
        kernel = self.kernel
        if iteration < kernel.run.warmup_steps:
            return {name: theta.detach() for name, theta in kernel.state.params.items()}
        index = iteration - kernel.run.warmup_steps
        start, block = self._replay_block or (-1, {})
        if not start <= index < start + len(next(iter(block.values()), ())):
            start = index
            stop = min(index + self._draws.draws_per_chunk, self._draws.num_written)
            block = self._draws.read(start, stop)
            self._replay_block = (start, block)
        return {
            name: kernel.target.unconstrain(
                name, value[index - start].to(kernel.state.params[name].device)
            )
            for name, value in block.items()
        }

    def save_draw(self, index: int, draw: dict[str, torch.Tensor], iterations_done: int) -> None:
        """Keep draw ``index``; write the draws and the state if a chunk is full or it is time."""
        if not self._writer:
            return
        stats = {key: values[-1] for key, values in self.kernel.kept.stats.items()}
        self._draws.append(draw, stats)
        if self._draws.chunk_is_full or iterations_done % self.kernel.checkpoint_every == 0:
            self.save_state(iterations_done)

    def save_state(self, iterations_done: int) -> None:
        """Write the draws waiting in memory, then the chain's state after ``iterations_done``."""
        kernel = self.kernel
        if not self._writer:
            return
        self._draws.flush()
        chain = kernel.state
        tensors = {f"theta/{name}": theta for name, theta in chain.params.items()}
        for name, value in chain.auxiliary().items():
            if isinstance(value, list):
                tensors.update({f"aux/{name}/{i}": t for i, t in enumerate(value)})
            else:
                tensors[f"aux/{name}"] = value
        adaptation = None
        if chain.adaptation is not None:
            adapted, adaptation = chain.adaptation.state()
            tensors.update({f"adaptation/{key}": t for key, t in adapted.items()})
        device = chain.theta[0].device
        tensors["rng/cpu"] = torch.get_rng_state()
        if device.type == "cuda":
            tensors["rng/cuda"] = torch.cuda.get_rng_state(device)
        state = {
            "format": _FORMAT,
            "settings": self.settings(),
            "iteration": iterations_done,
            "step": chain.step,
            "num_draws": self._draws.num_written,
            "adaptation": adaptation,
        }
        partial = self.state_path.with_suffix(".tmp")
        save_file(
            {key: t.detach().cpu().contiguous() for key, t in tensors.items()},
            partial,
            metadata={"state": json.dumps(state)},
        )
        os.replace(partial, self.state_path)
        self._saved_iteration = iterations_done

    def close(self) -> None:
        """Save what the chain did since the last saved state (at its end or interruption)."""
        kernel = self.kernel
        if self._draws is None or kernel.state.iteration <= self._saved_iteration:
            return
        if all(bool(torch.isfinite(theta).all()) for theta in kernel.state.theta):
            self.save_state(kernel.state.iteration)

    def draws(self) -> dict[str, torch.Tensor]:
        """Every kept draw of the chain so far, site -> ``(num_draws, *shape)``."""
        if self._draws is None or len(self._draws) == 0:
            return {}
        return self._draws.read(0, len(self._draws))

    @property
    def store(self) -> DrawStore | None:
        """The chain's draw store (None before the first step)."""
        return self._draws


def read_state(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """The tensors (on the CPU) and the JSON state of a ``state.safetensors`` file.

    :raises ValueError: if the file is not a pyro_bdl checkpoint state (a pickle, say).
    """
    try:
        with safe_open(path, framework="pt", device="cpu") as handle:
            metadata = handle.metadata() or {}
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
    except (SafetensorError, OSError, ValueError) as error:
        raise ValueError(
            f"checkpoint: {path} is not a safetensors file ({error}); a checkpoint's state is "
            "never unpickled, since unpickling can run arbitrary code"
        ) from None
    state = json.loads(metadata.get("state", "null"))
    if not isinstance(state, dict) or state.get("format") != _FORMAT:
        raise ValueError(f"checkpoint: {path} is not a pyro_bdl SGMCMC chain state")
    return tensors, state


def _set_rng_state(tensors: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(tensors["rng/cpu"])
    if device.type == "cuda" and "rng/cuda" in tensors:
        torch.cuda.set_rng_state(tensors["rng/cuda"], device)


class DistributedChainsError(RuntimeError):
    """``pyro.infer.MCMC(..., num_chains=K)`` was run inside a torchrun job.

    Pyro runs several chains in worker processes of its own (or one after another in
    every process), which cannot share out the job's ranks; :class:`Chains` runs chain
    ``c`` on rank ``c mod W``.
    """


def chain_number(explicit: int | None = None) -> int:
    """The number of the chain a kernel is being set up for.

    ``explicit`` when a runner such as :class:`~pyro_bdl.inference.Chains` says so;
    otherwise the chain ``pyro.infer.MCMC`` is starting: its worker processes are named by
    their chain, and when it draws several chains in one process its ``_gen_samples``
    holds the chain's number. A set-up outside any chain (MCMC learning the transforms in
    its main process) is chain 0, and a repeated ``mcmc.run`` of the same run is the same
    chain again, so it resumes rather than starting another.

    :raises DistributedChainsError: for ``MCMC(num_chains=K > 1)`` inside a torchrun job.
    """
    if explicit is not None:
        return explicit
    number = _pyro_chain_id()
    if number is not None and distributed.launched_world_size() > 1:
        raise DistributedChainsError(
            "pyro.infer.MCMC(kernel, num_chains=K) inside a torchrun job would run every "
            "chain in every process (or fork workers that cannot join the job); use "
            "pyro_bdl.inference.Chains(kernel, num_samples, warmup_steps, num_chains=K), which "
            "runs chain c on rank c mod world_size and gathers them on rank 0. MCMC with "
            "num_chains=1 runs one data-parallel chain across the job"
        )
    return number or 0


def _pyro_chain_id() -> int | None:
    """The chain number pyro.infer.MCMC is drawing, if it draws several (else None)."""
    name = multiprocessing.current_process().name
    if name.isdigit():  # pyro.infer.mcmc.api._MultiSampler names workers by chain
        return int(name)
    frame = inspect.currentframe()
    while frame is not None:
        code = frame.f_code
        if code.co_name == "_gen_samples" and frame.f_globals.get("__name__") == (
            "pyro.infer.mcmc.api"
        ):
            return frame.f_locals.get("chain_id")
        frame = frame.f_back
    return None
