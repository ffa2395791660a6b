import math

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_bdl.models import CNNLSTM, cnn_lstm_model


def test_parameter_count_of_the_paper():
    # Wenzel et al. (2020) and the posteriors paper: 2,700,098 with 100-token reviews.
    net = CNNLSTM(vocab_size=20000)
    assert sum(p.numel() for p in net.parameters()) == 2_700_098
    logits = net(torch.randint(0, 20000, (2, 100)))
    assert logits.shape == (2, 2)


def test_layers_of_the_keras_model():
    net = CNNLSTM()
    x = torch.randint(0, 20000, (2, 100))
    embedded = net.embedding(x).transpose(1, 2)
    pooled = net.pool(torch.relu(net.conv(embedded)))
    assert pooled.shape == (2, 64, 24)  # 100 -> 96 after the convolution -> 24 after pooling
    assert net.lstm.hidden_size == 128 and net.fc.out_features == 2


def test_per_example_gradients_with_vmap():
    torch.manual_seed(0)
    net = CNNLSTM(vocab_size=50, embedding_dim=8, num_filters=6, hidden_size=5).double()
    params = {name: p.detach() for name, p in net.named_parameters()}
    x = torch.randint(0, 50, (3, 16))
    y = torch.tensor([0, 1, 1])

    def loss(params, x, y):
        logits = torch.func.functional_call(net, params, (x.unsqueeze(0),))
        return torch.nn.functional.cross_entropy(logits, y.unsqueeze(0))

    batched = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, x, y)
    for i in range(len(x)):
        one = torch.func.grad(loss)(params, x[i], y[i])
        for name in params:
            torch.testing.assert_close(batched[name][i], one[name], rtol=0, atol=1e-12)


def test_model_puts_the_prior_on_every_weight():
    torch.manual_seed(0)
    net = CNNLSTM(vocab_size=50, embedding_dim=8, num_filters=6, hidden_size=5).double()
    model = cnn_lstm_model(net)
    batch = {"input_ids": torch.randint(0, 50, (4, 12)), "labels": torch.tensor([0, 1, 1, 0])}
    trace = pyro.poutine.trace(model).get_trace(batch, 100)
    trace.compute_log_prob()
    latent = {
        name: site
        for name, site in trace.nodes.items()
        if site["type"] == "sample" and not site["is_observed"] and name != "y_data"
    }
    assert set(latent) == {name for name, _ in net.named_parameters()}
    for site in latent.values():
        scale = torch.tensor(40**-0.5, dtype=torch.float64)
        expected = dist.Normal(0.0, scale).log_prob(site["value"]).sum()
        torch.testing.assert_close(site["log_prob_sum"], expected)
    observed = trace.nodes["y"]
    assert observed["is_observed"] and observed["scale"] == pytest.approx(100 / 4)
    weights = {name: latent[name]["value"] for name in latent}
    logits = torch.func.functional_call(net, weights, (batch["input_ids"],))
    torch.testing.assert_close(trace.nodes["_RETURN"]["value"], logits)
    log_likelihood = torch.log_softmax(logits, -1)[torch.arange(4), batch["labels"]].sum()
    torch.testing.assert_close(observed["log_prob_sum"], 100 / 4 * log_likelihood)


def test_model_from_a_vocabulary_size_and_prior_variance():
    model = cnn_lstm_model(300, prior_variance=0.5)
    assert model.net.module.embedding.num_embeddings == 300
    prior = model.net.prior_distribution("fc.bias")
    assert prior.base_dist.scale.unique().item() == pytest.approx(math.sqrt(0.5))


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="prior_variance must be a positive finite number"):
        cnn_lstm_model(100, prior_variance=0.0)
    with pytest.raises(ValueError, match="vocab_size must be an int >= 1"):
        CNNLSTM(vocab_size=0)
    with pytest.raises(ValueError, match=r"length >= 8"):
        CNNLSTM(vocab_size=10)(torch.zeros(2, 7, dtype=torch.long))
    with pytest.raises(TypeError, match="dict batch"):
        cnn_lstm_model(100)(torch.zeros(2, 100, dtype=torch.long))
