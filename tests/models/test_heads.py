import pyro
import pytest
import torch
import torch.nn.functional as F

from pyro_bdl.models import AnswerTokens, lora_model

LABEL_IDS = [5, 7, 9]


def _prior_draw(lora, batch, num_data):
    """A draw of the adapters from the prior (B != 0, so the adapters matter) and its trace."""
    pyro.set_rng_seed(0)
    trace = pyro.poutine.trace(lora.model).get_trace(batch, num_data)
    trace.compute_log_prob()
    return {site: trace.nodes[site]["value"] for site in lora.net.random_sites}, trace


def test_next_token_likelihood_is_the_shifted_cross_entropy(tiny_llama, token_batch):
    lora = lora_model(tiny_llama(), "causal_lm")
    values, trace = _prior_draw(lora, token_batch, num_data=40)
    with torch.no_grad(), lora.net.fixed(values):
        logits = lora.peft_model(
            input_ids=token_batch["input_ids"], attention_mask=token_batch["attention_mask"]
        ).logits
    # Hugging Face's causal-LM loss: position t predicts token t + 1, -100 ignored.
    cross_entropy = F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]),
        token_batch["labels"][:, 1:].reshape(-1),
        ignore_index=-100,
        reduction="sum",
    )
    observed = trace.nodes["y"]
    torch.testing.assert_close(observed["log_prob_sum"], -40 / 4 * cross_entropy)
    torch.testing.assert_close(trace.nodes["_RETURN"]["value"], logits)


def test_next_token_without_labels_samples_the_unpadded_tokens(tiny_llama, token_batch):
    lora = lora_model(tiny_llama(), "causal_lm")
    batch = {key: value for key, value in token_batch.items() if key != "labels"}
    trace = pyro.poutine.trace(lora.model).get_trace(batch)
    observed = trace.nodes["y"]
    assert not observed["is_observed"] and observed["value"].shape == (4, 6)
    assert torch.equal(observed["fn"].base_dist._mask, batch["attention_mask"][:, 1:].bool())


def _left_padded(batch_size: int = 3, length: int = 6):
    generator = torch.Generator().manual_seed(2)
    input_ids = torch.randint(1, 48, (batch_size, length), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :2] = 0
    attention_mask[1, :1] = 0
    input_ids = input_ids.masked_fill(attention_mask == 0, 0)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "labels": torch.tensor([0, 2, 1]),
    }


def test_answer_tokens_are_the_label_logits_at_the_last_position(tiny_llama):
    lora = lora_model(tiny_llama(), "multiple_choice", label_token_ids=LABEL_IDS)
    batch = _left_padded()
    values, trace = _prior_draw(lora, batch, num_data=30)
    # Every position's logits, with the positions counted from each prompt's first token.
    position_ids = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad(), lora.net.fixed(values):
        full = lora.peft_model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=position_ids,
        ).logits
    expected = full[:, -1, LABEL_IDS]
    scores = trace.nodes["_RETURN"]["value"]
    torch.testing.assert_close(scores, expected, rtol=0, atol=1e-12)
    log_likelihood = torch.log_softmax(expected, -1)[torch.arange(3), batch["labels"]].sum()
    torch.testing.assert_close(trace.nodes["y"]["log_prob_sum"], 30 / 3 * log_likelihood)


def test_a_left_padded_prompt_scores_like_the_prompt_alone(tiny_gpt2):
    # GPT-2 has absolute position embeddings: positions must count from the first real
    # token, or padding shifts them.
    lora = lora_model(tiny_gpt2(), "multiple_choice", label_token_ids=LABEL_IDS)
    batch = _left_padded()
    values, trace = _prior_draw(lora, batch, num_data=3)
    scores = trace.nodes["_RETURN"]["value"]
    with torch.no_grad(), lora.net.fixed(values):
        for row in range(3):
            prompt = batch["input_ids"][row, batch["attention_mask"][row].bool()]
            alone = lora.peft_model(input_ids=prompt.unsqueeze(0)).logits[0, -1, LABEL_IDS]
            torch.testing.assert_close(scores[row], alone, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "ids, message",
    [([3], "at least two"), ([3, -1], "at least two"), ([3, 3], "distinct")],
)
def test_answer_tokens_reject_bad_ids(ids, message):
    with pytest.raises(ValueError, match=message):
        AnswerTokens(ids)


def test_answer_tokens_beyond_the_vocabulary(tiny_llama):
    lora = lora_model(tiny_llama(), "multiple_choice", label_token_ids=[5, 480])
    with pytest.raises(ValueError, match="beyond the model's vocabulary of 48"):
        lora.model(_left_padded())
