"""The likelihood of a minibatch: a Pyro plate over the batch scaled by N / B."""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import torch
from pyro.poutine.runtime import get_plates

__all__ = ["observe"]


def observe(
    name: str,
    distribution: dist.TorchDistribution,
    obs: torch.Tensor | None = None,
    num_data: int | None = None,
    *,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Observe a minibatch of ``B`` examples out of ``num_data``.

    The first batch dimension of ``distribution`` is the minibatch; it becomes a
    ``pyro.plate`` of size ``num_data`` subsampled to ``B``, so Pyro scales the log
    likelihood by ``num_data / B`` and a minibatch gives an unbiased estimate of the
    full-data log likelihood. Further batch dimensions (tokens of a sequence, say)
    are summed within each example. ``obs=None`` samples the observation
    (prediction).

    Example::

        logits = net(x)
        bdl.observe("y", dist.Categorical(logits=logits), obs=y, num_data=len(train_set))

    :param str name: the site name.
    :param distribution: the likelihood of the batch, batch shape ``(B, ...)``.
    :param torch.Tensor obs: observed values, shape ``batch_shape + event_shape``, or None.
    :param int num_data: size of the full data set (default: ``B``, no scaling).
    :param torch.Tensor mask: optional boolean mask of shape ``batch_shape`` (False drops
        an entry, e.g. a padding token).
    :return: the observed (or sampled) value.
    """
    batch_shape = distribution.batch_shape
    if len(batch_shape) == 0:
        raise ValueError(
            f"observe({name!r}): the distribution has no batch dimension; its first batch "
            "dimension must be the minibatch (e.g. Categorical(logits=logits) with logits "
            "of shape (B, classes))"
        )
    # Plates around the call (Predictive(..., parallel=True) draws weights in one) own
    # the leading batch dimensions; the minibatch comes after them.
    outer = max((-frame.dim for frame in get_plates() if frame.dim is not None), default=1) - 1
    outer = min(outer, len(batch_shape) - 1)
    batch_size = batch_shape[outer]
    if obs is not None:
        expected = batch_shape + distribution.event_shape
        if obs.shape not in (expected, expected[outer:]):
            raise ValueError(
                f"observe({name!r}): obs has shape {tuple(obs.shape)} but the distribution "
                f"expects {tuple(expected)} (batch {tuple(batch_shape)}, event "
                f"{tuple(distribution.event_shape)}); the first dimension of obs must be the "
                "minibatch"
            )
    if mask is not None:
        if mask.shape not in (batch_shape, batch_shape[outer:]):
            raise ValueError(
                f"observe({name!r}): mask has shape {tuple(mask.shape)}, expected the batch "
                f"shape {tuple(batch_shape)}"
            )
        distribution = distribution.mask(mask.bool())
    if num_data is None:
        num_data = batch_size
    elif isinstance(num_data, bool) or not isinstance(num_data, int) or num_data < batch_size:
        raise ValueError(
            f"observe({name!r}): num_data must be an int at least the minibatch size "
            f"{batch_size} (the size of the whole training set), got {num_data!r}"
        )
    distribution = distribution.to_event(len(batch_shape) - 1 - outer)
    # Passing the subsample indices ourselves keeps Pyro from drawing a random
    # permutation of num_data at every step: the DataLoader already chose the batch.
    indices = torch.arange(batch_size)
    with pyro.plate(f"{name}_data", size=num_data, subsample=indices):
        return pyro.sample(name, distribution, obs=obs)
