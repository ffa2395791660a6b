"""Activation (gradient) checkpointing for a lifted Hugging Face model.

A lifted network runs its forward through :func:`torch.func.functional_call`, which
puts the sampled weights into the module for the duration of the call and restores the
module's own weights when it returns. Activation checkpointing recomputes each layer's
forward later, during the backward pass, when the module holds its own weights again:
the recomputed activations, and so the gradients, would silently belong to the wrong
weights. :func:`enable_checkpointing` gives the checkpoint a recompute context that puts
back the tensors the forward used.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch

from pyro_bdl._checks import instance
from pyro_bdl.lift import LiftedModule, parameter_owner

__all__ = ["enable_checkpointing"]


@contextlib.contextmanager
def _holding(module: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """Put ``tensors`` in the parameter slots of ``module`` as ``functional_call`` does."""
    slots = [parameter_owner(module, name) for name in tensors]
    saved = [owner._parameters[attribute] for owner, attribute in slots]
    for (owner, attribute), tensor in zip(slots, tensors.values()):
        owner._parameters[attribute] = tensor
    try:
        yield
    finally:
        for (owner, attribute), tensor in zip(slots, saved):
            owner._parameters[attribute] = tensor


class _RecomputeWithForwardWeights:
    """``context_fn`` of :func:`torch.utils.checkpoint.checkpoint` for a lifted module.

    Called at each checkpointed forward, while ``functional_call`` holds the sampled
    weights in the module: it remembers them and returns a recompute context that puts
    them back.
    """

    def __init__(self, net: LiftedModule):
        self.module = net.module
        self.names = [*net.random_sites.values(), *net.point_sites.values()]

    def __call__(self):
        used = {}
        for name in self.names:
            owner, attribute = parameter_owner(self.module, name)
            used[name] = owner._parameters[attribute]
        return contextlib.nullcontext(), _holding(self.module, used)


def enable_checkpointing(net: LiftedModule) -> None:
    """Turn on activation checkpointing in the Hugging Face model that ``net`` lifts.

    Checkpointing is non-reentrant (reentrant checkpointing gives no gradient to the
    adapters of a frozen model whose inputs need no gradient) and recomputes every
    layer with the weights its forward used. Call this instead of the model's own
    ``gradient_checkpointing_enable``, whose recomputation would see the module's
    weights rather than the sampled ones.

    Example::

        net = bdl.lift(peft_model, random="lora_")
        enable_checkpointing(net)

    :param LiftedModule net: a lifted ``transformers`` model or peft model over one.
    """
    instance("net", net, LiftedModule, "a LiftedModule made by bdl.lift")
    module = net.module
    model = module.get_base_model() if hasattr(module, "get_base_model") else module
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"{type(model).__name__} does not support gradient checkpointing; pass "
            "gradient_checkpointing=False"
        )
    kwargs = {"use_reentrant": False, "context_fn": _RecomputeWithForwardWeights(net)}
    # transformers 5 renamed gradient_checkpointing_enable (now a deprecated alias).
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
