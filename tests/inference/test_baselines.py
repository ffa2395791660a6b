"""The BLoB-table baselines train, predict (S, B, C) probabilities, and keep to themselves.

BLoB, the table's own row, trains through its module (``fit_blob``) and predicts through
``predict_proba``, as every baseline's predictor does."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import BertConfig, BertForSequenceClassification

import pyro_bdl as bdl
from pyro_bdl.inference import BLoBGuide, baselines, fit_blob
from pyro_bdl.predict import predict_proba

NUM_DATA, BATCH, STEPS = 32, 8, 60


@pytest.fixture
def task():
    """A 1-layer BERT with LoRA (dropout 0.1) and labels that say whether token 7 occurs."""
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=40,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        num_labels=2,
    )
    base = BertForSequenceClassification(config).eval()
    lora = LoraConfig(
        r=2,
        lora_alpha=2,
        lora_dropout=0.1,
        target_modules=["query", "value"],
        modules_to_save=["classifier"],
    )
    net = bdl.lift(
        get_peft_model(base, lora),
        bdl.priors.IIDNormal(1.0),
        random="lora_A",
        point=lambda name, p: "lora_B" in name or "classifier" in name,
    )

    def model(batch, num_data=None):
        logits = net(input_ids=batch["input_ids"]).logits
        bdl.observe("y", dist.Categorical(logits=logits), batch.get("labels"), num_data)
        return logits

    model.net = net  # as BayesianNet models carry their network
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(8, 40, (NUM_DATA, 6), generator=generator)
    labels = torch.randint(0, 2, (NUM_DATA,), generator=generator)
    input_ids[labels == 1, 2] = 7
    data = [{"input_ids": i, "labels": y} for i, y in zip(input_ids, labels)]
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=True, generator=generator)
    everything = {"input_ids": input_ids, "labels": labels}
    return net, model, loader, everything


def _nll(probs, labels):
    return -probs.mean(0)[torch.arange(len(labels)), labels].log().mean().item()


METHODS = {
    "mle": ({}, 1),
    "map_estimate": ({"weight_decay": 1e-2}, 1),
    "mc_dropout": ({"num_samples": 5}, 5),
    "deep_ensemble": ({"num_members": 3}, 3),
    "bbb": ({"num_samples": 4}, 4),
    "blob": ({"num_samples": 4, "kl_lr": 0.01}, 4),
}


def _blob(model, *args, num_samples, **kwargs):
    """BLoB at the paper's RoBERTa prior, fitted by fit_blob, predicting its draws."""
    guide = BLoBGuide(model, model.net, prior_std=0.2)
    fit_blob(model, guide, *args, **kwargs)
    model.net.module.eval()  # the LoRA dropout off while predicting, as the predictors do
    return lambda *batch: predict_proba(model, *batch, guide=guide, num_samples=num_samples)


@pytest.mark.parametrize("method", list(METHODS))
def test_each_baseline_trains_and_predicts_class_probabilities(task, method):
    net, model, loader, everything = task
    options, num_draws = METHODS[method]
    with torch.no_grad():
        untrained = predict_proba(
            model, everything, samples={k: v[None] for k, v in net.init_values().items()}
        )
    pyro.set_rng_seed(0)
    fit = _blob if method == "blob" else getattr(baselines, method)
    predictor = fit(model, loader, NUM_DATA, num_steps=STEPS, lr=1e-2, progress=False, **options)
    probs = predictor(everything, NUM_DATA)
    assert probs.shape == (num_draws, NUM_DATA, 2)
    torch.testing.assert_close(probs.sum(-1), torch.ones(num_draws, NUM_DATA))
    if num_draws > 1:  # dropout passes, members and weight draws differ
        assert torch.unique(probs, dim=0).shape[0] == num_draws
    assert _nll(probs, everything["labels"]) < _nll(untrained, everything["labels"]) - 0.05


def test_blob_with_no_samples_predicts_with_the_mean_weights(task):
    net, model, loader, everything = task
    guide = BLoBGuide(model, net, prior_std=0.2)
    fit_blob(model, guide, loader, NUM_DATA, num_steps=5, progress=False)
    net.module.eval()
    mean = {name: value[None] for name, value in guide.median().items()}
    probs = predict_proba(model, everything, NUM_DATA, samples=mean)
    assert probs.shape == (1, NUM_DATA, 2)
    store = pyro.get_param_store()
    point_weights = {site: store[site].detach() for site in net.point_sites}
    with torch.no_grad():
        with net.fixed({**guide.median(), **point_weights}):
            logits = net.module(input_ids=everything["input_ids"]).logits
    torch.testing.assert_close(probs[0], torch.softmax(logits, -1))
    # no draw, and flipout (on in the guide) leaves the mean weights' forward alone
    assert torch.equal(predict_proba(model, everything, NUM_DATA, samples=mean), probs)


