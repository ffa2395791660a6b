"""Device plumbing of an SGMCMC chain: lagged reads of device scalars and the noise
that every rank of a data-parallel chain shares.

Nothing here knows the update; the kernels call it so that a step never waits for
the device (see :mod:`~pyro_bdl.inference.sgmcmc.base`).
"""

from __future__ import annotations

import torch

from pyro_bdl import distributed
from pyro_bdl.inference.sgmcmc._buffers import FlatBuffers

__all__ = ["LaggedRead", "Noise", "norm"]


class LaggedRead:
    """Reads a device scalar per step without stalling the device.

    On the CPU a value is read at once. On a GPU, reading a tensor waits for all the
    work queued before the read; instead each value is copied, right after it is
    computed, into pinned host memory with an event behind the copy, and read one
    step later, when the device finished that point long ago (the host has queued a
    whole forward and backward pass since).
    """

    def __init__(self):
        self._pending = None
        self._host: list[torch.Tensor] = []

    def push(
        self, value: torch.Tensor | float, context: object
    ) -> tuple[float | list[float], object] | None:
        """Queue ``value`` (a scalar, or a vector read as a list); return ``(value,
        context)`` of the entry now readable, if any."""
        if not torch.is_tensor(value) or value.device.type != "cuda":
            return read(value), context
        host = self._host[0] if self._host else None
        if host is None or host.dtype != value.dtype or host.shape != value.shape:
            self._host = [
                torch.empty(value.shape, dtype=value.dtype, pin_memory=True) for _ in range(2)
            ]
        host = self._host[0]
        self._host.reverse()  # alternate: the other buffer may still hold the pending read
        host.copy_(value, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        ready, self._pending = self._pending, (host, event, context)
        if ready is None:
            return None
        ready[1].synchronize()
        return read(ready[0]), ready[2]


def read(value: torch.Tensor | float) -> float | list[float]:
    """A device scalar as a float, a vector as a list of floats."""
    if torch.is_tensor(value) and value.dim() > 0:
        return value.tolist()
    return float(value)


class Noise:
    """Standard normal noise shaped like the parameters, one draw per dtype and device.

    The draw goes into one flat buffer per dtype and device, viewed per parameter (one
    kernel launch, not one per tensor). In a data-parallel chain every rank uses rank
    0's draw, so the ranks step one chain.

    :param list theta: the parameters the noise is shaped like.
    :param bool data_parallel: whether rank 0's draw is broadcast to every rank.
    """

    def __init__(self, theta: list[torch.Tensor], data_parallel: bool):
        self._buffers = FlatBuffers(theta)
        self._data_parallel = data_parallel

    def draw(self) -> list[torch.Tensor]:
        """Fresh N(0, I) noise, one view per parameter."""
        for flat in self._buffers.flats:
            flat.normal_()
        if self._data_parallel:
            distributed.broadcast_(self._buffers.flats)  # one draw, rank 0's, for every rank
        return self._buffers.views


def norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The Euclidean norm of a list of tensors as one vector, on the device."""
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(tensors)))
