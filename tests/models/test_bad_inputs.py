"""Bad inputs to the models: named errors at the call (CNN-LSTM, lora_model, checkpointing)."""

import pytest
import torch

import pyro_bdl as bdl
from pyro_bdl.models import CNNLSTM, BayesianNet, cnn_lstm_model, enable_checkpointing, lora_model

SMALL = {"vocab_size": 30, "embedding_dim": 4, "num_filters": 3, "hidden_size": 5}

CNN_LSTM = [
    ({"vocab_size": 0}, ValueError, "vocab_size must be an int >= 1"),
    ({"vocab_size": 30.0}, TypeError, "vocab_size must be an int"),
    ({"embedding_dim": True}, TypeError, "embedding_dim must be"),
    ({"num_filters": -2}, ValueError, "num_filters must be"),
    ({"kernel_size": "5"}, TypeError, "kernel_size must be"),
    ({"pool_size": 0}, ValueError, "pool_size must be"),
    ({"hidden_size": None}, TypeError, "hidden_size must be"),
    ({"num_classes": 1}, ValueError, "num_classes must be at least 2"),
]


@pytest.mark.parametrize("options, error, message", CNN_LSTM, ids=str)
def test_cnn_lstm(options, error, message):
    with pytest.raises(error, match=message):
        CNNLSTM(**{**SMALL, **options})


@pytest.mark.parametrize(
    "input_ids, error, message",
    [
        (torch.zeros(2, 20), TypeError, r"input_ids must be a tensor of word indices"),
        ([[1, 2, 3]], TypeError, r"input_ids must be a tensor"),
        (torch.zeros(2, 7, dtype=torch.long), ValueError, r"input_ids must have shape"),
        (torch.zeros(20, dtype=torch.long), ValueError, r"input_ids must have shape"),
        (torch.zeros(2, 3, 20, dtype=torch.long), ValueError, r"input_ids must have shape"),
    ],
    ids=str,
)
def test_cnn_lstm_forward(input_ids, error, message):
    with pytest.raises(error, match=message):
        CNNLSTM(**SMALL)(input_ids)


CNN_LSTM_MODEL = [
    ({"net": "imdb"}, TypeError, "net must be an int"),
    ({"net": 0}, ValueError, "net must be an int >= 1"),
    ({"net": True}, TypeError, "net must be"),
    ({"prior_variance": 0.0}, ValueError, "prior_variance must be a positive"),
    ({"prior_variance": "1/40"}, TypeError, "prior_variance must be"),
    ({"prior_variance": float("inf")}, ValueError, "prior_variance must be a positive finite"),
    ({"prior": bdl.priors.IIDNormal, "net": CNNLSTM(**SMALL)}, TypeError, "prior must be a prior"),
    (
        {"prior": bdl.priors.IIDNormal(0.1), "prior_variance": 0.5, "net": CNNLSTM(**SMALL)},
        ValueError,
        "prior_variance .* or prior, not both",
    ),
]


@pytest.mark.parametrize("options, error, message", CNN_LSTM_MODEL, ids=str)
def test_cnn_lstm_model(options, error, message):
    options = {"net": CNNLSTM(**SMALL), **options}
    with pytest.raises(error, match=message):
        cnn_lstm_model(options.pop("net"), **options)


def test_bayesian_net():
    net = bdl.lift(CNNLSTM(**SMALL))
    with pytest.raises(TypeError, match="net must be a LiftedModule"):
        BayesianNet(CNNLSTM(**SMALL))
    with pytest.raises(TypeError, match="head must have logits"):
        BayesianNet(net, head="classification")
    with pytest.raises(TypeError, match="name must be a site name"):
        BayesianNet(net, name=3)
    with pytest.raises(TypeError, match="dict batch"):
        BayesianNet(net)(torch.zeros(2, 20, dtype=torch.long), 10)
    batch = {"input_ids": torch.zeros(2, 20, dtype=torch.long), "labels": torch.zeros(2)}
    with pytest.raises(ValueError, match="num_data must be the size of the whole training set"):
        BayesianNet(net)(batch, 1)


