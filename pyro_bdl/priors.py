"""Priors on the weights of a lifted network.

A prior gives, for each weight tensor that :func:`pyro_bdl.lift` makes random, the
Pyro distribution of that whole tensor: its ``event_shape`` equals the tensor's shape
and its ``batch_shape`` is empty. That one method is the protocol; anything that
implements it (a fitted Laplace posterior, say) can be the prior of the next fit.

Example::

    net = bdl.lift(model, prior=bdl.priors.IIDNormal(scale=0.2))
    net = bdl.lift(model, prior=bdl.priors.LayerwiseNormal.fan_in(gain=1.0))
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, runtime_checkable

import pyro.distributions as dist
import torch

from pyro_bdl._checks import function, instance, real, site_keys

__all__ = [
    "Prior",
    "IIDNormal",
    "LayerwiseNormal",
    "IsotropicNormal",
    "normal_prior",
    "normal_parameters",
]


@runtime_checkable
class Prior(Protocol):
    """The prior protocol: one distribution per weight tensor.

    ``prior.distribution(name, param)`` returns a distribution whose
    ``event_shape == param.shape`` and whose ``batch_shape == ()``, in ``param``'s
    dtype and device. ``name`` is the parameter's path in the module
    (``"encoder.layer.0.attention.self.query.lora_A.default.weight"``). A prior keyed by
    parameter name may also define ``check_names(names)``, which :func:`~pyro_bdl.lift`
    calls with the names of the lifted random weights, to refuse keys that name none.
    """

    def distribution(self, name: str, param: torch.Tensor) -> dist.TorchDistribution: ...


def normal_prior(param: torch.Tensor, loc: float | torch.Tensor, scale: float | torch.Tensor):
    """An independent normal over every entry of a tensor shaped like ``param``.

    The result is ``Normal(loc, scale).expand(param.shape).to_event(param.dim())``; with
    a scalar ``loc`` and ``scale`` its ``log_prob`` is computed as one inner product
    instead of elementwise over the expanded parameters (see :class:`IsotropicNormal`).

    :param torch.Tensor param: the weight the distribution is for (shape, dtype, device).
    :param loc: mean, a number or a tensor broadcastable to ``param``.
    :param scale: standard deviation, a number or a tensor broadcastable to ``param``.
    """
    instance("param", param, torch.Tensor, "the weight tensor the prior is for")
    if not param.is_floating_point():
        raise TypeError(f"param must be a floating-point tensor, got dtype {param.dtype}")
    if not torch.is_tensor(loc) and not torch.is_tensor(scale):
        return IsotropicNormal(real("loc", loc), real("scale", scale, positive=True), param)
    loc = _checked_tensor("loc", loc, param)
    scale = _checked_tensor("scale", scale, param, positive=True)
    return dist.Normal(loc, scale).expand(param.shape).to_event(param.dim())


def normal_parameters(
    distribution: torch.distributions.Distribution, like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The mean and standard deviation of an independent normal, shaped like ``like``.

    ``distribution`` may wrap its ``Normal`` in ``Independent`` and expanded layers, as
    :func:`normal_prior`, :class:`IsotropicNormal` and ``dist.Normal(...).expand(...)
    .to_event(...)`` do. Methods that treat a normal prior in closed form (the Laplace
    prior term, IVON's weight decay) read it with this.

    :param distribution: a site's distribution, e.g. a prior.
    :param torch.Tensor like: a value of the site (its shape).
    :return: ``(loc, scale)``, detached and broadcast to ``like.shape``; None if the
        distribution is not an independent normal.
    """
    base = distribution
    while isinstance(base, (dist.Independent, dist.ExpandedDistribution)):
        base = base.base_dist
    if not isinstance(base, torch.distributions.Normal):
        return None
    return base.loc.detach().expand(like.shape), base.scale.detach().expand(like.shape)


def _checked_tensor(name: str, value, param: torch.Tensor, positive: bool = False) -> torch.Tensor:
    """``value`` as a tensor like ``param``, finite (and positive), broadcastable to it."""
    if not torch.is_tensor(value):
        value = real(name, value, positive=positive)
    value = torch.as_tensor(value, dtype=param.dtype, device=param.device)
    if not bool(torch.isfinite(value).all()) or (positive and not bool((value > 0).all())):
        kind = "positive and finite" if positive else "finite"
        raise ValueError(f"{name} must be {kind} everywhere, got {value.flatten()[:5].tolist()}")
    try:
        torch.broadcast_shapes(value.shape, param.shape)
    except RuntimeError:
        raise ValueError(
            f"{name} has shape {tuple(value.shape)}, which does not broadcast to the "
            f"parameter's shape {tuple(param.shape)}"
        ) from None
    return value


