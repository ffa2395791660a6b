"""The CNN-LSTM of the cold-posterior experiments on IMDB, and its Pyro model."""

from __future__ import annotations

import torch
from torch import nn

from pyro_bdl._checks import integer, real
from pyro_bdl.lift import lift
from pyro_bdl.models.bayesian_net import BayesianNet
from pyro_bdl.models.heads import Classification
from pyro_bdl.models.lstm import LSTM
from pyro_bdl.priors import IIDNormal, Prior

__all__ = ["CNNLSTM", "cnn_lstm_model"]


class CNNLSTM(nn.Module):
    """Embedding, 1-D convolution, ReLU, max-pooling, LSTM and a linear layer on the last step.

    The sentiment classifier of Wenzel et al. (2020) and Izmailov et al. (2021), used by
    the posteriors paper (section 5.1, Appendix D) for the cold-posterior experiments on
    IMDB. With the defaults and reviews of 100 tokens it has 2,700,098 parameters, as
    the original Keras model: ``Embedding(20000, 128)``, ``Conv1d(128 -> 64, kernel
    5)`` (100 -> 96 steps), ``MaxPool1d(4)`` (-> 24 steps), an LSTM with 128 units and
    one gate bias (:class:`~pyro_bdl.models.lstm.LSTM`, which ``torch.func.vmap`` can
    batch), ``Linear(128 -> 2)``.

    Inputs are word indices padded at the front with 0 (Keras' default ``pre`` padding,
    :class:`pyro_bdl.data.vocabulary.WordVocabulary`), so the last step is the real end
    of every review and no mask is needed. Layers are initialised with PyTorch's
    defaults, as in the posteriors example.

    **References**

    [1] F. Wenzel et al. How good is the Bayes posterior in deep neural networks really?
    ICML 2020.
    [2] P. Izmailov, S. Vikram, M. D. Hoffman, A. G. Wilson. What are Bayesian neural
    network posteriors really like? ICML 2021.
    [3] S. Duffield et al. Scalable Bayesian learning with posteriors. 2024, section 5.1
    and Appendix D.

    Example::

        net = CNNLSTM()
        logits = net(torch.randint(0, 20000, (32, 100)))   # (32, 2)

    :param int vocab_size: rows of the embedding (word indices ``0 .. vocab_size - 1``).
    :param int embedding_dim: embedding size.
    :param int num_filters: convolution channels.
    :param int kernel_size: convolution width.
    :param int pool_size: max-pooling width and stride.
    :param int hidden_size: LSTM units.
    :param int num_classes: output classes.
    """

    def __init__(
        self,
        vocab_size: int = 20000,
        embedding_dim: int = 128,
        num_filters: int = 64,
        kernel_size: int = 5,
        pool_size: int = 4,
        hidden_size: int = 128,
        num_classes: int = 2,
    ):
        super().__init__()
        sizes = {
            "vocab_size": vocab_size,
            "embedding_dim": embedding_dim,
            "num_filters": num_filters,
            "kernel_size": kernel_size,
            "pool_size": pool_size,
            "hidden_size": hidden_size,
            "num_classes": num_classes,
        }
        for name, value in sizes.items():
            integer(name, value, low=1)
        if num_classes < 2:
            raise ValueError(f"num_classes must be at least 2, got {num_classes}")
        self.embedding = nn.Embedding(vocab_size, embedding_dim)
        self.conv = nn.Conv1d(embedding_dim, num_filters, kernel_size)
        self.pool = nn.MaxPool1d(pool_size)
        self.lstm = LSTM(num_filters, hidden_size)
        self.fc = nn.Linear(hidden_size, num_classes)

    @property
    def min_length(self) -> int:
        """The shortest input that leaves one step after convolution and pooling."""
        return self.conv.kernel_size[0] + self.pool.kernel_size - 1

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Class logits ``(B, num_classes)`` of word indices ``(B, L)``, front-padded with 0."""
        if not torch.is_tensor(input_ids) or input_ids.is_floating_point():
            raise TypeError(
                "input_ids must be a tensor of word indices (torch.long), got "
                f"{input_ids.dtype if torch.is_tensor(input_ids) else type(input_ids).__name__}"
            )
        if input_ids.dim() != 2 or input_ids.shape[1] < self.min_length:
            raise ValueError(
                f"CNNLSTM: input_ids must have shape (batch, length >= {self.min_length}), "
                f"got {tuple(input_ids.shape)}; reviews are padded or cut to 100 tokens"
            )
        x = self.embedding(input_ids).transpose(1, 2)  # (B, E, L): Conv1d wants channels first
        x = self.pool(torch.relu(self.conv(x))).transpose(1, 2)  # (B, steps, filters)
        _, (h_last, _) = self.lstm(x)
        return self.fc(h_last)


def cnn_lstm_model(
    net: CNNLSTM | int = 20000,
    prior_variance: float = 1 / 40,
    *,
    prior: Prior | None = None,
) -> BayesianNet:
    r"""The Bayesian CNN-LSTM: a Gaussian prior on every weight and a categorical likelihood.

    .. math::

        \theta \sim \mathcal{N}(0, \sigma^2 I), \qquad
        y_i \mid x_i, \theta \sim \mathrm{Categorical}(\mathrm{softmax}(f_\theta(x_i))),

    with :math:`\sigma^2 = 1/40` in the posteriors paper (section 5.1, after Izmailov et
    al., 2021). The returned model takes a batch ``{"input_ids": (B, L), "labels": (B,)}``
    and the training-set size, observes the labels at the site ``"y"`` and returns the
    logits; its latent sites are named by the parameter paths (``"embedding.weight"``,
    ``"lstm.weight_hh"``, ...). Maximum likelihood, the paper's MLE baseline, is
    ``fit_map(model, ..., mle=True)``.

    **References**

    [1] S. Duffield et al. Scalable Bayesian learning with posteriors. 2024, section 5.1.
    [2] P. Izmailov, S. Vikram, M. D. Hoffman, A. G. Wilson. What are Bayesian neural
    network posteriors really like? ICML 2021.

    Example::

        model = cnn_lstm_model(CNNLSTM(vocab_size=20000))
        kernel = SGHMC(model, step_size=1e-3, temperature=0.1)
        MCMC(kernel, num_samples=50, warmup_steps=1000).run(train_loader, 25000)

    :param net: a :class:`CNNLSTM` (its current weights start the chains), or the
        vocabulary size of a new one.
    :param float prior_variance: the variance :math:`\sigma^2` of the IID normal prior.
    :param prior: any prior of :mod:`pyro_bdl.priors` instead of the IID normal.
    :return: the Pyro model, a :class:`~pyro_bdl.models.BayesianNet` (``.net`` is the
        lifted CNN-LSTM).
    """
    if not isinstance(net, nn.Module):
        net = CNNLSTM(vocab_size=integer("net", net, low=1))
    prior_variance = real("prior_variance", prior_variance, positive=True)
    if prior is None:
        prior = IIDNormal(scale=prior_variance**0.5)
    elif prior_variance != 1 / 40:
        raise ValueError(
            f"cnn_lstm_model: pass prior_variance (got {prior_variance}) or prior, not both"
        )
    return BayesianNet(lift(net, prior=prior), Classification())
