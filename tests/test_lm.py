"""Per-token uncertainty and generation of causal LMs under a posterior (pyro_bdl.lm).

References no one here wrote: Hugging Face's greedy ``generate``, the materialised
decomposition of :func:`pyro_bdl.metrics.uncertainty_decomposition` over all ``(S, B, L, V)``
probabilities (which the streaming one must equal), and Pyro's own guide sampling.
Everything runs in float64 on a tiny Llama with a vocabulary of 23, so equalities hold to
rounding (1e-10); float32 and bf16 are checked where they are the point.
"""

import warnings

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from tiny_models import tiny_llama
from transformers import BertConfig, BertForSequenceClassification

import pyro_bdl as bdl
from pyro_bdl import lm
from pyro_bdl.inference import BLoBGuide, IVONGuide, LaplaceGuide, MeanFieldGuide
from pyro_bdl.metrics import uncertainty_decomposition
from pyro_bdl.models import lora_model
from pyro_bdl.predict import guide_draw

VOCAB = 23
NUM_DATA = 100


def _lora(dtype=torch.float64, adapters_random="AB", seed=0):
    """A tiny Llama with LoRA on q/v whose adapters are all non-zero (a fine-tuned look)."""
    base = tiny_llama(seed, dtype, vocab_size=VOCAB, bos_token_id=1, eos_token_id=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lora = lora_model(base, "causal_lm", rank=2, dropout=0.0, adapters_random=adapters_random)
    for name, param in lora.peft_model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=1.0)
    return lora


def _batch(seed=1):
    """Four windows of 7 tokens, the first two right-padded by 2 (labels -100 there)."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, VOCAB, (4, 7), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[:2, -2:] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def _draws(lora, num_draws, scale, seed=0):
    """``num_draws`` draws of the random sites: the module's values plus Gaussian noise."""
    generator = torch.Generator().manual_seed(seed)
    return {
        site: value + scale * torch.randn(num_draws, *value.shape, generator=generator).to(value)
        for site, value in lora.net.init_values().items()
    }


def _materialised(lora, batch, samples):
    """The reference: every draw's probabilities kept, ``(S, B, L - 1, V)``, decomposed at once."""
    probs = []
    num_draws = len(next(iter(samples.values())))
    for i in range(num_draws):
        with lora.net.fixed({k: v[i] for k, v in samples.items()}), torch.no_grad():
            inputs = {k: v for k, v in batch.items() if k != "labels"}
            logits = lora.peft_model(**inputs, use_cache=False).logits
        probs.append(torch.softmax(logits[:, :-1], dim=-1))
    probs = torch.stack(probs)
    scored = batch["labels"][:, 1:] != -100
    split = uncertainty_decomposition(probs[:, scored])
    mean = probs[:, scored].mean(0)
    nll = -mean.gather(-1, batch["labels"][:, 1:][scored][:, None]).squeeze(-1).log()
    return scored, split, nll


@pytest.mark.parametrize("chunk", [2**22, 30])  # a slice of rows at a time, or a row or two
def test_streaming_equals_the_materialised_decomposition_and_tu_is_au_plus_eu(chunk, monkeypatch):
    monkeypatch.setattr(lm._Running, "CHUNK", chunk)
    lora, batch = _lora(), _batch()
    batch["labels"][3, 2] = -100  # scored positions that are not all of them
    samples = _draws(lora, 5, scale=0.5)
    scores = lm.token_uncertainty(lora.model, batch, NUM_DATA, samples=samples)
    scored, split, nll = _materialised(lora, batch, samples)
    assert scores.total.shape == batch["input_ids"].shape and scores.total.dtype == torch.float64
    for name, reference in (
        ("total", split.total),
        ("aleatoric", split.aleatoric),
        ("epistemic", split.epistemic),
        ("nll", nll),
    ):
        torch.testing.assert_close(
            getattr(scores, name)[:, 1:][scored], reference, rtol=0, atol=1e-10
        )
    torch.testing.assert_close(
        scores.total[:, 1:][scored],
        (scores.aleatoric + scores.epistemic)[:, 1:][scored],
        rtol=0,
        atol=1e-12,
    )
    assert (scores.epistemic[:, 1:][scored] >= 0).all()
    assert (scores.epistemic[:, 1:][scored] > 1e-3).all()  # the draws do disagree


