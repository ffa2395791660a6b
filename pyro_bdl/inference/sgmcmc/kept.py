"""The draws a chain keeps: their sample statistics, the values themselves (in memory or
in the chain's checkpoint) and the convergence check that follows them."""

from __future__ import annotations

from collections.abc import Callable

import torch

from pyro_bdl.inference.sgmcmc.checkpoint import Checkpoint
from pyro_bdl.inference.sgmcmc.convergence import ConvergenceMonitor

__all__ = ["KeptDraws"]


class KeptDraws:
    """The kept draws of one chain.

    :param list stat_names: the sample statistics recorded with each draw.
    :param dict params: the chain's parameters (which coordinates the convergence
        monitor follows).
    :param checkpoint: the chain's :class:`~pyro_bdl.inference.sgmcmc.checkpoint.Checkpoint`,
        where the draws go when there is one (they are then never held in memory).
    :param bool in_memory: without a checkpoint, keep the draws on the CPU.
    :ivar dict stats: statistic name -> one value per kept draw.
    :ivar monitor: the :class:`~pyro_bdl.inference.sgmcmc.convergence.ConvergenceMonitor`.
    """

    def __init__(
        self,
        stat_names: list[str],
        params: dict[str, torch.Tensor],
        checkpoint: Checkpoint | None,
        in_memory: bool,
    ):
        self.stats: dict[str, list[float]] = {key: [] for key in stat_names}
        self.monitor = ConvergenceMonitor(params)
        self.checkpoint = checkpoint
        self._in_memory = in_memory
        self._draws: list[dict[str, torch.Tensor]] = []

    def add(
        self,
        stats: dict[str, float],
        draw: Callable[[], dict[str, torch.Tensor]],
        index: int,
        iterations_done: int,
    ) -> None:
        """Keep draw ``index`` (``draw()`` gives its values on the CPU, asked only when
        they are kept) with its statistics, after ``iterations_done`` iterations."""
        for key in self.stats:
            self.stats[key].append(float(stats[key]))
        if self.checkpoint is not None:
            self.checkpoint.save_draw(index, draw(), iterations_done)
        elif self._in_memory:
            self._draws.append(draw())

    def draws(self) -> dict[str, torch.Tensor]:
        """The draws kept so far: name -> ``(num_draws, *shape)``, on the CPU."""
        if self.checkpoint is not None:
            return self.checkpoint.draws()
        draws = self._draws
        if not draws:
            return {}
        return {name: torch.stack([d[name] for d in draws]) for name in draws[0]}

    def sample_stats(self) -> dict[str, list[float]]:
        """A copy of the statistics."""
        return {key: list(values) for key, values in self.stats.items()}

    def release(self) -> None:
        """Drop the draws held in memory (Pyro has its own copy) and close the checkpoint."""
        self._draws = []
        if self.checkpoint is not None:
            self.checkpoint.close()
