"""fit_laplace_lora: Laplace-LoRA's post-hoc recipe on a tiny Llama that answers multiple
choice questions through the next-token logits of its answer tokens (float64)."""

import pytest
import torch
from tiny_models import tiny_llama
from torch.utils.data import DataLoader

import pyro_bdl as bdl
from pyro_bdl.inference import LaplaceGuide, fit_laplace_lora
from pyro_bdl.models import lora_model

VOCAB, ANSWERS = 23, [3, 4, 5]


def _lora():
    """LoRA (rank 2) on q/v of a tiny Llama, its adapters non-zero (a fine-tuned look),
    under Laplace-LoRA's fan-in-scaled prior."""
    base = tiny_llama(0, torch.float64, vocab_size=VOCAB, bos_token_id=1, eos_token_id=2)
    prior = bdl.priors.LayerwiseNormal.fan_in()
    lora = lora_model(base, "multiple_choice", label_token_ids=ANSWERS, prior=prior, rank=2)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in lora.peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(0.5 * torch.randn(param.shape, generator=generator))
    return lora


def _batches(num: int, seed: int) -> DataLoader:
    """Prompts of 6 tokens whose answer is their first token mod 3, in batches of 8."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(6, VOCAB, (num, 6), generator=generator)
    examples = [
        {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids[0] % 3}
        for ids in input_ids
    ]
    return DataLoader(examples, batch_size=8)


@pytest.fixture(scope="module")
def fitted():
    lora = _lora()
    train, validation = _batches(32, seed=1), _batches(16, seed=2)
    guide, link, scores = fit_laplace_lora(lora.model, train, 32, validation, num_steps=300)
    return lora, guide, link, scores, validation


def test_the_prior_precision_maximises_the_evidence_per_weight_tensor(fitted):
    _, guide, *_ = fitted
    tuned = {site: delta.clone() for site, delta in guide.prior_precision.items()}
    assert len(tuned) == 8 and len({float(d) for d in tuned.values()}) == 8  # one per tensor
    best = float(guide.log_marginal_likelihood())
    # the evidence is smooth in log delta: at its maximum, moving any one tensor's delta,
    # or all of them together, by a factor of 1.5 either way lowers it
    moves = [{site: factor} for site in tuned for factor in (1 / 1.5, 1.5)]
    moves += [dict.fromkeys(tuned, factor) for factor in (1 / 1.5, 1.5)]
    try:
        for move in moves:
            guide.prior_precision = {s: d * move.get(s, 1.0) for s, d in tuned.items()}
            assert float(guide.log_marginal_likelihood()) < best, move
    finally:
        guide.prior_precision = tuned


def test_the_link_is_the_one_with_the_lowest_validation_nll(fitted):
    lora, guide, link, scores, validation = fitted
    assert set(scores) == {"mc", "probit", "bridge"}
    assert link == min(scores, key=scores.get) and guide.link == link
    labels = torch.cat([batch["labels"] for batch in validation])
    for name in ("probit", "bridge"):  # closed forms: the NLL recomputed from predictive
        probs = torch.cat([guide.predictive(batch, 32, link=name) for batch in validation])
        nll = -probs.gather(-1, labels[:, None]).log().mean()
        assert scores[name] == pytest.approx(float(nll), rel=1e-10)


def test_it_is_the_guides_three_steps_at_the_checkpoint():
    # the same fit by LaplaceGuide's own methods gives the same posterior and choice
    lora = _lora()
    train, validation = _batches(16, seed=1), _batches(8, seed=2)
    theta = {site: value.detach().clone() for site, value in lora.net.init_values().items()}
    guide, link, scores = fit_laplace_lora(
        lora.model, train, 16, validation, map=theta, num_steps=300, links=("probit", "bridge")
    )
    by_hand = LaplaceGuide(lora.model, curvature="kron")
    by_hand.fit(train, 16, map=False, mode_tolerance=None, progress=False)
    by_hand.optimize_prior_precision("marglik", num_steps=300)
    expected = by_hand.select_link(validation, 16, links=("probit", "bridge"))
    assert (link, scores) == expected
    for site, delta in by_hand.prior_precision.items():
        torch.testing.assert_close(guide.prior_precision[site], delta)


def test_several_links_need_validation_data():
    lora = _lora()
    with pytest.raises(ValueError, match="validation_loader"):
        fit_laplace_lora(lora.model, _batches(8, 1), 8)
    with pytest.raises(ValueError, match="links"):
        fit_laplace_lora(lora.model, _batches(8, 1), 8, links=("softmax",))
    guide, link, scores = fit_laplace_lora(lora.model, _batches(8, 1), 8, links=("mc",))
    assert link == guide.link == "mc" and scores is None


# the evidence's convergence is not what is tested here (300 steps keep the test short)
@pytest.mark.filterwarnings("ignore:optimize_prior_precision:RuntimeWarning")
def test_a_map_estimate_fine_tune_goes_in_by_its_point_with_progress_bars(capsys):
    # The README's recipe: map_estimate -> fit_laplace_lora(map=predictor.point()) ->
    # temperature_scaling, on a fresh adapter (B = 0) with LoRA dropout on while fitting.
    from pyro_bdl.inference.baselines import map_estimate, temperature_scaling

    base = tiny_llama(0, torch.float64, vocab_size=VOCAB, bos_token_id=1, eos_token_id=2)
    lora = lora_model(base, "multiple_choice", label_token_ids=ANSWERS, rank=2)
    train, validation = _batches(32, seed=1), _batches(16, seed=2)
    before = lora.net.init_values()
    lora.train()
    predictor = map_estimate(lora.model, train, 32, num_steps=80, lr=3e-2)
    lora.eval()
    point = predictor.point()
    assert any(not torch.equal(point[s], before[s]) for s in before)  # it fine-tuned
    assert all(torch.equal(v, before[s]) for s, v in lora.net.init_values().items())  # module kept
    guide, link, _ = fit_laplace_lora(lora.model, train, 32, validation, map=point, num_steps=300)
    for site, value in guide.median().items():
        torch.testing.assert_close(value, point[site])  # the posterior is centred on the fine-tune
    bars = capsys.readouterr().err
    assert "MLE" in bars and "it/s" in bars  # map_estimate's and the Laplace passes' bars
    scaled = temperature_scaling(predictor, validation, 32)
    assert 0.05 <= scaled.temperature <= 20.0
    assert scaled.validation_nll["fitted"] <= scaled.validation_nll["T=1"] + 1e-12
