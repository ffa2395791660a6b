"""Bad inputs to the CNN-LSTM and its Pyro model: named errors at the call."""

import pytest
import torch

import pyro_bdl as bdl
from pyro_bdl.models import CNNLSTM, BayesianNet, cnn_lstm_model

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
    with pytest.raises(ValueError, match="num_data must be an int at least"):
        BayesianNet(net)(batch, 1)
