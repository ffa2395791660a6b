"""Heads: how a lifted network's output becomes logits and the likelihood of the labels.

A head has two methods. ``logits(net, inputs)`` runs the network on the model inputs of
a batch (every key but ``labels``) and returns the logits the Pyro model returns;
``observe(name, logits, batch, num_data)`` adds the likelihood of ``batch["labels"]``
through :func:`pyro_bdl.observe`, so a minibatch of ``B`` out of ``num_data`` examples is
scaled by ``num_data / B``. :class:`~pyro_bdl.models.BayesianNet` pairs a head with a
lifted network.

Half-precision logits (a bf16 / fp16 base model) are returned in float32, as Hugging
Face's own losses upcast them: a log-softmax over a vocabulary in bf16 loses the
likelihood's precision.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import pyro.distributions as dist
import torch

from pyro_bdl.lift import LiftedModule
from pyro_bdl.likelihoods import observe

__all__ = ["Classification", "AnswerTokens", "NextToken", "DictLogits", "IGNORE_INDEX"]

#: The label of a token that carries no loss (padding), as in Hugging Face's collators.
IGNORE_INDEX = -100


def _output_logits(output: Any) -> torch.Tensor:
    """The logits of a module's output (a tensor or a Hugging Face ``ModelOutput``)."""
    logits = output if isinstance(output, torch.Tensor) else output.logits
    if logits.dtype in (torch.float16, torch.bfloat16):
        return logits.float()
    return logits