def test_fits_on_one_network_do_not_disturb_each_others_predictions(task):
    net, model, loader, everything = task
    prior = net.prior
    first = baselines.mle(model, loader, NUM_DATA, num_steps=10, lr=1e-2, progress=False)
    bbb = baselines.bbb(model, loader, NUM_DATA, num_steps=10, lr=1e-2, progress=False)
    assert net.prior is prior  # BBB's prior_std held for its own fit only
    before = first(everything, NUM_DATA), bbb.members[0].median
    # A later fit starts afresh: B from the module (zero), not from the earlier fits.
    second = baselines.mle(model, loader, NUM_DATA, num_steps=10, lr=1e-2, progress=False)
    torch.testing.assert_close(first(everything, NUM_DATA), before[0], rtol=0, atol=0)
    assert not torch.equal(second(everything, NUM_DATA), before[0])
    assert bbb(everything, NUM_DATA).shape == (10, NUM_DATA, 2)


def test_deep_ensemble_restores_the_modules_adapter(task):
    net, model, loader, _ = task
    initial = {
        name: p.detach().clone() for name, p in net.module.named_parameters() if p.requires_grad
    }
    baselines.deep_ensemble(model, loader, NUM_DATA, num_steps=2, num_members=2, progress=False)
    for name, p in net.module.named_parameters():
        if p.requires_grad:
            assert torch.equal(p, initial[name]), name


def test_missing_pieces_are_errors_naming_the_fix(task):
    net, model, loader, _ = task
    without_dropout = bdl.lift(
        get_peft_model(
            BertForSequenceClassification(
                BertConfig(
                    vocab_size=40,
                    hidden_size=8,
                    num_hidden_layers=1,
                    num_attention_heads=2,
                    intermediate_size=8,
                )
            ),
            LoraConfig(r=2, target_modules=["query"]),
        ),
        random="lora_A",
        point="lora_B",
    )
    with pytest.raises(ValueError, match="lora_dropout"):
        baselines.mc_dropout(model, loader, NUM_DATA, num_steps=1, net=without_dropout)
    with pytest.raises(TypeError, match="net="):
        baselines.mle(lambda batch, num_data: model(batch, num_data), loader, NUM_DATA, num_steps=1)
    with pytest.raises(ValueError, match="num_members"):
        baselines.deep_ensemble(model, loader, NUM_DATA, num_steps=1, net=net, num_members=0)


@pytest.mark.parametrize("schedule", ["linear", "constant"])
def test_adamw_follows_the_warmup_schedule_step_by_step(schedule):
    """Each Pyro parameter's AdamW runs at lr * warmup_schedule(t) at its step t."""
    num_steps, lr = 20, 0.1
    optimizer = baselines.adamw(lr, num_steps=num_steps, schedule=schedule, warmup_ratio=0.25)

    def model():
        loc = pyro.param("loc", torch.zeros(2))
        pyro.sample("x", dist.Normal(loc, 1.0).to_event(1), obs=torch.ones(2))

    svi = pyro.infer.SVI(model, lambda: None, optimizer, pyro.infer.Trace_ELBO())
    rates = []
    for _ in range(num_steps):
        svi.step()
        (torch_optimizer,) = optimizer.optim_objs.values()
        rates.append(torch_optimizer.param_groups[0]["lr"])
    warmup = [lr * t / 5 for t in range(1, 6)]  # 5 warm-up steps reach the peak
    after = [lr * (num_steps - t) / 15 for t in range(6, num_steps + 1)]
    expected = warmup + (after if schedule == "linear" else [lr] * (num_steps - 5))
    assert rates == pytest.approx(expected)


def test_adamw_names_a_bad_setting():
    with pytest.raises(ValueError, match="schedule must be one of"):
        baselines.adamw(1e-3, num_steps=10, schedule="cosine")
    with pytest.raises(ValueError, match="warmup_ratio"):
        baselines.adamw(1e-3, num_steps=10, warmup_ratio=1.0)
    with pytest.raises(ValueError, match="num_steps"):
        baselines.adamw(1e-3, num_steps=0)


def _squared_norm(predictor):
    """Of the random weights (LoRA A): the fitted values, or the guide's means."""
    (member,) = predictor.members
    weights = member.median or member.samples
    return sum(float(value.square().sum()) for value in weights.values())


