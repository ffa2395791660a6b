"""Kept draws off the device: copied one transfer per dtype, stacked where they are kept.

A method that keeps ``S`` draws of the weights (an SGMCMC chain, a guide's samples for
ArviZ) must not hold them on the GPU, where ``S`` copies of a large model's adapters
would grow with ``S``: each draw is copied to the CPU as it is made and the device holds
one draw at a time.

Example::

    draws = kept_draws(lambda: guide.sample_posterior(1), num_samples=1000)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

__all__ = ["copied_to", "kept_draws"]


def copied_to(values: Mapping[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Copies of ``values`` on ``device``: one flat transfer per dtype.

    A transfer from a GPU waits for the device, so one per site would wait once per site.

    :param dict values: name -> tensor, on any devices.
    :param torch.device device: where the copies go.
    :return: name -> a copy (never a view of the input, even on the same device).
    """
    copies = {}
    by_dtype: dict[torch.dtype, list[str]] = {}
    for name, value in values.items():
        by_dtype.setdefault(value.dtype, []).append(name)
    for names in by_dtype.values():
        # torch.cat always copies, even of one tensor already on the device.
        flat = torch.cat([values[n].detach().reshape(-1) for n in names]).to(device)
        for name, part in zip(names, flat.split([values[n].numel() for n in names])):
            copies[name] = part.view(values[name].shape)
    return {name: copies[name] for name in values}


def kept_draws(
    draw: Callable[[], Mapping[str, torch.Tensor]],
    num_samples: int,
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """``num_samples`` calls of ``draw``, each copied to ``device`` before the next is made.

    :param callable draw: makes one draw, name -> tensor (each call a fresh one).
    :param int num_samples: how many.
    :param device: where the draws are kept.
    :return: name -> ``(num_samples, *shape)`` on ``device``.
    """
    device = torch.device(device)
    kept = [copied_to(draw(), device) for _ in range(num_samples)]
    return {name: torch.stack([one[name] for one in kept]) for name in kept[0]}