class DictLogits(torch.nn.Module):
    """A Hugging Face classifier called on a whole batch dict, returning its logits.

    The calling convention of libraries that pass the batch as one argument (laplace-torch
    with its dict-batch loaders); ``labels`` are left out of the call.

    Example::

        la = laplace.KronLaplace(DictLogits(peft_model), "classification")

    :param torch.nn.Module module: a model called as ``module(**inputs)``.
    """

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module

    def forward(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        inputs = {key: value for key, value in batch.items() if key != "labels"}
        return _output_logits(self.module(**inputs))


def _accepts(net: LiftedModule, argument: str) -> bool:
    """Whether the forward of the (peft-wrapped) model takes ``argument``."""
    module = net.module
    if hasattr(module, "get_base_model"):
        module = module.get_base_model()
    return argument in inspect.signature(module.forward).parameters


def _without_cache(net: LiftedModule, inputs: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """The inputs of a causal LM that keeps no key-value cache: no call here generates."""
    inputs = dict(inputs)
    if "use_cache" not in inputs and _accepts(net, "use_cache"):
        inputs["use_cache"] = False
    return inputs


class Classification:
    r"""One categorical label per example, from class logits of shape ``(B, C)``.

    It serves sequence classification, multiple choice with an encoder (Hugging Face's
    ``...ForMultipleChoice`` models score each (question, choice) pair and return
    ``(B, C)`` logits over the choices) and any network that returns class logits, such
    as :class:`~pyro_bdl.models.CNNLSTM`.

    .. math:: y_i \sim \mathrm{Categorical}(\mathrm{softmax}(f_\theta(x_i)))
    """

    def logits(self, net: LiftedModule, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return _output_logits(net(**inputs))

    def observe(
        self,
        name: str,
        logits: torch.Tensor,
        batch: Mapping[str, torch.Tensor],
        num_data: int | None,
    ) -> None:
        labels = batch.get("labels")
        if labels is not None:
            labels = labels.to(logits.device)
        observe(name, dist.Categorical(logits=logits), obs=labels, num_data=num_data)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class AnswerTokens(Classification):
    """Multiple choice with a causal LM: next-token logits of the answer labels.

    The score of choice ``c`` is the logit, at the last position of the prompt, of the
    token that names it (``" A"``, ``" B"``, ... or ``" False"``, ``" True"``), as in
    Laplace-LoRA and BLoB (the templates are BLoB's Table 6, see
    :mod:`pyro_bdl.data.prompts`); the label is the index of the right choice. Prompts
    are left-padded so that position ``-1`` is every prompt's last token. Position ids
    are counted from each prompt's first real token (as ``generate`` does), so a padded
    prompt is scored exactly like the prompt alone, also in models with absolute
    position embeddings (GPT-2). Only the last position's logits are computed
    (``logits_to_keep=1``) when the model supports it.

    :param label_token_ids: the token id of each answer label, in label order (e.g.
        :func:`pyro_bdl.data.tokenize.answer_token_ids`).
    """

    def __init__(self, label_token_ids: Sequence[int]):
        ids = list(label_token_ids)
        if len(ids) < 2 or not all(isinstance(i, int) and i >= 0 for i in ids):
            raise ValueError(
                "label_token_ids must list at least two non-negative token ids, one per "
                f"answer label, got {label_token_ids!r}"
            )
        if len(set(ids)) != len(ids):
            raise ValueError(
                f"label_token_ids must be distinct (one token per answer), got {ids}; two "
                "labels that tokenize to the same id cannot be told apart"
            )
        self.label_token_ids = ids
        self._index = torch.tensor(ids)

    def logits(self, net: LiftedModule, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        inputs = _without_cache(net, inputs)
        mask = inputs.get("attention_mask")
        if mask is not None and "position_ids" not in inputs and _accepts(net, "position_ids"):
            inputs["position_ids"] = (mask.long().cumsum(-1) - 1).clamp(min=0)
        if _accepts(net, "logits_to_keep"):
            inputs["logits_to_keep"] = 1
        last = _output_logits(net(**inputs))[:, -1]
        vocabulary = last.shape[-1]
        if max(self.label_token_ids) >= vocabulary:
            raise ValueError(
                f"label_token_ids {self.label_token_ids} include ids beyond the model's "
                f"vocabulary of {vocabulary} tokens; take them from this model's tokenizer"
            )
        if self._index.device != last.device:  # once: a copy per step would wait for it
            self._index = self._index.to(last.device)
        return last[:, self._index]

    def __repr__(self) -> str:
        return f"AnswerTokens(label_token_ids={self.label_token_ids})"


class NextToken:
    r"""Causal language modelling: every token of a window given the tokens before it.

    The logits at position ``t`` predict token ``t + 1`` (the shift is done here, as
    Hugging Face's causal-LM loss does it), so a window of ``L`` tokens has ``L - 1``
    observed tokens; a window is one example of the ``num_data`` in the training set
    and its log likelihood is the sum over its tokens. Labels equal to
    ``IGNORE_INDEX`` (-100: padding, from :class:`pyro_bdl.data.tokenize.CausalLMCollator`)
    are masked out; without labels, padding is read from ``attention_mask``.

    .. math:: \log p(x_{1:L} \mid \theta) = \sum_{t=1}^{L-1} \log
        \mathrm{softmax}(f_\theta(x_{1:t}))_{x_{t+1}}
    """

    def logits(self, net: LiftedModule, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return _output_logits(net(**_without_cache(net, inputs)))

    def observe(
        self,
        name: str,
        logits: torch.Tensor,
        batch: Mapping[str, torch.Tensor],
        num_data: int | None,
    ) -> None:
        if logits.dim() != 3 or logits.shape[1] < 2:
            raise ValueError(
                "NextToken: the model must return logits of shape (batch, length >= 2, "
                f"vocabulary), got {tuple(logits.shape)}"
            )
        labels = batch.get("labels")
        if labels is not None:
            targets = labels[:, 1:].to(logits.device)
            mask = targets != IGNORE_INDEX
            targets = targets.masked_fill(~mask, 0)
        else:
            targets = None
            attention_mask = batch.get("attention_mask")
            mask = None if attention_mask is None else attention_mask[:, 1:].to(logits.device)
        observe(
            name,
            dist.Categorical(logits=logits[:, :-1]),
            obs=targets,
            num_data=num_data,
            mask=None if mask is None else mask.bool(),
        )

    def __repr__(self) -> str:
        return "NextToken()"
