"""The SmolLM2 learnability experiment: its held-out split is disjoint, its methods are
scored at the fine-tune (the --quick run is in validation/experiments)."""

import math
from types import SimpleNamespace

import pytest
import torch
from tiny_models import tiny_llama

from experiments import main, run_experiment
from experiments.causal_lm import FrozenPrefix, hidden_loader
from experiments.llm_learnability import (
    FULL,
    METHODS,
    _compare,
    _map_probabilities,
    _score,
    _sizes,
    _split,
)
from pyro_bdl.data import load
from pyro_bdl.inference.baselines import map_estimate
from pyro_bdl.models import lora_model
from pyro_bdl.priors import IIDNormal


@pytest.mark.parametrize("dataset", ["sst2", "imdb"])
def test_validation_and_test_come_from_the_held_out_split_disjoint(shared_data, dataset):
    sizes = {"num_train": 6, "num_validation": 5, "num_test": 7}
    experiment = SimpleNamespace(data_dir=shared_data)
    train, validation, test = _split(experiment, dataset, sizes, seed=0)
    assert (len(train), len(validation), len(test)) == (6, 5, 7)
    held_out = {record["text"] for record in load(dataset, shared_data, "test")}
    texts = [record["text"] for record in validation + test]
    assert set(texts) <= held_out and len(set(texts)) == len(texts)
    # The validation records are the held-out draw of that size (the settings' probe set).
    assert validation == list(load(dataset, shared_data, "test", limit=5, seed=0))


# Random labels: no temperature beats uniform answers, and a 5-step evidence fit is short.
@pytest.mark.filterwarnings("ignore:temperature_scaling", "ignore:optimize_prior_precision")
def test_the_methods_are_scored_at_the_fine_tune():
    # A tiny Llama cut to its last layer, random prompts of two classes (answer tokens 3, 4).
    model = tiny_llama(0, torch.float32, vocab_size=23).eval()
    prefix = FrozenPrefix(model, top_layers=1)
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(5, 23, (28, 6), generator=generator)
    hidden = prefix.hidden(input_ids, torch.ones_like(input_ids))
    labels = torch.randint(0, 2, (28,), generator=generator)
    items = [{"h": h, "label": y} for h, y in zip(hidden, labels, strict=True)]
    train, validation, test = items[:12], items[12:20], items[20:]
    lora = lora_model(model, "multiple_choice", label_token_ids=[3, 4])
    initial = lora.net.init_values()
    lora.train()
    predictor = map_estimate(
        lora.model, hidden_loader(train, 4, seed=0), 12, num_steps=3, progress=False
    )
    lora.eval()  # the module keeps its initial adapters: the predictor's are scored
    methods = _compare(
        lora, predictor, train, validation, test, {"batch_size": 4, "marglik_steps": 5}
    )
    assert list(methods) == list(METHODS)
    fine_tuned = _score(_map_probabilities(lora, predictor.point(), 12), test)
    assert methods["MAP"] == fine_tuned != _score(_map_probabilities(lora, initial, 12), test)
    # Temperature scaling keeps every answer; the others' scores are probabilities' scores.
    assert methods["MAP+TS"]["accuracy"] == methods["MAP"]["accuracy"]
    assert methods["LA"]["link"] in ("mc", "probit", "bridge")
    for scores in methods.values():
        assert 0.0 <= scores["accuracy"] <= 1.0 and math.isfinite(scores["nll"])
    assert isinstance(lora.net.prior, IIDNormal)  # Laplace's fan-in prior was put back


def test_sizes_override_the_defaults_and_are_checked():
    sizes = _sizes(FULL, {"num_train": 256, "lr": 3, "num_steps": 96, "eval_every": 32})
    assert sizes == {**FULL, "num_train": 256, "lr": 3.0, "num_steps": 96, "eval_every": 32}
    assert isinstance(sizes["lr"], float) and FULL["num_train"] == 512  # defaults kept
    for overrides, message in [
        ({"num_trian": 256}, r"\['num_trian'\] are not among"),
        ({"num_train": 25.6}, "num_train must be an int"),
        ({"lr": 0}, "lr must be > 0"),
        ({"num_steps": 100}, "multiple of eval_every"),
    ]:
        with pytest.raises(ValueError, match=f"--sizes: .*{message}"):
            _sizes(FULL, overrides)


def test_the_command_line_passes_sizes_to_the_experiment_that_takes_them(
    capsys, tmp_path, shared_data
):
    # A bad name is refused before any model is loaded or any cell is written.
    command = ["llm-learnability", "--data-dir", str(shared_data), "--out", str(tmp_path)]
    with pytest.raises(SystemExit) as exit:
        main([*command, "--sizes", "num_train=8", "top_layer=2"])
    # sys.exit(message): status 1, the message on stderr
    assert exit.value.code.startswith("python -m experiments: error: --sizes: ['top_layer']")
    with pytest.raises(SystemExit) as exit:
        main([*command, "--sizes", "num_train"])
    assert exit.value.code == 2 and "NAME=VALUE" in capsys.readouterr().err
    assert not list((tmp_path / "cells").iterdir())
    with pytest.raises(ValueError, match="--sizes: the ood experiment has fixed sizes"):
        run_experiment("ood", data_dir=shared_data, out=tmp_path, sizes={"num_train": 8})
