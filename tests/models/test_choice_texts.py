"""ChoiceTexts: each choice scored by the log-probability of its text (cloze)."""

import pyro
import pytest
import torch
from torch.utils.data import DataLoader

import pyro_bdl as bdl
from pyro_bdl.inference import LaplaceGuide
from pyro_bdl.inference.laplace import jacobians
from pyro_bdl.models import BayesianNet, ChoiceTexts, lora_model
from pyro_bdl.priors import IIDNormal


def _choice_batch():
    """Two questions of three choices: prompts and choices of different lengths, left-padded."""
    generator = torch.Generator().manual_seed(1)
    rows, answers = [], []
    for prompt_length in (4, 2):
        for choice_length in (1, 3, 2):
            rows.append(torch.randint(3, 48, (prompt_length + choice_length,), generator=generator))
            answers.append(choice_length)
    length = max(len(r) for r in rows)
    input_ids = torch.zeros(2, 3, length, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    choice_tokens = torch.full_like(input_ids, -100)
    for i, (row, answer) in enumerate(zip(rows, answers, strict=True)):
        b, c = divmod(i, 3)
        input_ids[b, c, length - len(row) :] = row
        attention_mask[b, c, length - len(row) :] = 1
        choice_tokens[b, c, length - answer :] = row[-answer:]
    batch = {"input_ids": input_ids, "attention_mask": attention_mask}
    return {**batch, "choice_tokens": choice_tokens, "labels": torch.tensor([2, 0])}, rows, answers


@pytest.mark.parametrize("family", ["tiny_llama", "tiny_gpt2"])
def test_choice_texts_score_each_choice_by_its_tokens_log_probability(request, family):
    lora = lora_model(request.getfixturevalue(family)(), "causal_lm")
    net = bdl.lift(ChoiceTexts(lora.peft_model), IIDNormal(0.2), random="lora_")
    model = BayesianNet(net)
    batch, rows, answers = _choice_batch()
    pyro.set_rng_seed(0)
    trace = pyro.poutine.trace(model).get_trace(batch, 10)
    trace.compute_log_prob()
    scores = trace.nodes["_RETURN"]["value"]
    assert scores.shape == (2, 3) and len(net.random_sites) == len(lora.net.random_sites)
    values = {site: trace.nodes[site]["value"] for site in net.random_sites}
    with torch.no_grad(), net.fixed(values):
        for i, (row, answer) in enumerate(zip(rows, answers, strict=True)):
            # each sequence alone, unpadded: the sum of its choice tokens' log-probabilities
            logp = lora.peft_model(input_ids=row.unsqueeze(0)).logits[0].log_softmax(-1)
            alone = logp[:-1].gather(-1, row[1:, None]).squeeze(-1)[-answer:].sum()
            torch.testing.assert_close(scores[divmod(i, 3)], alone, rtol=0, atol=1e-10)
    log_likelihood = torch.log_softmax(scores, -1)[torch.arange(2), batch["labels"]].sum()
    torch.testing.assert_close(trace.nodes["y"]["log_prob_sum"], 10 / 2 * log_likelihood)
    with pytest.raises(ValueError, match="CausalChoiceTextCollator"):
        model({k: v[:, 0] for k, v in batch.items() if k != "labels"})


def test_laplace_takes_one_backward_pass_per_batch_and_equals_a_pass_per_column(
    tiny_gpt2, monkeypatch
):
    # Each choice runs through the LM on its own, so each linear call feeds one choice's
    # score: the GGN's columns and the predictive's need one backward pass of the scores,
    # checked on the first batch against one pass per column. (GPT-2, all float64: the
    # two agree to rounding; Llama's RMSNorm computes in float32.)
    lora = lora_model(tiny_gpt2(), "causal_lm")
    net = bdl.lift(ChoiceTexts(lora.peft_model), IIDNormal(0.2), random="lora_")
    model = BayesianNet(net)
    batch, _, _ = _choice_batch()
    trace = pyro.poutine.trace(model).get_trace(batch, 4)
    generator = torch.Generator().manual_seed(2)
    values = {  # LoRA's B away from zero, so that every call has a gradient
        site: 0.05 * torch.randn(trace.nodes[site]["value"].shape, generator=generator).double()
        for site in net.random_sites
    }

    def fit(one_pass: bool):
        monkeypatch.setattr(jacobians, "MAX_SEPARABLE_ENTRIES", 16 if one_pass else 0)
        guide = LaplaceGuide(model, curvature="kron")
        loader = DataLoader([batch, batch], batch_size=None)
        guide.fit(loader, 4, map=values, mode_tolerance=None, progress=False)
        pyro.set_rng_seed(0)
        return guide, guide.predictive(batch, 4, link="mc")

    (fast, fast_probs), (slow, slow_probs) = fit(True), fit(False)
    sites, entries = fast.laplace_fit.jacobians._separable
    assert entries == sorted(entries) and set(entries) == {0, 1, 2}  # choice by choice
    assert slow.laplace_fit.jacobians._separable is None
    for one, other in zip(fast.laplace_fit.blocks, slow.laplace_fit.blocks, strict=True):
        for name, tensor in one.tensors().items():
            if name.endswith("eigenvalues"):
                torch.testing.assert_close(tensor, other.tensors()[name], rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(fast_probs, slow_probs, rtol=0, atol=1e-12)