def test_identical_draws_have_no_epistemic_uncertainty():
    lora, batch = _lora(), _batch()
    one = _draws(lora, 1, scale=0.5)
    samples = {site: value.expand(4, *value.shape[1:]) for site, value in one.items()}
    scores = lm.token_uncertainty(lora.model, batch, NUM_DATA, samples=samples)
    single = lm.token_uncertainty(lora.model, batch, NUM_DATA, samples=one)
    scored = ~scores.total.isnan()
    # four equal float64 probability vectors averaged: equal to rounding
    assert scores.epistemic[scored].abs().max() < 1e-12
    torch.testing.assert_close(scores.total, single.total, rtol=0, atol=1e-12, equal_nan=True)


def test_positions_with_label_minus_100_are_nan_and_scores_are_aligned_with_labels():
    lora, batch = _lora(), _batch()
    batch["labels"][2, 3] = -100
    scores = lm.token_uncertainty(lora.model, batch, NUM_DATA, samples=_draws(lora, 2, 0.5))
    expected_nan = batch["labels"] == -100
    expected_nan[:, 0] = True  # the first token has no context to be predicted from
    for field in scores:
        assert torch.equal(field.isnan(), expected_nan)
    # entry t scores token t: its NLL under one draw is the cross-entropy of logits t - 1
    draw = _draws(lora, 1, 0.5, seed=3)
    single = lm.token_uncertainty(lora.model, batch, NUM_DATA, samples=draw)
    with lora.net.fixed({k: v[0] for k, v in draw.items()}), torch.no_grad():
        logits = lora.peft_model(input_ids=batch["input_ids"]).logits
    ce = torch.nn.functional.cross_entropy(
        logits[2, :-1], batch["input_ids"][2, 1:], reduction="none"
    )
    torch.testing.assert_close(single.nll[2, 1:], ce.masked_fill(expected_nan[2, 1:], torch.nan),
                               equal_nan=True)  # fmt: skip


def test_without_labels_the_unmasked_tokens_after_an_unmasked_one_are_scored():
    lora, batch = _lora(), _batch()
    batch["attention_mask"][3, :2] = 0  # left padding: token 2 of row 3 has no context
    samples = _draws(lora, 2, 0.5)
    scores = lm.token_uncertainty(
        lora.model,
        {k: v for k, v in batch.items() if k != "labels"},
        NUM_DATA,
        samples=samples,
    )
    mask = batch["attention_mask"].bool()
    expected = mask.clone()
    expected[:, 0] = False
    expected[:, 1:] &= mask[:, :-1]
    assert torch.equal(~scores.total.isnan(), expected)


