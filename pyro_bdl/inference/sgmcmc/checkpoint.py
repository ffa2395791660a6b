"""A chain on disk: its kept draws and its state, so an interrupted run resumes.

Layout of a chain's directory::

    state.pt            settings, iteration, parameters, auxiliary state, statistics, RNG
    draw_0000000.pt     one kept draw per file (site name -> constrained value)

The state is written atomically after every kept draw and every
``checkpoint_every`` warm-up steps. A kernel set up on a directory that holds a
state with the same settings replays the finished iterations to ``pyro.infer.MCMC``
(kept draws are read back, nothing is recomputed) and continues from the saved
state; draws written after the last saved state are recomputed. The DataLoader
order after a resume is a fresh shuffle, so a resumed chain is a valid continuation
rather than a bit-identical one.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

__all__ = ["Checkpoint"]


class Checkpoint:
    """The on-disk record of one chain of an SGMCMC kernel.

    :param Path directory: the chain's directory (created if missing).
    :param kernel: the :class:`~pyro_bdl.inference.sgmcmc.base.SGMCMCKernel` it records.
    """

    def __init__(self, directory: Path, kernel):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.kernel = kernel
        self.resume_iteration = 0
        self.num_draws = 0

    @property
    def state_path(self) -> Path:
        return self.directory / "state.pt"

    def draw_path(self, index: int) -> Path:
        return self.directory / f"draw_{index:07d}.pt"

    def settings(self) -> dict:
        kernel = self.kernel
        return {
            **kernel.hyperparameters(),
            "warmup_steps": kernel._warmup_steps,
            "sites": {name: list(theta.shape) for name, theta in kernel._params.items()},
        }

    def restore(self) -> None:
        """Load the saved state into the kernel, if there is one."""
        if not self.state_path.exists():
            return
        state = torch.load(self.state_path, weights_only=False)
        if state["settings"] != self.settings():
            raise ValueError(
                f"checkpoint: {self.directory} holds a chain with settings {state['settings']}, "
                f"not {self.settings()}; use a new directory for a different run"
            )
        kernel = self.kernel
        with torch.no_grad():
            for theta, value in zip(kernel._theta, state["theta"]):
                theta.copy_(value)
            for name, target in kernel._state().items():
                saved = state["aux"][name]
                if isinstance(target, list):
                    torch._foreach_copy_(target, saved)
                else:
                    target.copy_(saved)
        kernel._step = state["step"]
        kernel._stats = state["stats"]
        torch.set_rng_state(state["rng"])
        self.resume_iteration = state["iteration"]
        self.num_draws = max(0, self.resume_iteration - kernel._warmup_steps)

    def replaying(self, iteration: int) -> bool:
        """Whether ``iteration`` was finished before the saved state."""
        return iteration < self.resume_iteration

    def replay(self, iteration: int) -> dict[str, torch.Tensor]:
        """What the kernel returned at a finished iteration (unconstrained values)."""
        kernel = self.kernel
        if iteration < kernel._warmup_steps:
            return {name: theta.detach() for name, theta in kernel._params.items()}
        draw = torch.load(self.draw_path(iteration - kernel._warmup_steps), weights_only=True)
        return {name: kernel._unconstrain(name, value) for name, value in draw.items()}

    def save_draw(self, index: int, draw: dict[str, torch.Tensor], iterations_done: int) -> None:
        """Write kept draw ``index`` and the state after it."""
        torch.save(draw, self.draw_path(index))
        self.num_draws = index + 1
        self.save_state(iterations_done)

    def save_state(self, iterations_done: int) -> None:
        kernel = self.kernel
        aux = {
            name: [t.detach().clone() for t in value]
            if isinstance(value, list)
            else value.detach().clone()
            for name, value in kernel._state().items()
        }
        state = {
            "settings": self.settings(),
            "iteration": iterations_done,
            "step": kernel._step,
            "theta": [t.detach().clone() for t in kernel._theta],
            "aux": aux,
            "stats": {key: list(values) for key, values in kernel._stats.items()},
            "rng": torch.get_rng_state(),
        }
        partial = self.state_path.with_suffix(".tmp")
        torch.save(state, partial)
        os.replace(partial, self.state_path)

    def load_draws(self) -> list[dict[str, torch.Tensor]]:
        """Every kept draw of the chain so far, in order."""
        return [torch.load(self.draw_path(i), weights_only=True) for i in range(self.num_draws)]