class IsotropicNormal(dist.Independent):
    """``Normal(loc, scale)`` on every entry of a tensor, loc and scale numbers.

    It is exactly ``Normal(loc, scale).expand(shape).to_event(len(shape))`` (same
    ``base_dist``, sampling, KL registrations), but its ``log_prob`` costs one pass over
    the tensor: ``-||x - loc||^2 / (2 scale^2) - d (log scale + log(2 pi) / 2)``. The
    generic form takes the log of the expanded scale and several elementwise passes at
    every evaluation, which for a prior on a million weights costs more than the
    network's own forward pass.

    :param float loc: the mean of every entry.
    :param float scale: the standard deviation of every entry.
    :param torch.Tensor like: a tensor of the event shape, dtype and device.
    """

    def __init__(self, loc: float, scale: float, like: torch.Tensor, validate_args=None):
        loc, scale = real("loc", loc), real("scale", scale, positive=True)
        instance("like", like, torch.Tensor, "a tensor of the event shape, dtype and device")
        self.loc_value, self.scale_value = loc, scale
        base = dist.Normal(
            torch.tensor(loc, dtype=like.dtype, device=like.device).expand(like.shape),
            torch.tensor(scale, dtype=like.dtype, device=like.device).expand(like.shape),
        )
        super().__init__(base, like.dim(), validate_args=validate_args)
        self._log_normaliser = like.numel() * (math.log(scale) + 0.5 * math.log(2 * math.pi))

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        if self._validate_args:
            self._validate_sample(value)
        centred = value - self.loc_value if self.loc_value else value
        if value.shape == self.event_shape:
            flat = centred.reshape(-1)
            square = torch.dot(flat, flat)
        else:
            square = centred.pow(2).flatten(-len(self.event_shape)).sum(-1)
        return -0.5 * square / self.scale_value**2 - self._log_normaliser

    def expand(self, batch_shape, _instance=None):
        return dist.Independent(
            self.base_dist.expand(torch.Size(batch_shape) + self.event_shape),
            len(self.event_shape),
        )


class IIDNormal:
    """Independent ``Normal(loc, scale)`` on every entry of every random weight.

    The cold-posterior experiments of the posteriors paper use ``scale = 40 ** -0.5``
    (variance 1/40) on all CNN-LSTM weights.

    :param float scale: prior standard deviation, positive.
    :param float loc: prior mean.
    """

    def __init__(self, scale: float = 1.0, loc: float = 0.0):
        self.scale = real("scale", scale, positive=True)
        self.loc = real("loc", loc)

    def distribution(self, name: str, param: torch.Tensor) -> dist.TorchDistribution:
        return normal_prior(param, self.loc, self.scale)

    def __repr__(self) -> str:
        return f"IIDNormal(scale={self.scale}, loc={self.loc})"


class LayerwiseNormal:
    """A zero-mean normal whose scale is chosen per weight tensor.

    :param scale: a mapping from parameter name to standard deviation, or a callable
        ``(name, param) -> float``.
    :param float default: the scale of a tensor that a mapping does not name; without
        it, an unnamed tensor is an error.

    Example::

        prior = LayerwiseNormal({"fc1.weight": 0.1, "fc1.bias": 1.0})
        prior = LayerwiseNormal.fan_in(gain=2 ** 0.5)   # He-style: gain / sqrt(fan_in)
    """

    def __init__(
        self,
        scale: Mapping[str, float] | Callable[[str, torch.Tensor], float],
        default: float | None = None,
    ):
        if isinstance(scale, Mapping):
            scale = {
                instance("scale key", name, str, "a parameter name (str)"): real(
                    f"scale[{name!r}]", value, positive=True
                )
                for name, value in scale.items()
            }
        else:
            function("scale", scale, "a mapping name -> float or a callable (name, param) -> float")
        self.scale = scale
        self.default = None if default is None else real("default", default, positive=True)

    @classmethod
    def fan_in(cls, gain: float = 1.0, bias_scale: float = 1.0) -> LayerwiseNormal:
        """Scale ``gain / sqrt(fan_in)`` for weights and ``bias_scale`` for vectors.

        ``fan_in`` is the product of all dimensions but the first, as in
        :func:`torch.nn.init.kaiming_normal_`.

        :param float gain: numerator of the weight scale.
        :param float bias_scale: scale of one-dimensional tensors (biases, norms).
        """

        gain = real("gain", gain, positive=True)
        bias_scale = real("bias_scale", bias_scale, positive=True)

        def scale(name: str, param: torch.Tensor) -> float:
            if param.dim() < 2:
                return bias_scale
            return gain / math.sqrt(param[0].numel())

        return cls(scale)

    def check_names(self, names: Sequence[str]) -> None:
        """Refuse mapping keys that name none of ``names``, the lifted random weights
        (:func:`~pyro_bdl.lift` calls it): a misspelt name would keep its tensor at
        ``default``."""
        if isinstance(self.scale, Mapping):
            site_keys("LayerwiseNormal(scale)", self.scale, names, "the lifted random weights")

    def scale_of(self, name: str, param: torch.Tensor) -> float:
        """The standard deviation this prior gives to the tensor ``name``."""
        if callable(self.scale):
            value = self.scale(name, param)
        elif name in self.scale:
            value = self.scale[name]
        elif self.default is not None:
            value = self.default
        else:
            raise KeyError(
                f"LayerwiseNormal has no scale for {name!r}: add it to the mapping or pass "
                "default=..."
            )
        return real(f"the scale of {name!r}", value, positive=True)

    def distribution(self, name: str, param: torch.Tensor) -> dist.TorchDistribution:
        return normal_prior(param, 0.0, self.scale_of(name, param))