def test_sequence_scores_are_the_mean_and_max_over_scored_positions():
    lora, batch = _lora(), _batch()
    batch["labels"][1, 1:] = -100  # a sequence with nothing scored
    scores = lm.token_uncertainty(lora.model, batch, NUM_DATA, samples=_draws(lora, 3, 0.5))
    mean, highest = scores.sequence("mean"), scores.sequence("max")
    for row in (0, 2, 3):
        kept = scores.epistemic[row][~scores.epistemic[row].isnan()]
        torch.testing.assert_close(mean.epistemic[row], kept.mean())
        torch.testing.assert_close(highest.epistemic[row], kept.max())
    assert mean.total[1].isnan() and highest.nll[1].isnan()
    with pytest.raises(ValueError, match="reduction"):
        scores.sequence("median")


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_generate_with_identical_draws_is_hugging_face_greedy_generate(dtype):
    lora = _lora(dtype=dtype)
    if dtype == torch.bfloat16:  # a bf16 base with float32 adapters, as for large models
        assert lora.peft_model.get_base_model().model.embed_tokens.weight.dtype == torch.bfloat16
        assert all(v.dtype == torch.float32 for v in lora.net.init_values().values())
    one = _draws(lora, 1, 0.5)
    draw = {site: value[0] for site, value in one.items()}
    samples = {site: value.expand(3, *value.shape[1:]) for site, value in one.items()}
    input_ids = _batch()["input_ids"][:, :5]
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :2] = 0  # left padding

    def hf(**options):
        with lora.net.fixed(draw), torch.no_grad():
            return lora.peft_model.generate(
                input_ids=input_ids, attention_mask=attention_mask, do_sample=False, **options
            )

    out = lm.generate(
        lora.model,
        input_ids,
        attention_mask=attention_mask,
        samples=samples,
        max_new_tokens=6,
        eos_token_id=[],
    )
    expected = hf(max_new_tokens=6, eos_token_id=None)
    assert torch.equal(out.sequences, expected)
    assert out.uncertainty.total.shape == (4, 6)
    assert out.uncertainty.total.dtype == torch.promote_types(dtype, torch.float32)
    assert out.uncertainty.epistemic.abs().max() < 1e-6  # float32 averages of equal vectors
    # an end-of-sequence token that row 0 emits: that row ends, is padded, and is NaN after
    eos = int(expected[0, 6])
    first = int((expected[0, 5:] == eos).nonzero()[0])
    out = lm.generate(
        lora.model,
        input_ids,
        attention_mask=attention_mask,
        samples=samples,
        max_new_tokens=6,
        eos_token_id=eos,
        pad_token_id=0,
    )
    assert torch.equal(out.sequences, hf(max_new_tokens=6, eos_token_id=eos, pad_token_id=0))
    assert (out.sequences[0, 5 + first + 1 :] == 0).all()
    assert out.uncertainty.total[0, first + 1 :].isnan().all()
    assert not out.uncertainty.total[0, : first + 1].isnan().any()


def test_generated_tokens_score_as_token_uncertainty_scores_the_generated_text():
    """Each draw's cache gives what a full forward over the finished text gives."""
    lora = _lora()
    samples = _draws(lora, 4, scale=0.5)
    prompts = _batch()["input_ids"][:, :4]
    out = lm.generate(lora.model, prompts, samples=samples, max_new_tokens=5, eos_token_id=[])
    labels = out.sequences.clone()
    labels[:, :4] = -100
    scores = lm.token_uncertainty(
        lora.model,
        {"input_ids": out.sequences, "labels": labels},
        NUM_DATA,
        samples=samples,
    )
    for field, generated in zip(scores, out.uncertainty):
        torch.testing.assert_close(generated.double(), field[:, 4:], rtol=0, atol=1e-5)
    assert (out.uncertainty.epistemic > 1e-3).all()


def test_sampling_draws_from_the_tempered_model_average():
    lora = _lora()
    samples = _draws(lora, 3, scale=0.5)
    prompts = _batch()["input_ids"][:1, :4].expand(2000, 4)

    def first_tokens(temperature):
        out = lm.generate(
            lora.model,
            prompts,
            samples=samples,
            max_new_tokens=1,
            do_sample=True,
            temperature=temperature,
            eos_token_id=[],
            generator=torch.Generator().manual_seed(0),
        )
        return torch.bincount(out.sequences[:, -1], minlength=VOCAB).double() / len(prompts)

    probs = _mean_next_token(lora, prompts[:1], samples)
    # 2000 draws of a categorical: each frequency within 4.5 standard errors (sd <= 0.011)
    for temperature, expected in ((1.0, probs), (0.5, probs**2 / (probs**2).sum())):
        assert (first_tokens(temperature) - expected).abs().max() < 0.05


def _mean_next_token(lora, prompt, samples):
    """The model average of the next token's distribution, draw by draw."""
    probs = []
    for i in range(len(next(iter(samples.values())))):
        with lora.net.fixed({k: v[i] for k, v in samples.items()}), torch.no_grad():
            probs.append(torch.softmax(lora.peft_model(input_ids=prompt).logits[0, -1], -1))
    return torch.stack(probs).mean(0)


def _guide(name):
    """A tiny model and a guide of each kind, set up (Laplace fitted) on one batch."""
    if name == "blob":
        lora = _lora(adapters_random="A")  # BLoB's layout: A random, B a point estimate
        return lora, BLoBGuide(lora.model, prior_std=0.2)
    lora = _lora()
    if name == "laplace":
        guide = LaplaceGuide(lora.model, curvature="kron")
        guide.fit(_batch(), NUM_DATA, map=False, mode_tolerance=None, progress=False)
        return lora, guide
    return lora, {"mean_field": MeanFieldGuide, "ivon": IVONGuide}[name](lora.model)


