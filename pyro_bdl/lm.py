r"""Causal language models under a posterior: per-token uncertainty, and generation.

A causal LM with ``S`` draws :math:`\theta_s` of its random weights (SGMCMC draws, a
guide's samples) has at every position :math:`t` one next-token distribution per draw,
:math:`p_s(\cdot) = p(x_t \mid x_{<t}, \theta_s)` over the vocabulary. Their mean
:math:`\bar p` is the Bayesian model average, and its entropy splits as a classifier's
does (eq. 2 of the posteriors paper, :func:`pyro_bdl.metrics.uncertainty_decomposition`):

.. math:: \mathrm{TU}_t = H[\bar p], \quad \mathrm{AU}_t = \frac1S \sum_s H[p_s], \quad
          \mathrm{EU}_t = \mathrm{TU}_t - \mathrm{AU}_t \ge 0,

in nats: EU is the mutual information between the next token and the weights, zero
when the draws agree (semantic ambiguity, synonyms, is aleatoric). :func:`token_uncertainty`
scores given text, :func:`generate` decodes from :math:`\bar p` and scores each token it
chooses.

The draws stream: one draw's logits ``(B, L, V)`` and running sums (of :math:`p_s` and
of :math:`H[p_s]`) are held, never ``(S, B, L, V)``; generation holds one key-value cache
per draw. Each draw runs the model with :func:`pyro_bdl.predict.condition_on_sites`, the
mechanism of :func:`~pyro_bdl.predict.predict_proba`, so draws may be anywhere (CPU, a
store on disk) while the model is on a GPU, and a bf16 base with fp32 adapters works as
in training (logits are upcast to float32). A guide's draw is a draw of the weights (for
BLoB, flipout's per-token signs are not used: each draw is one network).

**References**

[1] S. Duffield et al., *Scalable Bayesian learning with posteriors*, ICLR 2025 (section
5.3, Bayesian Llama 3).

Example::

    lora = lora_model("path/to/llama", "causal_lm", dtype=torch.bfloat16)
    ...  # MCMC(SGHMC(lora.model, ...)).run(loader, num_data)
    scores = token_uncertainty(lora.model, batch, num_data, samples=mcmc.get_samples())
    scores.epistemic                 # (B, L), NaN where the label is -100
    scores.sequence("max").epistemic  # (B,), an out-of-distribution score per sequence
    out = generate(lora.model, prompt_ids, samples=mcmc.get_samples(), max_new_tokens=20)
    out.sequences, out.uncertainty.epistemic   # (B, L + T), (B, T)
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
from tqdm.auto import trange

from pyro_bdl._checks import function, instance, integer, one_of, real
from pyro_bdl._offload import draw_at
from pyro_bdl.lift import LiftedModule, recording_calls
from pyro_bdl.metrics import _entropy
from pyro_bdl.predict import condition_on_sites, guide_draw, posterior_size

__all__ = ["TokenUncertainty", "GenerationOutput", "token_uncertainty", "generate"]

#: The label of a position that is not scored (padding), as in Hugging Face.
IGNORE_INDEX = -100


class TokenUncertainty(NamedTuple):
    """Per-token total, aleatoric and epistemic uncertainty and loss, in nats.

    Each field is ``(B, L)`` for :func:`token_uncertainty` (entry ``t``: the distribution
    of the token at position ``t``, NaN where it is not scored) and ``(B, T)`` for the
    ``T`` tokens :func:`generate` chose (NaN after a sequence ended). ``nll`` is
    :math:`-\\log \\bar p` of the label (of the chosen token when generating).
    """

    total: torch.Tensor
    aleatoric: torch.Tensor
    epistemic: torch.Tensor
    nll: torch.Tensor

    def sequence(self, reduction: str = "mean") -> TokenUncertainty:
        """One score per sequence: the mean or the maximum over its scored positions.

        Example::

            scores = token_uncertainty(model, batch, num_data, samples=draws)
            is_unfamiliar = scores.sequence("max").epistemic > threshold   # (B,)

        :param str reduction: ``"mean"`` or ``"max"``; NaN positions are left out, and a
            sequence with no scored position gets NaN.
        :return: the same fields, each ``(B,)``.
        """
        one_of("reduction", reduction, ("mean", "max"))
        return TokenUncertainty(*(_reduce(value, reduction) for value in self))


class GenerationOutput(NamedTuple):
    """What :func:`generate` returns.

    :ivar torch.Tensor sequences: the prompts followed by the new tokens, ``(B, L + T)``,
        as Hugging Face's ``generate`` returns them (``T <= max_new_tokens``: decoding
        stops when every sequence has ended).
    :ivar TokenUncertainty uncertainty: of each new token, each field ``(B, T)``.
    """

    sequences: torch.Tensor
    uncertainty: TokenUncertainty


def token_uncertainty(
    model: Callable,
    batch: Mapping[str, torch.Tensor],
    num_data: int | None,
    *,
    samples: object = None,
    guide: Callable | None = None,
    num_samples: int | None = None,
    progress: bool = False,
) -> TokenUncertainty:
    """Total, aleatoric and epistemic uncertainty of every token of a batch of text.

    Entry ``t`` is about the distribution of token ``t`` given the tokens before it (the
    logits at ``t - 1``, the shift Hugging Face's causal-LM loss makes), so it is aligned
    with ``batch["labels"]``: NaN where the label is -100 and at ``t = 0``. Without
    ``labels``, every token whose position and previous position are unmasked in
    ``attention_mask`` is scored, labelled with itself.

    The draws stream through one model call each: memory is one draw's ``(B, L, V)``
    logits, the running sums at the scored positions, and the outputs.

    Example::

        scores = token_uncertainty(lora.model, batch, num_data, samples=mcmc.get_samples())
        scores.total, scores.epistemic          # (B, L)
        scores.sequence("mean").epistemic       # (B,)

    :param callable model: a causal-LM Pyro model ``model(batch, num_data)`` returning
        logits ``(B, L, V)``, such as ``lora_model(..., "causal_lm").model`` (or the
        :class:`~pyro_bdl.models.LoRAModel` itself).
    :param dict batch: ``input_ids`` ``(B, L)`` and the model's other inputs
        (``attention_mask``, ``labels``), as :class:`~pyro_bdl.data.CausalLMCollator`
        makes them.
    :param int num_data: the size of the training set, passed to the model and guide.
    :param samples: draws of the model's latent sites, site -> ``(S, *shape)``
        (``mcmc.get_samples()``, ``Chains.get_samples()``, NumPy arrays) or an ArviZ /
        xarray posterior ``(chain, draw, *shape)``, e.g. ``bdl.to_arviz(checkpoint_dir)``,
        read one draw at a time.
    :param guide: a fitted guide to draw weights from (``LaplaceGuide``, ``BLoBGuide``,
        ``IVONGuide``, ``MeanFieldGuide``, any Pyro guide), with ``num_samples``.
    :param int num_samples: the number of guide draws.
    :param bool progress: show a progress bar over the draws.
    :return: :class:`TokenUncertainty`, each field ``(B, L)`` on the logits' device.
    """
    model = _pyro_model(model, "token_uncertainty")
    count = posterior_size("token_uncertainty", samples, guide, num_samples)
    instance("progress", progress, bool, "True or False")
    instance("batch", batch, Mapping, "a dict batch (input_ids, attention_mask, labels)")
    input_ids = _input_ids(batch.get("input_ids"))
    labels = _labels(batch, input_ids)
    net = getattr(model, "net", None)
    if isinstance(net, LiftedModule):
        _check_causal(net, "token_uncertainty")
    scored = labels[:, 1:] != IGNORE_INDEX
    every = bool(scored.all())
    targets = labels[:, 1:] if every else labels[:, 1:][scored]
    batch = {**batch, "labels": labels}
    running = _Running()
    with torch.no_grad():
        for index in trange(count or 1, desc="draws", disable=not progress):
            draw = _one_draw(samples, guide, index, (batch, num_data))
            logits = condition_on_sites(model, draw, strict=True)(batch, num_data)
            shifted = _checked_logits(logits, input_ids.shape, "token_uncertainty")[:, :-1]
            del logits
            if scored.any():  # the scored positions only: the last word is one of L
                running.add(shifted, None if every else scored)
            del shifted  # before the next draw's forward: one draw's logits at a time
    result = torch.full((4, *labels.shape), float("nan"), dtype=running.dtype)
    if running.count:
        values = running.result(targets)
        result = result.to(values[0].device)
        for field, value in zip(result, values):
            if every:
                field[:, 1:] = value
            else:
                field[:, 1:][scored.to(field.device)] = value
    return TokenUncertainty(*result)


def generate(
    model: Callable,
    input_ids: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    samples: object = None,
    guide: Callable | None = None,
    num_samples: int | None = None,
    max_new_tokens: int,
    do_sample: bool = False,
    temperature: float = 1.0,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    generator: torch.Generator | None = None,
    progress: bool = False,
) -> GenerationOutput:
    r"""Decode from the Bayesian model average, scoring the uncertainty of every new token.

    At each step every draw :math:`s` gives :math:`p_s(\cdot \mid x_{<t})` from its own
    key-value cache; the next token is the argmax of :math:`\bar p = \frac1S \sum_s p_s`
    (greedy), or a draw from :math:`\bar p^{1/\tau}` renormalised (``do_sample``,
    temperature :math:`\tau`), and its TU, AU and EU are those of :math:`\bar p`
    (untempered). With ``S`` identical draws the sequences are Hugging Face's greedy
    ``generate`` with those weights. Left-padded prompts are positioned as ``generate``
    does (position ids counted from each prompt's first real token); a sequence that
    produced ``eos_token_id`` continues with ``pad_token_id`` and NaN uncertainty, and
    decoding stops when all have.

    Cost: per new token, one forward of one token per draw, with ``S`` caches held.

    Example::

        out = generate(lora.model, prompt["input_ids"], attention_mask=prompt["attention_mask"],
                       samples=mcmc.get_samples(), max_new_tokens=20)
        tokenizer.batch_decode(out.sequences)
        out.uncertainty.epistemic          # (B, T): high where the draws disagree

    :param callable model: a causal-LM Pyro model whose lifted network is the language
        model: a :class:`~pyro_bdl.models.BayesianNet` (``lora_model(..., "causal_lm").model``,
        or the :class:`~pyro_bdl.models.LoRAModel`), or a model that calls one network
        made by :func:`pyro_bdl.lift` (found by running the model once on the prompts).
    :param torch.Tensor input_ids: the prompts, ``(B, L)`` token ids.
    :param torch.Tensor attention_mask: ``(B, L)``, 0 at (left) padding; default all ones.
    :param samples: draws of the network's random sites, as for :func:`token_uncertainty`.
    :param guide: a fitted guide to draw weights from, with ``num_samples``; its draws are
        made once, before decoding.
    :param int num_samples: the number of guide draws.
    :param int max_new_tokens: the most tokens to add, at least 1.
    :param bool do_sample: sample the next token instead of taking the argmax.
    :param float temperature: :math:`\tau > 0` of the sampling.
    :param eos_token_id: the end-of-sequence token(s); default the model's
        ``generation_config``'s.
    :param int pad_token_id: what follows the end; default the model's, else the first
        end-of-sequence token (as Hugging Face).
    :param torch.Generator generator: the random generator of the sampling.
    :param bool progress: show a progress bar over the new tokens.
    :return: :class:`GenerationOutput`: ``.sequences`` ``(B, L + T)`` and
        ``.uncertainty`` (fields ``(B, T)``).
    """
    model = _pyro_model(model, "generate")
    count = posterior_size("generate", samples, guide, num_samples)
    max_new_tokens = integer("max_new_tokens", max_new_tokens, low=1)
    instance("do_sample", do_sample, bool, "True or False")
    temperature = real("temperature", temperature, positive=True)
    instance("progress", progress, bool, "True or False")
    if generator is not None:
        instance("generator", generator, torch.Generator, "a torch.Generator or None")
    input_ids = _input_ids(input_ids)
    attention_mask = _attention_mask(attention_mask, input_ids)
    prompts = {"input_ids": input_ids, "attention_mask": attention_mask}
    with torch.no_grad():
        net = _network(model, prompts, samples, guide, "generate")
        _check_causal(net, "generate")
        device = next(net.module.parameters()).device
        draws = [
            {name: value.to(device) for name, value in draw.items()}
            for draw in (
                _one_draw(samples, guide, index, (prompts, None)) for index in range(count or 1)
            )
        ]
        decoder = _Decoder(net, draws, eos_token_id, pad_token_id)
        return decoder.run(
            input_ids.to(device),
            attention_mask.to(device),
            max_new_tokens,
            do_sample,
            temperature,
            generator,
            progress,
        )


# -- the running decomposition ---------------------------------------------------------------


class _Running:
    """Sums over draws of next-token distributions: of the probabilities and the entropies.

    Each draw's logits are taken a slice of rows at a time (about ``CHUNK`` numbers), so
    that the softmax and entropy temporaries are a slice, not another ``(B, L, V)``: what is
    held is the draw's logits and the sums.
    """

    #: Numbers per slice of the logits that the softmax and entropy work on at once.
    CHUNK = 2**22

    def __init__(self):
        self.count = 0
        self.probs = self.entropy = None
        self.dtype = torch.float32
        self.averaged = False

    def add(self, logits: torch.Tensor, scored: torch.Tensor | None = None) -> None:
        """One draw's logits ``(B, ..., V)``, at the positions ``scored`` ``(B, ...)`` or all."""
        if self.probs is None:
            rows = logits.shape[:-1] if scored is None else (int(scored.sum()),)
            self.dtype = torch.promote_types(logits.dtype, torch.float32)
            self.probs = logits.new_zeros(*rows, logits.shape[-1], dtype=self.dtype)
            self.entropy = logits.new_zeros(rows, dtype=self.dtype)
        offset = 0
        for rows in _slices(logits, self.CHUNK):
            part = logits[rows] if scored is None else logits[rows][scored[rows].to(logits.device)]
            probs = torch.softmax(part.to(self.dtype), dim=-1)
            end = offset + len(probs)
            self.probs[offset:end] += probs
            self.entropy[offset:end] += _entropy(probs)
            offset = end
        self.count += 1

    def mean(self) -> torch.Tensor:
        """:math:`\\bar p`, the model average (the sum divided in place, once: no more draws)."""
        if not self.averaged:
            self.probs.div_(self.count)
            self.averaged = True
        return self.probs

    def result(self, labels: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """TU, AU, EU and the NLL of ``labels`` under the mean, shaped like ``labels``."""
        mean = self.mean()
        total = torch.cat([_entropy(mean[rows]) for rows in _slices(mean, self.CHUNK)])
        aleatoric = self.entropy / self.count
        # a mutual information is non-negative; rounding of the two sums can cross zero
        epistemic = (total - aleatoric).clamp_min(0.0)
        label = mean.gather(-1, labels.to(mean.device)[..., None]).squeeze(-1)
        nll = -label.clamp_min(torch.finfo(mean.dtype).tiny).log()
        return total, aleatoric, epistemic, nll


def _slices(tensor: torch.Tensor, size: int) -> list[slice]:
    """Slices of the first dimension of ``tensor`` holding about ``size`` numbers each."""
    step = max(1, size // max(1, tensor[0].numel()))
    return [slice(start, start + step) for start in range(0, len(tensor), step)]


def _reduce(value: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "mean":
        return value.nanmean(dim=-1)
    scored = ~value.isnan()
    highest = value.masked_fill(~scored, float("-inf")).amax(dim=-1)
    return highest.masked_fill(~scored.any(dim=-1), float("nan"))


# -- generation ------------------------------------------------------------------------------


class _Decoder:
    """One key-value cache per draw, stepped together; the next token from their mean."""

    def __init__(self, net: LiftedModule, draws: list[dict], eos_token_id, pad_token_id):
        self.net, self.draws = net, draws
        base = _base_model(net.module)
        parameters = inspect.signature(base.forward).parameters
        # transformers 5 calls the cache ``cache``, earlier versions ``past_key_values``
        self.cache_key = "cache" if "cache" in parameters else "past_key_values"
        self.positions = "position_ids" in parameters
        self.logits_to_keep = "logits_to_keep" in parameters
        config = getattr(base, "generation_config", None)
        if eos_token_id is None:
            eos_token_id = getattr(config, "eos_token_id", None)
        eos = [] if eos_token_id is None else torch.tensor(eos_token_id).reshape(-1).tolist()
        self.eos = [integer("eos_token_id", token, low=0) for token in eos]
        if pad_token_id is None:
            pad_token_id = getattr(config, "pad_token_id", None)
        if pad_token_id is None and self.eos:
            pad_token_id = self.eos[0]
        self.pad = None if pad_token_id is None else integer("pad_token_id", pad_token_id, low=0)

    def step(self, inputs: dict, caches: list) -> _Running:
        """One forward per draw, each with its own cache (updated in ``caches``)."""
        running = _Running()
        for index, draw in enumerate(self.draws):
            if caches[index] is not None:
                inputs = {**inputs, self.cache_key: caches[index]}
            output = condition_on_sites(self.net, draw, strict=True)(**inputs)
            caches[index] = _cache(output)
            running.add(_checked_logits(_logits(output), None, "generate")[:, -1])
        return running

    def run(self, input_ids, attention_mask, max_new_tokens, do_sample, temperature, generator,
            progress) -> GenerationOutput:  # fmt: skip
        batch = len(input_ids)
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "use_cache": True}
        if self.positions:
            # as Hugging Face's generate: counted from each prompt's first real token
            positions = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
            inputs["position_ids"] = positions
        if self.logits_to_keep:
            inputs["logits_to_keep"] = 1
        caches = [None] * len(self.draws)
        running_rows = torch.ones(batch, dtype=torch.bool, device=input_ids.device)
        new_tokens, scores = [], []
        for _ in trange(max_new_tokens, desc="tokens", disable=not progress):
            running = self.step(inputs, caches)
            mean = running.mean()
            if do_sample:
                tempered = torch.softmax(mean.clamp_min(torch.finfo(mean.dtype).tiny).log()
                                         / temperature, dim=-1)  # fmt: skip
                token = torch.multinomial(tempered, 1, generator=generator).squeeze(-1)
            else:
                token = mean.argmax(dim=-1)
            values = torch.stack(running.result(token))
            scores.append(values.masked_fill(~running_rows.to(values.device), float("nan")))
            token = token.to(input_ids.device)
            if self.pad is not None:
                token = torch.where(running_rows, token, self.pad)
            new_tokens.append(token)
            if self.eos:
                running_rows &= ~torch.isin(token, torch.tensor(self.eos, device=token.device))
                if not running_rows.any():
                    break
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(batch, 1)], -1)
            inputs = {"input_ids": token[:, None], "attention_mask": attention_mask}
            inputs["use_cache"] = True
            if self.positions:
                positions = positions[:, -1:] + 1
                inputs["position_ids"] = positions
        sequences = torch.cat([input_ids, torch.stack(new_tokens, dim=1)], dim=1)
        uncertainty = torch.stack(scores, dim=-1)  # (4, B, T)
        return GenerationOutput(sequences, TokenUncertainty(*uncertainty))


def _cache(output: Any) -> Any:
    cache = getattr(output, "cache", None)
    return cache if cache is not None else getattr(output, "past_key_values", None)


def _logits(output: Any) -> torch.Tensor:
    return output if torch.is_tensor(output) else output.logits


# -- arguments, draws and models --------------------------------------------------------------


def _pyro_model(model: object, caller: str) -> Callable:
    """The Pyro model of a :class:`~pyro_bdl.models.LoRAModel`, or ``model`` itself."""
    if hasattr(model, "peft_model") and callable(getattr(model, "model", None)):
        return model.model
    return function("model", model, f"a causal-LM Pyro model for {caller} (e.g. lora.model)")


def _one_draw(samples: object, guide: Callable | None, index: int, args: tuple) -> dict:
    """Draw ``index`` of the posterior: read from ``samples``, made by ``guide``, or none."""
    if samples is not None:
        return draw_at(samples, index)
    if guide is not None:
        return guide_draw(guide, *args)
    return {}


def _input_ids(input_ids: object) -> torch.Tensor:
    if not torch.is_tensor(input_ids) or input_ids.dim() != 2 or input_ids.is_floating_point():
        got = tuple(input_ids.shape) if torch.is_tensor(input_ids) else type(input_ids).__name__
        raise ValueError(f"input_ids must be integer token ids shaped (batch, length), got {got}")
    if input_ids.shape[1] == 0:
        raise ValueError("input_ids must hold at least one token per sequence, got length 0")
    return input_ids


def _attention_mask(mask: object, input_ids: torch.Tensor) -> torch.Tensor:
    if mask is None:
        return torch.ones_like(input_ids)
    if not torch.is_tensor(mask) or mask.shape != input_ids.shape:
        got = tuple(mask.shape) if torch.is_tensor(mask) else type(mask).__name__
        raise ValueError(
            f"attention_mask must be shaped like input_ids {tuple(input_ids.shape)}, got {got}"
        )
    return mask.long()


def _labels(batch: Mapping, input_ids: torch.Tensor) -> torch.Tensor:
    """``batch["labels"]`` checked, or the tokens whose position and previous one are unmasked."""
    labels = batch.get("labels")
    if labels is None:
        mask = _attention_mask(batch.get("attention_mask"), input_ids).bool()
        scored = mask.clone()
        scored[:, 0] = False
        scored[:, 1:] &= mask[:, :-1]
        return input_ids.masked_fill(~scored, IGNORE_INDEX)
    if not torch.is_tensor(labels) or labels.shape != input_ids.shape or labels.is_floating_point():
        got = tuple(labels.shape) if torch.is_tensor(labels) else type(labels).__name__
        raise ValueError(
            "batch['labels'] must be integer token ids shaped like input_ids "
            f"{tuple(input_ids.shape)} (-100 where not scored), got {got}"
        )
    return labels


def _checked_logits(logits: object, shape: torch.Size | None, caller: str) -> torch.Tensor:
    """Next-token logits ``(B, L, V)`` (of the batch's ``(B, L)`` where known), checked."""
    fits = torch.is_tensor(logits) and logits.dim() == 3 and logits.is_floating_point()
    if fits and shape is not None:
        fits = tuple(logits.shape[:2]) == tuple(shape)
    if not fits:
        got = tuple(logits.shape) if torch.is_tensor(logits) else type(logits).__name__
        expected = "(batch, length, vocabulary)" + ("" if shape is None else f" = {tuple(shape)}")
        raise ValueError(
            f"{caller}: the model must return next-token logits shaped {expected} + (V,), got "
            f"{got}; pass a causal language model (lora_model(path, 'causal_lm').model)"
        )
    return logits


def _base_model(module: torch.nn.Module) -> torch.nn.Module:
    return module.get_base_model() if hasattr(module, "get_base_model") else module


def _check_causal(net: LiftedModule, caller: str) -> None:
    """Refuse a Hugging Face model that is not a causal (decoder) language model."""
    base = _base_model(net.module)
    config = getattr(base, "config", None)
    if config is None or not hasattr(config, "model_type"):
        return  # a plain torch module: its logits' shape is checked instead
    from transformers.models.auto import modeling_auto

    causal = set()
    for names in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        causal.update((names,) if isinstance(names, str) else names)
    if getattr(config, "is_encoder_decoder", False) or type(base).__name__ not in causal:
        raise ValueError(
            f"{caller}: {type(base).__name__} ({config.model_type!r}) is not a causal language "
            "model; per-token next-token uncertainty and generation need a decoder such as "
            "Llama or GPT-2 with its LM head (lora_model(path, 'causal_lm'))"
        )


def _network(
    model: Callable, prompts: dict, samples: object, guide: Callable | None, caller: str
) -> LiftedModule:
    """The lifted language model that ``model`` runs: ``model.net``, or the one it calls."""
    net = getattr(model, "net", None)
    if not isinstance(net, LiftedModule):
        draw = _one_draw(samples, guide, 0, (prompts, None))
        batch = {**prompts, "labels": _labels(prompts, prompts["input_ids"])}
        with recording_calls() as called:
            condition_on_sites(model, draw, strict=True)(batch, None)
        if len(called) != 1:
            raise ValueError(
                f"{caller}: the model must call one network made by bdl.lift (the language "
                f"model), it called {len(called)}; pass a model whose .net is it"
            )
        net = called[0]
    if net._fixed_depth and (samples is not None or guide is not None):
        raise ValueError(
            f"{caller}: the network is inside net.fixed(...), whose weights would replace "
            "every draw; call it outside the context to use samples or a guide"
        )
    return net
