"""A Pyro model made of a lifted network, a head and the likelihood of the labels."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from pyro_bdl._checks import instance
from pyro_bdl.lift import LiftedModule
from pyro_bdl.models.heads import Classification

__all__ = ["BayesianNet"]


class BayesianNet:
    """The Pyro model ``model(batch, num_data)`` of a lifted network.

    It runs the network on the batch's model inputs (every key but ``labels``, moved to
    the device of the network's first parameter, so CPU batches from a DataLoader feed a
    model on an accelerator), observes ``batch["labels"]`` at the site ``name`` through
    the head's likelihood, and returns the logits. Its sample sites are the lifted
    network's random weights and the observation; ``num_data`` is the size of the
    training set, which scales the minibatch likelihood by ``num_data / B``.

    Example::

        model = BayesianNet(bdl.lift(net, prior=bdl.priors.IIDNormal(0.1)), Classification())
        mcmc = MCMC(SGHMC(model, step_size=1e-3), num_samples=50, warmup_steps=500)
        mcmc.run(train_loader, len(train_set))

    :param LiftedModule net: the network, made by :func:`pyro_bdl.lift`.
    :param head: how outputs become logits and a likelihood, see
        :mod:`pyro_bdl.models.heads` (default :class:`~pyro_bdl.models.heads.Classification`).
    :param str name: the name of the observation site.
    """

    def __init__(self, net: LiftedModule, head=None, name: str = "y"):
        if not isinstance(net, LiftedModule):
            raise TypeError(
                f"BayesianNet: net must be a LiftedModule made by bdl.lift(module, ...), got "
                f"{type(net).__name__}"
            )
        if head is not None and not (hasattr(head, "logits") and hasattr(head, "observe")):
            raise TypeError(
                "BayesianNet: head must have logits(net, inputs) and observe(name, logits, "
                f"batch, num_data), e.g. Classification(); got {type(head).__name__}"
            )
        self.net = net
        self.head = Classification() if head is None else head
        self.name = instance("name", name, str, "a site name (str)")

    def __call__(
        self, batch: Mapping[str, torch.Tensor], num_data: int | None = None
    ) -> torch.Tensor:
        """Run the network on ``batch``, observe its labels, return the logits.

        :param dict batch: a dict of tensors as the collators of :mod:`pyro_bdl.data`
            make it; ``labels`` absent means the observation is sampled (prediction).
        :param int num_data: the size of the training set (default: the batch size).
        """
        if not isinstance(batch, Mapping):
            raise TypeError(
                "the model takes a dict batch (input_ids, attention_mask, ..., labels) as the "
                f"collators of pyro_bdl.data make it, got {type(batch).__name__}"
            )
        device = next(self.net.module.parameters()).device
        inputs = {key: value.to(device) for key, value in batch.items() if key != "labels"}
        logits = self.head.logits(self.net, inputs)
        self.head.observe(self.name, logits, batch, num_data)
        return logits

    def train(self, mode: bool = True) -> BayesianNet:
        """Put the network in training mode (dropout on) or, with ``mode=False``, eval."""
        self.net.module.train(mode)
        return self

    def eval(self) -> BayesianNet:
        """Put the network in evaluation mode (dropout off)."""
        return self.train(False)

    def __repr__(self) -> str:
        return f"BayesianNet({self.net!r}, head={self.head!r}, name={self.name!r})"
