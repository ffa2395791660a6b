import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer.autoguide import AutoDelta

import pyro_bdl as bdl
from pyro_bdl.predict import predict_proba


def _classifier():
    torch.manual_seed(0)
    net = bdl.lift(torch.nn.Linear(3, 4).double())

    def model(x, num_data):
        logits = net(x)
        bdl.observe("y", dist.Categorical(logits=logits), None, num_data)
        return logits

    return net, model


def test_one_softmax_per_draw_of_the_samples():
    net, model = _classifier()
    x = torch.randn(5, 3, dtype=torch.float64)
    samples = {
        "weight": torch.randn(2, 4, 3, dtype=torch.float64),
        "bias": torch.randn(2, 4, dtype=torch.float64),
    }
    probs = predict_proba(model, x, 10, samples=samples)
    assert probs.shape == (2, 5, 4)
    for i in range(2):
        expected = torch.softmax(x @ samples["weight"][i].T + samples["bias"][i], -1)
        assert torch.allclose(probs[i], expected)


def test_guide_draws_and_fixed_weights():
    net, model = _classifier()
    x = torch.randn(5, 3, dtype=torch.float64)
    guide = AutoDelta(pyro.poutine.block(model, hide=["y"]))
    probs = predict_proba(model, x, 10, guide=guide, num_samples=3)
    assert probs.shape == (3, 5, 4) and torch.allclose(probs[0], probs[2])
    draw = {
        "weight": torch.zeros(4, 3, dtype=torch.float64),
        "bias": torch.zeros(4, dtype=torch.float64),
    }
    with net.fixed(draw):
        fixed = predict_proba(model, x, 10)
    assert torch.allclose(fixed, torch.full((1, 5, 4), 0.25, dtype=torch.float64))
    with pytest.raises(ValueError, match="num_samples"):
        predict_proba(model, x, 10, guide=guide)


def test_draws_of_another_dtype_or_device_are_moved_to_the_sites():
    net, model = _classifier()
    x = torch.randn(5, 3, dtype=torch.float64)
    samples = {"weight": torch.randn(2, 4, 3), "bias": torch.randn(2, 4)}  # float32
    probs = predict_proba(model, x, 10, samples=samples)
    expected = torch.softmax(x @ samples["weight"][1].double().T + samples["bias"][1].double(), -1)
    assert probs.dtype == torch.float64 and torch.allclose(probs[1], expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cpu_draws_predict_with_a_cuda_model():
    torch.manual_seed(0)
    net = bdl.lift(torch.nn.Linear(3, 4).double().cuda())

    def model(x, num_data):
        logits = net(x.cuda())
        bdl.observe("y", dist.Categorical(logits=logits), None, num_data)
        return logits

    samples = {"weight": torch.randn(2, 4, 3).double(), "bias": torch.randn(2, 4).double()}
    probs = predict_proba(model, torch.randn(5, 3).double(), 10, samples=samples)
    assert probs.is_cuda and probs.shape == (2, 5, 4)
