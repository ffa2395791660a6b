"""Multiple choice with a causal LM, each choice scored by its own text (cloze scoring)."""

from __future__ import annotations

import inspect

import torch

from pyro_bdl.models.heads import IGNORE_INDEX, _output_logits

__all__ = ["ChoiceTexts"]


class ChoiceTexts(torch.nn.Module):
    r"""A causal LM that scores each choice of a question by the log-probability of its text.

    The score of choice :math:`c` is the log-probability of its tokens after the prompt,
    :math:`s_c = \sum_{t \in c} \log p_\theta(x_t \mid x_{<t})`; the module returns the
    ``(B, C)`` scores, which a :class:`~pyro_bdl.models.BayesianNet` with its default
    head takes as the logits of a categorical label: the choice the LM finds likeliest as
    a continuation. Small causal LMs answer multiple-choice questions this way far better
    than by an answer letter (:class:`~pyro_bdl.models.AnswerTokens`, the papers' scoring
    for 7B models): SmolLM2-135M is at chance on ARC-Easy's letters and answers about half
    of its questions by their texts.

    The batch is :class:`~pyro_bdl.data.CausalChoiceTextCollator`'s: ``input_ids`` (or
    ``inputs_embeds``, ``(B, C, L, H)``) and ``attention_mask`` ``(B, C, L)``,
    left-padded, and ``choice_tokens`` ``(B, C, L)``, the choice's token ids at its
    positions (the last of its sequence) and ``-100`` elsewhere. The choices run one at a
    time, as batches of ``B`` sequences cut to their own longest, so that every linear
    layer sees the model's batch as its rows, which is what K-FAC factors (the ``C`` calls
    count as positions that share the weight); only the positions that predict a choice
    token are given logits (``logits_to_keep``) when the model takes it. Lift this module
    (not the LM inside it) so that one forward call scores every choice with one draw of
    the weights.

    Example::

        lora = lora_model(base, "causal_lm")
        net = bdl.lift(ChoiceTexts(lora.peft_model), prior, random="lora_")
        model = BayesianNet(net)          # labels: the right choice

    :param torch.nn.Module lm: a Hugging Face causal LM (or a peft model of one).
    """

    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        # Not ``model``: Pyro's autoguides drop sites whose names start with one of their
        # own attributes (``guide.model``).
        self.lm = lm
        base = lm.get_base_model() if hasattr(lm, "get_base_model") else lm
        self._takes = set(inspect.signature(base.forward).parameters)

    def forward(
        self, attention_mask: torch.Tensor, choice_tokens: torch.Tensor, **inputs: torch.Tensor
    ) -> torch.Tensor:
        if attention_mask.dim() != 3 or choice_tokens.shape != attention_mask.shape:
            raise ValueError(
                "ChoiceTexts takes (batch, choices, length) attention_mask and choice_tokens, "
                "as pyro_bdl.data.CausalChoiceTextCollator makes them; got "
                f"{tuple(attention_mask.shape)} and {tuple(choice_tokens.shape)}"
            )
        scores = [
            self._score(
                attention_mask[:, c], choice_tokens[:, c], {k: v[:, c] for k, v in inputs.items()}
            )
            for c in range(attention_mask.shape[1])
        ]
        return torch.stack(scores, dim=-1)

    def _score(self, mask, targets, inputs) -> torch.Tensor:
        """The ``(B,)`` log-probabilities of one choice's tokens."""
        length = int(mask.sum(-1).max())
        mask, targets = mask[:, -length:], targets[:, -length:]
        one = {key: value[:, -length:] for key, value in inputs.items()}
        one["attention_mask"] = mask
        if "position_ids" in self._takes:  # counted from each sequence's first real token
            one["position_ids"] = (mask.long().cumsum(-1) - 1).clamp(min=0)
        if "use_cache" in self._takes:
            one["use_cache"] = False
        kept = int((targets != IGNORE_INDEX).sum(-1).max())  # the choice: the last tokens
        if "logits_to_keep" in self._takes:
            one["logits_to_keep"] = kept + 1
        # the logits at position t predict the token at t + 1
        logits = _output_logits(self.lm(**one))[:, -(kept + 1) : -1]
        targets = targets[:, -kept:]
        scored = targets != IGNORE_INDEX
        picked = logits.log_softmax(-1).gather(-1, targets.clamp(min=0).unsqueeze(-1))
        return (picked.squeeze(-1) * scored).sum(-1)
