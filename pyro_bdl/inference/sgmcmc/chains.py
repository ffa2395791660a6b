"""Several SGMCMC chains, in this process or across a torchrun job: parallel SGMCMC.

``pyro.infer.MCMC(..., num_chains=K)`` copies the model into K processes of its own,
which is right for small models and wrong for a network that fills the memory once, and
its forked workers cannot use CUDA or join a torchrun job. ``Chains`` runs the K chains
of one kernel in the processes the user launched:

- in one process, one chain after the other, sharing the module (and its frozen base);
- under ``torchrun --nproc_per_node=W`` (any number of nodes), chain ``c`` on rank
  ``c mod W``, each rank on its own device; chain ``c`` is seeded with ``seed + c`` on
  whichever rank runs it, so the draws do not depend on W. Rank 0 then gathers the kept
  draws and statistics of every chain, as CPU tensors a bounded chunk at a time
  (:func:`pyro_bdl.distributed.gather_to_root`); other ranks keep their own chains.

Draws come back grouped by chain with the interface of ``MCMC``. With ``num_samples=1``
each chain keeps its last draw: the parallel SGMCMC of the posteriors paper (section
4.2), a Bayesian deep ensemble; at ``temperature=0`` it is an ordinary deep ensemble,
trained by the same launcher.

With a kernel ``checkpoint``, chain ``c`` writes ``chain_<c>/`` (its state and a chunked
draw store) on the rank that runs it; a job restarted after a rank died resumes each
chain from its own store, and ``bdl.to_arviz(checkpoint_dir)`` opens all the chains'
stores lazily, merged by their chain coordinate.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import pyro
import torch
from tqdm.auto import tqdm

from pyro_bdl import distributed
from pyro_bdl.inference.sgmcmc.base import DivergenceError, SGMCMCKernel

__all__ = ["Chains"]

_STATS = "sample_stats/"


class Chains:
    """Run ``num_chains`` chains of an SGMCMC kernel, split across a torchrun job's ranks.

    Example::

        ensemble = Chains(SGHMC(model, step_size=1e-3), num_samples=1, warmup_steps=2000,
                          num_chains=8, init_params=lambda chain: reinitialise(chain), seed=0)
        ensemble.run(train_loader, len(train_set))
        idata = bdl.to_arviz(ensemble)       # all 8 chains on rank 0

    Launched as ``torchrun --nproc_per_node=4 script.py``, the same script runs chains
    0 and 4 on rank 0, 1 and 5 on rank 1, and so on.

    :param SGMCMCKernel kernel: the kernel; it is set up afresh for every chain.
    :param int num_samples: draws kept per chain (after warm-up and thinning).
    :param int warmup_steps: warm-up iterations per chain.
    :param int num_chains: number of chains.
    :param init_params: per-chain starting points: a callable ``chain -> dict`` of site
        values (or Pyro init strategy), or None for the kernel's own ``init_params``.
    :param int seed: chain ``c`` runs with ``pyro.set_rng_seed(seed + c)``. Without it a
        single process continues its global RNG from chain to chain, and a torchrun job
        draws one seed on rank 0 for all ranks.
    :param bool disable_progbar: hide the progress bar (shown on rank 0 only).
    """

    def __init__(
        self,
        kernel: SGMCMCKernel,
        num_samples: int,
        warmup_steps: int = 0,
        num_chains: int = 1,
        *,
        init_params: Callable[[int], Mapping[str, torch.Tensor] | Callable] | None = None,
        seed: int | None = None,
        disable_progbar: bool = False,
    ):
        if not isinstance(kernel, SGMCMCKernel):
            raise TypeError(f"kernel must be an SGMCMC kernel, got {type(kernel).__name__}")
        for name, value, least in (
            ("num_samples", num_samples, 1),
            ("warmup_steps", warmup_steps, 0),
            ("num_chains", num_chains, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
        if init_params is not None and not callable(init_params):
            raise TypeError("init_params must be a callable chain -> dict of site values")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise TypeError(f"seed must be an int or None, got {seed!r}")
        self.kernel = kernel
        self.num_samples = num_samples
        self.warmup_steps = warmup_steps
        self.num_chains = num_chains
        self.init_params = init_params
        self.seed = seed
        self.disable_progbar = disable_progbar
        # chain -> its draws (site -> (draw, ...)) and kernel diagnostics
        self._chains: dict[int, tuple[dict[str, torch.Tensor], dict]] = {}

    @property
    def chain_ids(self) -> list[int]:
        """The chains this process holds, in order: all of them on rank 0 after :meth:`run`."""
        return sorted(self._chains)

    @property
    def _diagnostics(self) -> list[dict]:
        return [self._chains[c][1] for c in self.chain_ids]

    def run(self, *args, **kwargs) -> None:
        """Run every chain of this rank not yet finished, then gather them all on rank 0.

        The model's arguments are as for ``MCMC.run``; with torchrun, call it on every rank.
        """
        rank, world = distributed.rank(), distributed.world_size()
        seed = self.seed
        if seed is None and world > 1:
            seed = self.seed = distributed.shared_seed()
        mine = [c for c in range(rank, self.num_chains, world) if c not in self._chains]
        steps = self.warmup_steps + self.num_samples
        with tqdm(
            total=len(mine) * steps,
            disable=self.disable_progbar or rank != 0,
            desc="Chains" if world == 1 else f"Chains (rank 0 of {world})",
        ) as bar:
            for chain in mine:
                if seed is not None:
                    pyro.set_rng_seed(seed + chain)
                draws = self._run_chain(chain, bar, args, kwargs)
                self._chains[chain] = (draws, self.kernel.diagnostics())
        if world > 1:
            self._gather()

    def _run_chain(self, chain: int, bar: tqdm, args: tuple, kwargs: dict) -> dict:
        kernel = self.kernel
        if self.init_params is not None:
            kernel.init_params = self.init_params(chain)
        kernel._chain_id = chain
        try:
            kernel.setup(self.warmup_steps, *args, **kwargs)
            params = kernel.initial_params
            draws = []
            for iteration in range(self.warmup_steps + self.num_samples):
                params = kernel.sample(params)
                if iteration >= self.warmup_steps:
                    draws.append({name: value.detach().clone() for name, value in params.items()})
                bar.set_postfix(chain=chain, **kernel.logging(), refresh=False)
                bar.update()
        except DivergenceError as error:
            error.args = (f"chain {chain}: {error.args[0]}",)
            raise
        finally:
            kernel._chain_id = None
            kernel.cleanup()
        constrained = {name: torch.stack([d[name] for d in draws]) for name in draws[0]}
        return {
            name: kernel.transforms[name].inv(value) if name in kernel.transforms else value
            for name, value in constrained.items()
        }

    def _gather(self) -> None:
        """Bring every chain's draws and statistics to rank 0, in chain order."""
        items = {}
        for chain, (draws, diagnostics) in self._chains.items():
            stats = diagnostics.get("sample_stats", {})
            items[chain] = {
                **draws,
                **{
                    _STATS + key: torch.tensor(values, dtype=torch.float64)
                    for key, values in stats.items()
                },
            }
        gathered = distributed.gather_to_root(items, self.num_chains)
        if gathered is None:
            return
        for chain, item in enumerate(gathered):
            draws = {name: value for name, value in item.items() if not name.startswith(_STATS)}
            stats = {
                name.removeprefix(_STATS): value.tolist()
                for name, value in item.items()
                if name.startswith(_STATS)
            }
            self._chains[chain] = (
                draws,
                {**self._chains.get(chain, ({}, {}))[1], "sample_stats": stats},
            )

    def get_samples(self, num_samples: int | None = None, group_by_chain: bool = False):
        """Draws of every chain this process holds, as ``MCMC.get_samples`` returns them.

        :param int num_samples: if given, that many draws chosen at random (ungrouped).
        :param bool group_by_chain: shape ``(chain, draw, ...)`` instead of ``(draw, ...)``.
        """
        if not self._chains:
            return {}
        chains = [self._chains[c][0] for c in self.chain_ids]
        grouped = {name: torch.stack([chain[name] for chain in chains]) for name in chains[0]}
        if group_by_chain:
            return grouped
        flat = {name: value.reshape(-1, *value.shape[2:]) for name, value in grouped.items()}
        if num_samples is None:
            return flat
        index = torch.randint(0, len(next(iter(flat.values()))), (num_samples,))
        return {name: value[index] for name, value in flat.items()}

    def diagnostics(self) -> dict:
        """Per-chain kernel diagnostics (sample statistics), keyed like ``MCMC.diagnostics``."""
        return {
            key: {f"chain {c}": self._chains[c][1][key] for c in self.chain_ids}
            for key in (self._diagnostics[0] if self._chains else {})
        }
