import pyro
import pyro.distributions as dist
import pytest
import torch

import pyro_bdl as bdl
from pyro_bdl.inference.log_joint import LogJoint, observed_num_data


def _model():
    torch.manual_seed(0)
    net = bdl.lift(torch.nn.Linear(3, 2).double(), bdl.priors.IIDNormal(0.7, loc=0.2))

    def model(x, y):
        with pyro.poutine.scale(scale=0.5):
            extra = pyro.sample("extra", dist.Normal(0.0, 2.0).expand([2]).to_event(1))
        logits = net(x) + extra
        bdl.observe("y", dist.Categorical(logits=logits), y, num_data=10)

    return net, model


def test_log_joint_equals_the_trace_log_density():
    net, model = _model()
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.tensor([0, 1, 1, 0])
    values = {
        "weight": torch.randn(2, 3, dtype=torch.float64),
        "bias": torch.randn(2, dtype=torch.float64),
        "extra": torch.randn(2, dtype=torch.float64),
    }
    trace = pyro.poutine.trace(pyro.poutine.condition(model, data=values)).get_trace(x, y)
    with LogJoint(values) as log_joint:
        model(x, y)
    assert torch.allclose(log_joint.value, trace.log_prob_sum())
    # likelihood_only: the observed sites alone, still scaled by N / B = 10 / 4.
    with LogJoint(values, likelihood_only=True) as likelihood:
        model(x, y)
    trace.compute_log_prob()
    assert torch.allclose(likelihood.value, trace.nodes["y"]["log_prob_sum"])
    assert torch.allclose(likelihood.value, trace.nodes["y"]["fn"].log_prob(y).sum() * 10 / 4)


def test_analytic_prior_scores_equal_autograd():
    net, model = _model()
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.tensor([0, 1, 1, 0])
    values = {
        "weight": torch.randn(2, 3, dtype=torch.float64, requires_grad=True),
        "bias": torch.randn(2, dtype=torch.float64, requires_grad=True),
        "extra": torch.randn(2, dtype=torch.float64, requires_grad=True),
    }
    with LogJoint(values) as reference:
        model(x, y)
    expected = torch.autograd.grad(reference.value, list(values.values()))
    with LogJoint(values, analytic_priors=True) as fast:
        model(x, y)
    assert set(fast.prior_scores) == {"weight", "bias"}  # "extra" is a plain Normal
    assert torch.allclose(fast.value, reference.value)
    grads = dict(zip(values, torch.autograd.grad(fast.value, list(values.values()))))
    fast.add_prior_scores(grads)
    for name, g in zip(values, expected):
        assert torch.allclose(grads[name], g), name


def test_a_latent_site_missing_from_values_is_an_error():
    net, model = _model()
    with pytest.raises(KeyError, match="latent site 'extra'"):
        with LogJoint({"weight": torch.zeros(2, 3), "bias": torch.zeros(2)}):
            model(torch.zeros(1, 3, dtype=torch.float64), torch.tensor([0]))


def _trace(model, *args):
    return pyro.poutine.trace(model).get_trace(*args)


def test_observed_num_data_reads_the_scale_of_bdl_observe_and_of_subsampled_plates():
    x = torch.randn(4)

    def observed(batch, num_data):
        bdl.observe("y", dist.Normal(torch.zeros(4), 1.0), batch, num_data)

    def plated(batch, num_data):
        with pyro.plate("data", num_data, subsample=torch.arange(4)):
            pyro.sample("y", dist.Normal(0.0, 1.0), obs=batch)

    for model in (observed, plated):
        assert observed_num_data(_trace(model, x, 100)) == 100
        assert observed_num_data(_trace(model, x, 100), 100) == 100
        with pytest.raises(ValueError, match="num_data=50, but the observed site 'y' is scaled"):
            observed_num_data(_trace(model, x, 100), 50)


def test_an_observed_site_without_a_num_data_scale_is_refused():
    # Issue 10, item 11: the model subsamples with its own plate of the batch's size, so
    # a minibatch of 4 would count as the whole data set of 100.
    def model(batch):
        with pyro.plate("data", len(batch)):
            pyro.sample("y", dist.Normal(0.0, 1.0), obs=batch)

    trace = _trace(model, torch.randn(4))
    with pytest.raises(ValueError, match=r"observed site 'y' has a batch of 4 examples and no"):
        observed_num_data(trace, 100)
    assert observed_num_data(trace, 4) == 4  # the batch is the whole data set
    assert observed_num_data(trace) == 4
    assert observed_num_data(trace, full_batch=False) is None

    def without_num_data(batch):
        bdl.observe("y", dist.Normal(torch.zeros(len(batch)), 1.0), batch)

    with pytest.raises(ValueError, match="has a batch of 4 examples and no num_data scale"):
        observed_num_data(_trace(without_num_data, torch.randn(4)), 100)

    def one_global_observation(batch):
        pyro.sample("constraint", dist.Normal(0.0, 1.0), obs=torch.tensor(0.0))
        bdl.observe("y", dist.Normal(torch.zeros(len(batch)), 1.0), batch, 100)

    assert observed_num_data(_trace(one_global_observation, torch.randn(4))) == 100
