"""Tiny BERT and Llama LoRA models, data and Trainer settings for the Trainer tests.

``tests/test_hf.py`` and ``tests/distributed/test_hf.py`` share them: float64 models
without dropout (so that two runs from one seed take the same steps) and datasets of
dict examples that the Trainer's default collator stacks.
"""

import pyro
import torch
from peft import LoraConfig, get_peft_model
from tiny_models import tiny_llama
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    TrainerCallback,
    TrainingArguments,
)

VOCAB, LENGTH, NUM_LABELS = 40, 6, 3


def bert_base(seed: int = 0, dtype: torch.dtype = torch.float64):
    """A 2-layer BERT classifier without adapters, its weights from ``seed``."""
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
        num_labels=NUM_LABELS,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return BertForSequenceClassification(config).to(dtype)


def bert(seed: int = 0, dtype: torch.dtype = torch.float64):
    """A 2-layer BERT classifier with LoRA on the queries and values and a trained head."""
    lora = LoraConfig(
        r=2,
        lora_alpha=4,
        lora_dropout=0.0,
        target_modules=["query", "value"],
        modules_to_save=["classifier"],
    )
    return get_peft_model(bert_base(seed, dtype), lora)


def llama(seed: int = 0, dtype: torch.dtype = torch.float64):
    """A 2-layer Llama causal LM with LoRA on q_proj and v_proj (its LM head frozen)."""
    base = tiny_llama(seed, dtype, vocab_size=VOCAB, max_position_embeddings=32)
    lora = LoraConfig(
        r=2,
        lora_alpha=4,
        lora_dropout=0.0,
        target_modules=["q_proj", "v_proj"],
        task_type="CAUSAL_LM",
    )
    return get_peft_model(base, lora)


MODELS = {"bert": bert, "llama": llama}


class Examples(torch.utils.data.Dataset):
    """Random token sequences; a class label for BERT, the tokens themselves for Llama."""

    def __init__(self, kind: str, size: int = 16, seed: int = 1):
        generator = torch.Generator().manual_seed(seed)
        self.kind = kind
        self.tokens = torch.randint(1, VOCAB, (size, LENGTH), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict:
        tokens = self.tokens[i]
        label = tokens[0] % NUM_LABELS if self.kind == "bert" else tokens
        return {"input_ids": tokens, "attention_mask": torch.ones_like(tokens), "labels": label}


def arguments(output_dir, **overrides) -> TrainingArguments:
    """Quiet CPU Trainer settings: sequential batches of 4, 4 steps, no clipping or saving."""
    settings = {
        "per_device_train_batch_size": 4,
        "max_steps": 4,
        "learning_rate": 1e-2,
        "max_grad_norm": 0.0,
        "train_sampling_strategy": "sequential",
        "report_to": "none",
        "use_cpu": True,
        "save_strategy": "no",
        "logging_strategy": "no",
        "disable_tqdm": True,
        **overrides,
    }
    return TrainingArguments(str(output_dir), **settings)


class RandomState(TrainerCallback):
    """The process's random state when training begins (after the Trainer's set-up)."""

    def on_train_begin(self, args, state, control, **kwargs):
        self.state = torch.get_rng_state()


def posterior(guide) -> dict[str, torch.Tensor]:
    """A trained guide's approximation and the point weights in Pyro's param store, copied."""
    values = {k: v.detach().clone() for k, v in guide.approximation_parameters().items()}
    store = pyro.get_param_store()
    for name in store.keys():
        if "lora_" in name or "modules_to_save" in name:
            values[f"point.{name}"] = store[name].detach().clone()
    return values


def assert_same(actual: dict, expected: dict, **tolerance) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(actual[key], value, msg=key, **tolerance)
