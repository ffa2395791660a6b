"""Networks and their Pyro models: the CNN-LSTM and LoRA language models.

Example::

    from pyro_bdl.models import cnn_lstm_model, lora_model

    model = cnn_lstm_model(20000)                         # IMDB, prior variance 1/40
    lora = lora_model("minilm", task="classification", num_labels=2)
    lora.model(batch, num_data)                          # a Pyro model; returns logits
"""

from pyro_bdl.models.bayesian_net import BayesianNet
from pyro_bdl.models.checkpointing import enable_checkpointing
from pyro_bdl.models.choice_texts import ChoiceTexts
from pyro_bdl.models.cnn_lstm import CNNLSTM, cnn_lstm_model
from pyro_bdl.models.heads import AnswerTokens, Classification, DictLogits, NextToken
from pyro_bdl.models.lora import LoRAModel, lora_model
from pyro_bdl.models.lstm import LSTM

__all__ = [
    "BayesianNet",
    "Classification",
    "AnswerTokens",
    "ChoiceTexts",
    "NextToken",
    "DictLogits",
    "CNNLSTM",
    "LSTM",
    "cnn_lstm_model",
    "lora_model",
    "LoRAModel",
    "enable_checkpointing",
]
