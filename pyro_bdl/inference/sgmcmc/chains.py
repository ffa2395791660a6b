"""Several SGMCMC chains in one process: parallel SGMCMC as a Bayesian deep ensemble.

``pyro.infer.MCMC(..., num_chains=K)`` copies the model into K processes, which is
right for small models and wrong for a network that fills the memory once. ``Chains``
runs the K chains of one kernel one after the other in the current process, sharing
the module (and its frozen base), and returns draws grouped by chain with the same
interface as ``MCMC``. With ``num_samples=1`` each chain keeps its last draw: the
parallel SGMCMC of the posteriors paper (section 4.2), a Bayesian deep ensemble; at
``temperature=0`` it is an ordinary deep ensemble.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import pyro
import torch
from tqdm.auto import tqdm

from pyro_bdl.inference.sgmcmc.base import DivergenceError, SGMCMCKernel

__all__ = ["Chains"]


class Chains:
    """Run ``num_chains`` chains of an SGMCMC kernel in this process.

    Example::

        ensemble = Chains(SGHMC(model, step_size=1e-3), num_samples=1, warmup_steps=2000,
                          num_chains=8, init_params=lambda chain: reinitialise(chain))
        ensemble.run(train_loader, len(train_set))
        idata = bdl.to_arviz(ensemble)

    :param SGMCMCKernel kernel: the kernel; it is set up afresh for every chain.
    :param int num_samples: draws kept per chain (after warm-up and thinning).
    :param int warmup_steps: warm-up iterations per chain.
    :param int num_chains: number of chains.
    :param init_params: per-chain starting points: a callable ``chain -> dict`` of site
        values (or Pyro init strategy), or None for the kernel's own ``init_params``.
    :param int seed: if given, chain ``c`` runs with ``pyro.set_rng_seed(seed + c)``.
    :param bool disable_progbar: hide the progress bar.
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
        self.kernel = kernel
        self.num_samples = num_samples
        self.warmup_steps = warmup_steps
        self.num_chains = num_chains
        self.init_params = init_params
        self.seed = seed
        self.disable_progbar = disable_progbar
        self._samples: list[dict[str, torch.Tensor]] = []
        self._diagnostics: list[dict] = []

    def run(self, *args, **kwargs) -> None:
        """Run every chain not yet finished; the model's arguments as for ``MCMC.run``."""
        total = self.num_chains * (self.warmup_steps + self.num_samples)
        done = len(self._samples) * (self.warmup_steps + self.num_samples)
        with tqdm(total=total, initial=done, disable=self.disable_progbar, desc="Chains") as bar:
            for chain in range(len(self._samples), self.num_chains):
                self._samples.append(self._run_chain(chain, bar, args, kwargs))
                self._diagnostics.append(self.kernel.diagnostics())

    def _run_chain(self, chain: int, bar: tqdm, args: tuple, kwargs: dict) -> dict:
        kernel = self.kernel
        if self.seed is not None:
            pyro.set_rng_seed(self.seed + chain)
        if self.init_params is not None:
            kernel.init_params = self.init_params(chain)
        kernel._chains_started = chain
        kernel.setup(self.warmup_steps, *args, **kwargs)
        params = kernel.initial_params
        draws = []
        try:
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
            kernel.cleanup()
        constrained = {name: torch.stack([d[name] for d in draws]) for name in draws[0]}
        return {
            name: kernel.transforms[name].inv(value) if name in kernel.transforms else value
            for name, value in constrained.items()
        }

    def get_samples(self, num_samples: int | None = None, group_by_chain: bool = False):
        """Draws of every finished chain, as ``MCMC.get_samples`` returns them.

        :param int num_samples: if given, that many draws chosen at random (ungrouped).
        :param bool group_by_chain: shape ``(chain, draw, ...)`` instead of ``(draw, ...)``.
        """
        if not self._samples:
            return {}
        grouped = {
            name: torch.stack([chain[name] for chain in self._samples]) for name in self._samples[0]
        }
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
            key: {f"chain {i}": d[key] for i, d in enumerate(self._diagnostics)}
            for key in (self._diagnostics[0] if self._diagnostics else {})
        }