@pytest.mark.parametrize("name", ["laplace", "mean_field", "ivon", "blob"])
def test_a_guide_gives_the_same_scores_as_its_draws_of_the_weights(name):
    """A guide's draws are draws of the weights (BLoB's flipout, on, is not applied)."""
    (lora, guide), batch = _guide(name), _batch()
    guide(batch, NUM_DATA)  # the set-up, outside the seeded part
    pyro.set_rng_seed(7)
    draws = [guide_draw(guide, batch, NUM_DATA) for _ in range(3)]
    samples = {site: torch.stack([d[site] for d in draws]) for site in draws[0]}
    from_samples = lm.token_uncertainty(lora.model, batch, NUM_DATA, samples=samples)
    pyro.set_rng_seed(7)
    from_guide = lm.token_uncertainty(lora.model, batch, NUM_DATA, guide=guide, num_samples=3)
    for a, b in zip(from_guide, from_samples):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    scored = ~from_guide.epistemic.isnan()
    assert (from_guide.epistemic[scored] > 0).all()  # the guide's draws differ
    out = lm.generate(lora.model, batch["input_ids"][:, :3], guide=guide, num_samples=2,
                      max_new_tokens=2, eos_token_id=[])  # fmt: skip
    assert out.sequences.shape == (4, 5) and not out.uncertainty.total.isnan().any()


def test_draws_from_an_arviz_posterior_or_numpy_equal_the_tensor_draws():
    lora, batch = _lora(), _batch()
    samples = _draws(lora, 4, 0.5)
    expected = lm.token_uncertainty(lora.model, batch, NUM_DATA, samples=samples)
    grouped = {site: value.reshape(2, 2, *value.shape[1:]) for site, value in samples.items()}
    tree = bdl.to_arviz(grouped, grouped_by_chain=True)  # (chain, draw, ...) as on disk
    numpy = {site: value.numpy() for site, value in samples.items()}
    for source in (tree, tree["posterior"], numpy):
        got = lm.token_uncertainty(lora.model, batch, NUM_DATA, samples=source)
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12, equal_nan=True)


def test_a_model_that_calls_a_lifted_network_generates_like_its_bayesian_net():
    lora = _lora()
    net = lora.net

    def model(batch, num_data):
        logits = net(**{k: v for k, v in batch.items() if k != "labels"}).logits
        labels = batch.get("labels")
        bdl.observe(
            "y",
            dist.Categorical(logits=logits[:, :-1]),
            None if labels is None else labels[:, 1:].clamp_min(0),
            num_data,
        )
        return logits

    samples = _draws(lora, 2, 0.5)
    prompts = _batch()["input_ids"][:, :4]
    ours = lm.generate(model, prompts, samples=samples, max_new_tokens=3, eos_token_id=[])
    theirs = lm.generate(lora.model, prompts, samples=samples, max_new_tokens=3, eos_token_id=[])
    assert torch.equal(ours.sequences, theirs.sequences)
    torch.testing.assert_close(ours.uncertainty.total, theirs.uncertainty.total)


def test_inside_fixed_without_a_posterior_one_network_is_scored():
    lora, batch = _lora(), _batch()
    samples = _draws(lora, 1, 0.5)
    with lora.net.fixed({k: v[0] for k, v in samples.items()}):
        fixed = lm.token_uncertainty(lora.model, batch, NUM_DATA)
        with pytest.raises(ValueError, match="net.fixed"):
            lm.generate(lora.model, batch["input_ids"], samples=samples, max_new_tokens=1)
    drawn = lm.token_uncertainty(lora.model, batch, NUM_DATA, samples=samples)
    for a, b in zip(fixed, drawn):
        torch.testing.assert_close(a, b, equal_nan=True)
    with pytest.raises(KeyError, match="no value for the latent site"):
        lm.token_uncertainty(lora.model, batch, NUM_DATA)  # outside: prior draws, refused


def _encoder():
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return lora_model(BertForSequenceClassification(config), "classification", rank=2)


