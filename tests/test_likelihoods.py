import pyro
import pyro.distributions as dist
import pytest
import torch

import pyro_bdl as bdl


def _log_likelihood(model, *args):
    trace = pyro.poutine.trace(model).get_trace(*args)
    trace.compute_log_prob()
    return trace.nodes["y"]["log_prob_sum"]


def test_minibatch_log_likelihood_is_scaled_by_n_over_b():
    y = torch.tensor([0.1, -0.3, 0.7, 1.2])

    def model(obs, num_data):
        bdl.observe("y", dist.Normal(torch.zeros(len(obs)), 1.0), obs, num_data)

    full = dist.Normal(0.0, 1.0).log_prob(y[:2]).sum()
    assert torch.allclose(_log_likelihood(model, y[:2], 10), full * 5)
    assert torch.allclose(_log_likelihood(model, y[:2], 2), full)


def test_minibatch_estimate_is_unbiased_over_a_partition():
    y = torch.randn(12, dtype=torch.float64)

    def model(obs, num_data):
        bdl.observe("y", dist.Normal(torch.zeros_like(obs), 2.0), obs, num_data)

    full = dist.Normal(0.0, 2.0).log_prob(y).sum()
    estimates = [_log_likelihood(model, y[i : i + 3], 12) for i in range(0, 12, 3)]
    assert torch.allclose(torch.stack(estimates).mean(), full)


def test_extra_batch_dims_are_summed_within_an_example_and_masked():
    logits = torch.randn(2, 3, 5)
    tokens = torch.randint(0, 5, (2, 3))
    mask = torch.tensor([[True, True, False], [True, False, False]])

    def model():
        bdl.observe("y", dist.Categorical(logits=logits), tokens, num_data=4, mask=mask)

    per_token = dist.Categorical(logits=logits).log_prob(tokens)
    expected = (per_token * mask).sum() * 2
    assert torch.allclose(_log_likelihood(model), expected)


def test_obs_none_samples_a_batch():
    value = bdl.observe("y", dist.Categorical(logits=torch.zeros(6, 3)), None, num_data=60)
    assert value.shape == (6,)


def test_shape_errors_name_the_argument():
    with pytest.raises(ValueError, match="obs has shape"):
        bdl.observe("y", dist.Normal(torch.zeros(3), 1.0), torch.zeros(4), 10)
    with pytest.raises(ValueError, match="num_data must be"):
        bdl.observe("y", dist.Normal(torch.zeros(3), 1.0), torch.zeros(3), 2)
    with pytest.raises(ValueError, match="mask has shape"):
        bdl.observe(
            "y",
            dist.Normal(torch.zeros(3), 1.0),
            torch.zeros(3),
            3,
            mask=torch.ones(2, dtype=torch.bool),
        )
    with pytest.raises(ValueError, match="no batch dimension"):
        bdl.observe("y", dist.Normal(0.0, 1.0), torch.tensor(0.0), 3)