# lora_model and enable_checkpointing: each case the keyword arguments (on a tiny Llama
# unless ``base`` is given), the error type and the argument name the message contains.
MC = {"task": "multiple_choice", "label_token_ids": [3, 4]}

LORA_MODEL = [
    ({"base": 3}, TypeError, "base"),
    ({"base": None}, TypeError, "base"),
    ({"task": "regression"}, ValueError, "task"),
    ({"task": 1}, ValueError, "task"),
    ({"task": "classification", "num_labels": 1}, ValueError, "num_labels"),
    ({"task": "classification", "num_labels": 2.0}, TypeError, "num_labels"),
    ({**MC, "label_token_ids": "AB"}, TypeError, "label_token_ids"),
    ({**MC, "label_token_ids": [3, -1]}, ValueError, "label_token_ids"),
    ({**MC, "label_token_ids": [3, 4.0]}, TypeError, "label_token_ids"),
    ({"rank": 0}, ValueError, "rank"),
    ({"rank": 2.5}, TypeError, "rank"),
    ({"rank": True}, TypeError, "rank"),
    ({"alpha": 0}, ValueError, "alpha"),
    ({"alpha": float("inf")}, ValueError, "alpha"),
    ({"dropout": 1.0}, ValueError, "dropout"),
    ({"dropout": -0.1}, ValueError, "dropout"),
    ({"target_modules": "q_proj"}, TypeError, "target_modules"),
    ({"target_modules": []}, TypeError, "target_modules"),
    ({"target_modules": ["q_proj", 3]}, TypeError, "target_modules"),
    ({"head": "bayesian"}, ValueError, "head"),
    ({"adapters_random": "B"}, ValueError, "adapters_random"),
    ({"prior": "normal"}, TypeError, "prior"),
    ({"prior_scale": 0}, ValueError, "prior_scale"),
    ({"prior_scale": "0.2"}, TypeError, "prior_scale"),
    ({"gradient_checkpointing": "yes"}, TypeError, "gradient_checkpointing"),
    ({"dtype": "float99"}, TypeError, "dtype"),
    ({"dtype": 16}, TypeError, "dtype"),
]


@pytest.mark.parametrize(
    "kwargs, error, argument", LORA_MODEL, ids=[str(case[0]) for case in LORA_MODEL]
)
def test_lora_model_bad_inputs_are_named_errors(tiny_llama, kwargs, error, argument):
    kwargs = dict(kwargs)
    base = kwargs.pop("base", tiny_llama())
    kwargs.setdefault("task", "causal_lm")
    before = (
        {name: p.detach().clone() for name, p in base.named_parameters()}
        if (isinstance(base, torch.nn.Module))
        else None
    )
    with pytest.raises(error) as raised:
        lora_model(base, **kwargs)
    assert argument in str(raised.value), str(raised.value)
    if before is not None:  # refused before any work: no adapters added
        assert {name for name, _ in base.named_parameters()} == set(before)


class _NoCheckpointing(torch.nn.Module):
    supports_gradient_checkpointing = False

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 2)


CHECKPOINTING = [
    (lambda llama: None, TypeError, "net"),
    (lambda llama: "net", TypeError, "net"),
    (lambda llama: llama, TypeError, "net"),  # the module itself, not lifted
    (lambda llama: torch.nn.Linear(2, 2), TypeError, "net"),
    (lambda llama: bdl.lift(_NoCheckpointing()), ValueError, "gradient_checkpointing"),
]


@pytest.mark.parametrize("make, error, argument", CHECKPOINTING)
def test_enable_checkpointing_bad_inputs_are_named_errors(tiny_llama, make, error, argument):
    with pytest.raises(error) as raised:
        enable_checkpointing(make(tiny_llama()))
    assert argument in str(raised.value), str(raised.value)


def test_every_entry_point_has_at_least_five_bad_inputs():
    assert len(LORA_MODEL) >= 5 and len(CHECKPOINTING) >= 5
