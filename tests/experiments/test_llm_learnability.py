"""The SmolLM2 learnability experiment: its frozen prefix is exact (the --quick run is in
validation/experiments)."""

import pytest
import torch
from tiny_models import tiny_llama

from experiments.llm_learnability import FrozenPrefix


def test_the_cut_model_fed_the_prefix_computes_what_the_whole_model_does():
    # Left-padded prompts of different lengths: positions come from the attention mask.
    model = tiny_llama(0, torch.float64, vocab_size=23).eval()
    model.config.num_hidden_layers = 2
    input_ids = torch.randint(3, 23, (3, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(input_ids)
    mask[0, :3] = 0
    mask[1, :1] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    inputs = {"attention_mask": mask, "position_ids": positions, "use_cache": False}
    with torch.no_grad():
        whole = model(input_ids=input_ids, **inputs).logits
        prefix = FrozenPrefix(model, top_layers=1)
        assert len(model.model.layers) == 1 and model.config.num_hidden_layers == 1
        cut = model(inputs_embeds=prefix.hidden(input_ids, mask), **inputs).logits
    real = mask.bool()  # padded positions are never read
    torch.testing.assert_close(cut[real], whole[real], rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="top_layers must be in"):
        FrozenPrefix(tiny_llama(0, torch.float64, vocab_size=23), top_layers=2)
