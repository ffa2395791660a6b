"""The likelihood of a minibatch: a Pyro plate over the batch scaled by N / B."""

from __future__ import annotations

import math

import pyro
import pyro.distributions as dist
import torch
from pyro.poutine.runtime import get_plates

from pyro_bdl._checks import instance, integer, is_real

__all__ = ["observe", "ObservationError", "invalid_observations", "NUM_DATA_KEY"]

#: The key under which :func:`observe` records, in the site's ``infer`` dict, the
#: data-set size N its log likelihood is scaled to (None when none was given: the
#: batch counts once; read by
#: :func:`pyro_bdl.inference.log_joint.observed_num_data`).
NUM_DATA_KEY = "bdl_num_data"


class ObservationError(ValueError):
    """Observed values outside the support of their likelihood (e.g. a label 5 for 4
    classes)."""


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

    Observations outside the distribution's support (a label 5 for 4 classes, a
    negative count) are an error. Where the distribution validates its arguments
    (Pyro's default) :func:`observe` raises at once. Where validation is off, as in
    ``pyro.infer.MCMC``, it does not read the device: such an observation is replaced
    by a valid value, so that no index runs out of bounds on a GPU, and its log
    likelihood is made NaN, which the SGMCMC kernels' finiteness check reports as
    this error, naming the step.

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
    instance("name", name, str, "a site name (str)")
    instance("distribution", distribution, torch.distributions.Distribution, "a Pyro distribution")
    if obs is not None:
        instance("obs", obs, torch.Tensor, "a tensor of observed values or None")
    if num_data is not None:
        num_data = integer("num_data", num_data, low=1)
    if mask is not None:
        instance("mask", mask, torch.Tensor, "a boolean tensor or None")
        if mask.is_floating_point() or mask.is_complex():
            raise TypeError(
                f"mask must be a boolean (or 0 / 1 integer) tensor, got dtype {mask.dtype}"
            )
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
    if batch_size == 0:
        raise ValueError(f"observe({name!r}): the batch is empty (batch shape {batch_shape})")
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
    infer = {NUM_DATA_KEY: num_data}
    if num_data is None:
        num_data = batch_size
    else:
        if num_data < batch_size:
            raise ValueError(
                f"observe({name!r}): num_data must be the size of the whole training set, at "
                f"least the minibatch size {batch_size}, got {num_data}"
            )
    scale = 1.0
    per_example = len(batch_shape) - 1 - outer  # batch dims summed within an example
    if obs is not None and not is_real(distribution.support):
        obs, scale = _check_support(name, distribution, obs, per_example, mask)
    distribution = distribution.to_event(per_example)
    # Passing the subsample indices ourselves keeps Pyro from drawing a random
    # permutation of num_data at every step: the DataLoader already chose the batch.
    indices = torch.arange(
        batch_size, device=obs.device if obs is not None else _device(distribution)
    )
    with (
        pyro.plate(f"{name}_data", size=num_data, subsample=indices),
        pyro.poutine.scale(scale=scale),
    ):
        return pyro.sample(name, distribution, obs=obs, infer=infer)


def _check_support(name: str, distribution, obs: torch.Tensor, per_example: int, mask=None):
    """``obs`` made safe to score and the scale that marks invalid examples, or an error
    (entries the mask drops, such as padding labels, may hold anything).

    :return: ``(obs, scale)``: with validation, ``obs`` itself and 1 (or a ValueError);
        without, invalid entries replaced by a valid value and a scale that is NaN on
        the examples that hold them, read by whoever checks the log joint for NaN.
    """
    support = distribution.support
    inside = support.check(obs)
    if mask is not None:
        inside = inside | ~mask.bool()
    if getattr(distribution, "_validate_args", False):
        if not bool(inside.all()):
            raise ObservationError(_outside_support_message(name, distribution, obs, inside))
        return obs, 1.0
    if support.is_discrete and support.event_dim == 0 and inside.shape == obs.shape:
        # Categorical indexes its logits with the label: out of range is a device
        # assertion on a GPU, so score a valid label and mark the example instead.
        obs = torch.where(inside, obs, _lowest_value(support, obs))
    valid = inside.flatten(inside.dim() - per_example).all(-1) if per_example else inside
    scale = torch.where(valid, 1.0, math.nan).to(_real_dtype(obs))
    return obs, scale


def invalid_observations(trace: pyro.poutine.Trace) -> list[str]:
    """The observed sites of a trace made with validation off whose observations
    :func:`observe` found outside the support (one read of the device per such site).
    """
    return [
        name
        for name, site in trace.nodes.items()
        if site["type"] == "sample"
        and NUM_DATA_KEY in site["infer"]
        and torch.is_tensor(site["scale"])
        and bool(torch.isnan(site["scale"]).any())
    ]


def _outside_support_message(name, distribution, obs, inside) -> str:
    bad = (~inside).nonzero()
    positions = [tuple(i) if len(i) > 1 else i[0] for i in bad[:5].tolist()]
    values = obs[tuple(bad[:5].T)].tolist() if inside.shape == obs.shape else "see positions"
    kind = type(getattr(distribution, "base_dist", distribution)).__name__
    return (
        f"observe({name!r}): obs has {len(bad)} value(s) outside the support "
        f"{distribution.support} of the {kind} likelihood, e.g. {values} at batch "
        f"position(s) {positions}; labels must be valid for the likelihood (class "
        "indices in [0, classes - 1] for a Categorical)"
    )


def _lowest_value(support, like: torch.Tensor) -> torch.Tensor:
    lower = getattr(support, "lower_bound", 0)
    return torch.as_tensor(lower, dtype=like.dtype, device=like.device)


def _real_dtype(like: torch.Tensor) -> torch.dtype:
    return like.dtype if like.is_floating_point() else torch.get_default_dtype()


def _parameter(distribution, floating: bool = False) -> torch.Tensor | None:
    """A tensor parameter of a distribution, for its device and dtype (lazy parameters,
    such as the ``probs`` of a ``Categorical`` given ``logits``, are not computed)."""
    while distribution is not None:
        for key in getattr(distribution, "arg_constraints", {}):
            value = distribution.__dict__.get(key)
            if torch.is_tensor(value) and (value.is_floating_point() or not floating):
                return value
        distribution = getattr(distribution, "base_dist", None)
    return None


def _device(distribution) -> torch.device:
    parameter = _parameter(distribution)
    return torch.device("cpu") if parameter is None else parameter.device
