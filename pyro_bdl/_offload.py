"""Kept draws off the device: copied one transfer per dtype, stacked where they are kept,
and read back one at a time.

A method that keeps ``S`` draws of the weights (an SGMCMC chain, a guide's samples for
ArviZ) must not hold them on the GPU, where ``S`` copies of a large model's adapters
would grow with ``S``: each draw is copied to the CPU as it is made and the device holds
one draw at a time. Predictions read them back the same way, one draw at a time
(:func:`draw_at`), from tensors, NumPy or other arrays, or an ArviZ / xarray posterior
whose draws stay on disk until read.

Example::

    draws = kept_draws(lambda: guide.sample_posterior(1), num_samples=1000)
    first = draw_at(draws, 0)       # site -> tensor, one draw
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import torch

__all__ = ["copied_to", "kept_draws", "num_draws", "draw_at"]


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


def num_draws(samples: object) -> int:
    """The number of draws in ``samples``, checked.

    ``samples`` maps each site to its draws stacked in front, ``(S, *shape)``: torch
    tensors (``mcmc.get_samples()``, ``Chains.get_samples()``), NumPy arrays, or any array
    with a ``shape`` that is indexed by draw (zarr, dask); or it is an xarray ``Dataset``
    (or ``DataTree`` / ArviZ object with a ``posterior`` group) whose variables are
    ``(chain, draw, *shape)``, as ``bdl.to_arviz(checkpoint_dir)`` opens a store from disk.
    There the chains are read one after the other, ``S = chains * draws``.

    :param samples: the draws.
    :return: ``S``.
    """
    samples = _posterior_group(samples)
    if _is_xarray(samples):
        sizes = samples.sizes
        if "chain" not in sizes or "draw" not in sizes or not samples.data_vars:
            raise ValueError(
                "samples: an xarray posterior must have variables with dimensions "
                f"(chain, draw, ...), got dimensions {dict(sizes)}"
            )
        return int(sizes["chain"] * sizes["draw"])
    if not isinstance(samples, Mapping):
        raise TypeError(
            "samples must be a dict of draws (site -> (S, *shape)), an xarray posterior or "
            f"None, got {type(samples).__name__}"
        )
    if not samples:
        raise ValueError("samples is an empty dict; pass draws of the model's latent sites")
    sizes = {}
    for name, value in samples.items():
        shape = getattr(value, "shape", None)
        if shape is None or not hasattr(value, "__getitem__"):
            raise TypeError(
                f"samples[{name!r}] must be a tensor of draws (S, *shape), got "
                f"{type(value).__name__}"
            )
        if len(shape) == 0 or shape[0] == 0:
            raise ValueError(f"samples[{name!r}] has shape {tuple(shape)}: no draws")
        sizes[name] = int(shape[0])
    if len(set(sizes.values())) > 1:
        raise ValueError(f"samples: the sites have different numbers of draws {sizes}")
    return next(iter(sizes.values()))


def draw_at(samples: object, index: int) -> dict[str, torch.Tensor]:
    """Draw ``index`` of every site of ``samples`` (see :func:`num_draws`), as tensors.

    Only that draw is read: an array on disk reads one draw, not all of them.

    :param samples: the draws.
    :param int index: which draw, in ``[0, S)``.
    :return: site -> tensor of the site's shape.
    """
    samples = _posterior_group(samples)
    if _is_xarray(samples):
        chain, draw = divmod(index, samples.sizes["draw"])
        return {
            str(name): torch.as_tensor(np.asarray(value.isel(chain=chain, draw=draw).values))
            for name, value in samples.data_vars.items()
        }
    return {name: _tensor(value[index]) for name, value in samples.items()}


def _posterior_group(samples: object) -> object:
    """The posterior of an ArviZ / xarray tree, as a Dataset; anything else unchanged."""
    children = getattr(samples, "children", None)
    if children is not None and "posterior" in children:  # the root of bdl.to_arviz(...)
        samples = children["posterior"]
    if hasattr(samples, "children") and callable(getattr(samples, "to_dataset", None)):
        samples = samples.to_dataset()  # a DataTree node
    return samples


def _is_xarray(samples: object) -> bool:
    return hasattr(samples, "data_vars") and hasattr(samples, "sizes")


def _tensor(value: object) -> torch.Tensor:
    return value if torch.is_tensor(value) else torch.as_tensor(np.asarray(value))
