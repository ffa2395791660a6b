"""Flat buffers shaped like a kernel's parameters: one allocation, one kernel launch."""

from __future__ import annotations

import torch


class FlatBuffers:
    """One flat tensor per (dtype, device) of a list of tensors, and a view per tensor.

    An operation on the flat tensors (a fill, a draw of noise) touches every view at
    once, instead of one launch per parameter tensor.
    """

    def __init__(self, like: list[torch.Tensor]):
        sizes: dict[tuple, int] = {}
        for t in like:
            key = (t.dtype, t.device)
            sizes[key] = sizes.get(key, 0) + t.numel()
        self.flats = [torch.empty(n, dtype=k[0], device=k[1]) for k, n in sizes.items()]
        flat_of = dict(zip(sizes, self.flats))
        offsets = dict.fromkeys(sizes, 0)
        self.views = []
        for t in like:
            key = (t.dtype, t.device)
            start = offsets[key]
            self.views.append(flat_of[key][start : start + t.numel()].view(t.shape))
            offsets[key] = start + t.numel()
