"""The batches of pyro_bdl.data's collators drive the models, through DataLoaders."""

import pyro
import torch
from pyro.infer import MCMC

from pyro_bdl.data import (
    CausalLMCollator,
    CausalMultipleChoiceCollator,
    MultipleChoiceCollator,
    RecordDataset,
    WordCollator,
    WordVocabulary,
    answer_token_ids,
    make_loader,
    token_windows,
)
from pyro_bdl.inference import SGHMC
from pyro_bdl.models import CNNLSTM, cnn_lstm_model, lora_model

REVIEWS = RecordDataset(
    [
        {"text": "a wonderful film, the cast is wonderful", "label": 1},
        {"text": "boring and far too long", "label": 0},
        {"text": "I loved the music and the cast", "label": 1},
        {"text": "the plot makes no sense at all", "label": 0},
    ]
)
QUESTIONS = RecordDataset(
    [
        {"question": "Where sat the cat?", "choices": ["mat", "sun", "sea", "tree"], "label": 0},
        {"question": "What is a mat?", "choices": ["cat", "rug", "hat", "dog"], "label": 1},
    ]
)


def _run_sghmc(model, loader, num_data):
    kernel = SGHMC(model, step_size=1e-3)
    mcmc = MCMC(kernel, num_samples=2, warmup_steps=1, disable_progbar=True)
    mcmc.run(loader, num_data)
    return mcmc.get_samples()


def test_cnn_lstm_on_word_batches():
    vocabulary = WordVocabulary.build((r["text"] for r in REVIEWS), vocab_size=20)
    loader = make_loader(REVIEWS, WordCollator(vocabulary, length=12), batch_size=2)
    net = CNNLSTM(len(vocabulary), embedding_dim=8, num_filters=4, hidden_size=6)
    samples = _run_sghmc(cnn_lstm_model(net), loader, len(REVIEWS))
    assert set(samples) == {name for name, _ in net.named_parameters()}
    assert all(draws.shape[0] == 2 and torch.isfinite(draws).all() for draws in samples.values())


def test_causal_multiple_choice_on_prompts(tiny_llama, word_tokenizer):
    ids = answer_token_ids(word_tokenizer, [" A", " B", " C", " D"])
    lora = lora_model(
        tiny_llama(dtype=torch.float32),
        "multiple_choice",
        label_token_ids=ids,
        tokenizer=word_tokenizer,
    )
    collate = CausalMultipleChoiceCollator(lora.tokenizer, "arc_easy", max_length=64)
    loader = make_loader(QUESTIONS, collate, batch_size=2)
    scores = lora.model(next(iter(loader)), len(QUESTIONS))
    assert scores.shape == (2, 4)
    samples = _run_sghmc(lora.model, loader, len(QUESTIONS))
    assert set(samples) == set(lora.net.random_sites)


def test_encoder_multiple_choice_on_choice_pairs(minilm, minilm_tokenizer):
    lora = lora_model(minilm, "multiple_choice")
    batch = MultipleChoiceCollator(lora.tokenizer, "obqa", max_length=32)(list(QUESTIONS))
    assert lora.model(batch, len(QUESTIONS)).shape == (2, 4)


def test_causal_lm_on_token_windows(tiny_gpt2, word_tokenizer):
    lora = lora_model(tiny_gpt2(), "causal_lm", tokenizer=word_tokenizer)
    windows = token_windows("the cat sat on a mat . " * 3, lora.tokenizer, window=8)
    batch = CausalLMCollator(lora.tokenizer)([windows[i] for i in range(len(windows))])
    trace = pyro.poutine.trace(lora.model).get_trace(batch, len(windows))
    observed = trace.nodes["y"]
    # Every token after a window's first is observed once; padding is masked out.
    assert observed["fn"].base_dist._mask.sum() == batch["attention_mask"][:, 1:].sum()
    assert observed["fn"].base_dist._mask.sum() == 21 - len(windows)
