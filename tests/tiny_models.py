"""The tiny Llama causal LM that the Hugging Face tests build (random weights, float64).

Shared by ``tests/hf_cases.py``, ``tests/models/conftest.py`` and ``tests/test_lm.py``; each
passes its own vocabulary and context length.
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama(
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    *,
    vocab_size: int,
    max_position_embeddings: int = 64,
    **config,
) -> LlamaForCausalLM:
    """A 2-layer Llama of width 16 (grouped-query attention: 2 heads, 1 key-value head);
    the same seed gives the same weights. ``config`` adds ``LlamaConfig`` arguments."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=max_position_embeddings,
        **config,
    )
    return LlamaForCausalLM(config).to(dtype)