def test_bad_inputs_are_named_errors():
    lora, batch = _lora(), _batch()
    samples = _draws(lora, 2, 0.5)
    ids = batch["input_ids"]
    encoder = _encoder()
    encoder_draws = {k: v[None] for k, v in encoder.net.init_values().items()}
    with pytest.raises(ValueError, match="BertForSequenceClassification.*not a causal"):
        lm.token_uncertainty(encoder.model, batch, NUM_DATA, samples=encoder_draws)
    with pytest.raises(ValueError, match="not a causal"):
        lm.generate(encoder, ids, samples=encoder_draws, max_new_tokens=2)
    missing = dict(samples)
    site = sorted(missing)[0]
    del missing[site]
    with pytest.raises(KeyError, match=f"no value for the latent site '{site}'"):
        lm.token_uncertainty(lora.model, batch, NUM_DATA, samples=missing)
    with pytest.raises(KeyError, match="no value for the latent site"):
        lm.generate(lora.model, ids, samples=missing, max_new_tokens=2)
    with pytest.raises(ValueError, match="num_samples=3 .* pass guide="):
        lm.token_uncertainty(lora.model, batch, NUM_DATA, num_samples=3)
    with pytest.raises(ValueError, match="num_samples=3 .* pass guide="):
        lm.generate(lora.model, ids, samples=samples, num_samples=3, max_new_tokens=2)
    for bad in (0, -1):
        with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1"):
            lm.generate(lora.model, ids, samples=samples, max_new_tokens=bad)
    with pytest.raises(ValueError, match="temperature"):
        lm.generate(lora.model, ids, samples=samples, max_new_tokens=1, temperature=0)
    with pytest.raises(ValueError, match="attention_mask must be shaped like input_ids"):
        lm.generate(lora.model, ids, attention_mask=ids[:, :2], samples=samples, max_new_tokens=1)
    with pytest.raises(ValueError, match="input_ids must be integer token ids"):
        lm.generate(lora.model, ids.double(), samples=samples, max_new_tokens=1)
    with pytest.raises(ValueError, match="labels"):
        lm.token_uncertainty(lora.model, {**batch, "labels": ids[:, :3]}, 1, samples=samples)
    with pytest.raises(ValueError, match="samples or guide, not both"):
        lm.token_uncertainty(lora.model, batch, 1, samples=samples, guide=lambda *a: None)
    with pytest.raises(TypeError, match="batch must be a dict"):
        lm.token_uncertainty(lora.model, ids, NUM_DATA, samples=samples)

    torch.manual_seed(0)
    classifier = bdl.lift(torch.nn.Linear(3, 4).double())

    def not_a_language_model(batch, num_data):
        return classifier(batch["input_ids"].double()[:, :3])

    draws = {k: v[None] for k, v in classifier.init_values().items()}
    with pytest.raises(ValueError, match=r"next-token logits shaped \(batch, length"):
        lm.token_uncertainty(not_a_language_model, batch, NUM_DATA, samples=draws)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cpu_draws_score_and_generate_with_a_cuda_bf16_model():
    lora = _lora(dtype=torch.bfloat16)
    lora.peft_model.cuda()
    samples = _draws(lora, 3, 0.5)  # on the CPU
    samples = {k: v.cpu() for k, v in samples.items()}
    batch = _batch()
    scores = lm.token_uncertainty(lora.model, batch, NUM_DATA, samples=samples)
    assert scores.total.is_cuda and scores.total.dtype == torch.float32
    one = {k: v[:1].expand(3, *v.shape[1:]) for k, v in samples.items()}
    out = lm.generate(lora.model, batch["input_ids"].cuda(), samples=one, max_new_tokens=4,
                      eos_token_id=[])  # fmt: skip
    with lora.net.fixed({k: v[0].cuda() for k, v in one.items()}), torch.no_grad():
        expected = lora.peft_model.generate(
            input_ids=batch["input_ids"].cuda(), max_new_tokens=4, do_sample=False,
            eos_token_id=None,
        )  # fmt: skip
    assert torch.equal(out.sequences, expected)
    assert np.isfinite(out.uncertainty.total.cpu().numpy()).all()