def test_map_weight_decay_and_bbb_prior_pull_the_weights_to_zero(task):
    # AdamW's decoupled decay multiplies the weights by 1 - lr * decay = 0.99 per step
    # (0.55 over 60 steps) against the data's pull: the MAP's squared norm ends at 0.59 of
    # the MLE's here; a MAP that drops its decay ends where MLE does (ratio 1). A BBB fit
    # under a prior N(0, 0.01^2) has a KL whose pull on the means (mean / 0.01^2) dwarfs
    # the likelihood's: its means end three times smaller than under the network's
    # N(0, 1) (a BBB that ignores prior_std: ratio 1). Both runs are seeded.
    net, model, loader, everything = task
    norms = {}
    for name, method, options in [
        ("mle", baselines.mle, {}),
        ("map", baselines.map_estimate, {"weight_decay": 1.0}),
        ("bbb-wide", baselines.bbb, {"prior_std": None}),
        ("bbb-narrow", baselines.bbb, {"prior_std": 0.01}),
    ]:
        pyro.set_rng_seed(0)
        predictor = method(
            model,
            loader,
            NUM_DATA,
            num_steps=STEPS,
            lr=1e-2,
            schedule="constant",  # the rates the arithmetic above assumes
            warmup_ratio=0.0,
            progress=False,
            **options,
        )
        norms[name] = _squared_norm(predictor)
    assert norms["map"] < 0.75 * norms["mle"]
    assert norms["bbb-narrow"] < 0.5 * norms["bbb-wide"]


def test_point_is_the_weights_the_predictor_predicts_with(task):
    net, model, loader, everything = task
    pyro.set_rng_seed(0)
    predictor = baselines.map_estimate(
        model, loader, NUM_DATA, num_steps=5, lr=1e-2, progress=False
    )
    theta = predictor.point()
    assert set(theta) == set(net.random_sites)
    point_weights = predictor.members[0].model_params
    with torch.no_grad(), net.fixed({**theta, **point_weights}):
        logits = net.module(input_ids=everything["input_ids"]).logits
    torch.testing.assert_close(predictor(everything, NUM_DATA)[0], torch.softmax(logits, -1))
    ensemble = baselines.deep_ensemble(
        model, loader, NUM_DATA, num_steps=1, num_members=2, progress=False
    )
    with pytest.raises(ValueError, match="no single point estimate"):
        ensemble.point()


def _over_confident(seed: int, informative: bool = True, num_data: int = 4000):
    """Validation batches of 4-way logits z with labels drawn from softmax(z) (or, not
    informative, uniformly), and a predictor three times too confident: softmax(3 z)."""
    generator = torch.Generator().manual_seed(seed)
    logits = 1.5 * torch.randn(num_data, 4, generator=generator, dtype=torch.float64)
    if informative:
        labels = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)[:, 0]
    else:
        labels = torch.randint(0, 4, (num_data,), generator=generator)
    batches = [
        {"logits": logits[i : i + 500], "labels": labels[i : i + 500]}
        for i in range(0, num_data, 500)
    ]
    return batches, lambda batch: torch.softmax(3.0 * batch["logits"], -1)[None]


def test_temperature_scaling_recovers_a_known_temperature():
    # The predictor's log probabilities are 3 z + const: T = 3 gives back the labels' own
    # distribution. Over 20 seeds of 4,000 labels the fitted T had mean 3.016, sd 0.055:
    # 0.2 is 3.6 sd.
    batches, predictor = _over_confident(seed=0)
    scaled = baselines.temperature_scaling(predictor, batches)
    assert abs(scaled.temperature - 3.0) < 0.2
    assert scaled.validation_nll["fitted"] < scaled.validation_nll["T=1"]
    probs = scaled(batches[0])
    assert probs.shape == (1, 500, 4)
    assert torch.equal(probs.argmax(-1), predictor(batches[0]).argmax(-1))  # accuracy kept


def test_temperature_scaling_warns_when_every_answer_would_be_uniform():
    # Labels independent of the logits: the NLL falls all the way to T = infinity.
    batches, predictor = _over_confident(seed=0, informative=False)
    with pytest.warns(UserWarning, match="max_temperature=20.*near-uniform"):
        scaled = baselines.temperature_scaling(predictor, batches)
    assert scaled.temperature == pytest.approx(20.0, rel=0.01)


@pytest.mark.parametrize(
    "bounds, match",
    [((0.0, 10.0), "min_temperature"), ((5.0, 2.0), "must be below max_temperature")],
)
def test_temperature_scaling_refuses_bad_bounds(bounds, match):
    batches, predictor = _over_confident(seed=0, num_data=500)
    with pytest.raises(ValueError, match=match):
        baselines.temperature_scaling(
            predictor, batches, min_temperature=bounds[0], max_temperature=bounds[1]
        )
