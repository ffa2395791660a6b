import pyro
import pyro.distributions as dist
import pytest
import torch

import pyro_bdl as bdl
from pyro_bdl.data import TensorLoader
from pyro_bdl.inference import fit_map

NUM_DATA = 64


def _regression(module=None):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(NUM_DATA, 3, generator=generator, dtype=torch.float64)
    y = x @ torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    y = y + 0.5 * torch.randn(NUM_DATA, generator=generator, dtype=torch.float64)
    module = torch.nn.Linear(3, 1, bias=False).double() if module is None else module
    net = bdl.lift(module, bdl.priors.IIDNormal(0.3))

    def model(batch, num_data):
        xb, yb = batch
        bdl.observe("y", dist.Normal(net(xb).squeeze(-1), 0.5), yb, num_data)

    return x, y, net, model


def _exact(x, y, prior_precision):
    eye = torch.eye(3, dtype=torch.float64)
    return torch.linalg.solve(x.T @ x / 0.25 + prior_precision * eye, x.T @ y / 0.25)


def _heavy_ball(x, prior_precision):
    """Full-batch gradient descent for the regression's quadratic, whose condition number
    is 1.5 (Hessian eigenvalues 210 - 319): at lr 1 / largest and momentum 0.5 every
    direction's error falls by sqrt(0.5) = 0.71 a step (complex heavy-ball roots), so 200
    steps reach round-off (Adam at lr 0.01 took 3,000)."""
    hessian = x.T @ x / 0.25 + prior_precision * torch.eye(3, dtype=torch.float64)
    largest = torch.linalg.eigvalsh(hessian)[-1].item()
    return pyro.optim.SGD({"lr": 1.0 / largest, "momentum": 0.5})


@pytest.mark.parametrize("mle", [False, True])
def test_map_and_mle_reach_the_closed_form_optimum(mle):
    x, y, net, model = _regression()
    prior_precision = 0.0 if mle else 1 / 0.3**2
    exact = _exact(x, y, prior_precision)
    optimizer = _heavy_ball(x, prior_precision)
    fitted = fit_map(
        model, (x, y), NUM_DATA, num_steps=200, mle=mle, progress=False, optimizer=optimizer
    )
    assert torch.allclose(fitted["weight"].reshape(-1), exact, atol=1e-8)
    assert not any(name.startswith("_FitMapDelta") for name in pyro.get_param_store().keys())
    assert not torch.allclose(net.module.weight.reshape(-1), exact, atol=1e-2)  # untouched


class _Outer(torch.nn.Module):
    """A network whose weights are named ``model.*``, as every Hugging Face causal LM's."""

    def __init__(self):
        super().__init__()
        self.model = torch.nn.Linear(3, 1, bias=False).double()

    def forward(self, x):
        return self.model(x)


def test_sites_named_after_the_guides_attributes_are_fitted():
    # Pyro's AutoDelta would set "model.weight" on its own .model (the model it guides),
    # outside its parameters: the weight would stay where it started
    x, y, net, model = _regression(_Outer())
    optimizer = _heavy_ball(x, 1 / 0.3**2)
    fitted = fit_map(model, (x, y), NUM_DATA, num_steps=200, progress=False, optimizer=optimizer)
    assert list(fitted) == ["model.weight"]
    assert torch.allclose(fitted["model.weight"].reshape(-1), _exact(x, y, 1 / 0.3**2), atol=1e-8)


def test_minibatch_fit_lands_near_the_optimum():
    x, y, net, model = _regression()
    loader = TensorLoader((x, y), batch_size=16, shuffle=True)
    pyro.set_rng_seed(0)
    # Adam on minibatches keeps fluctuating around the optimum by about its step size
    # (here decayed from 0.05 to 3e-5 in 750 steps): its iterate freezes within 1e-2 of it.
    optimizer = pyro.optim.ClippedAdam({"lr": 0.05, "lrd": 0.99})
    fitted = fit_map(model, loader, NUM_DATA, num_steps=750, optimizer=optimizer, progress=False)
    assert torch.allclose(fitted["weight"].reshape(-1), _exact(x, y, 1 / 0.3**2), atol=1e-2)


def test_fit_starts_from_the_module_weights():
    x, y, net, model = _regression()
    with torch.no_grad():
        net.module.weight.fill_(4.0)
    fitted = fit_map(model, (x, y), NUM_DATA, num_steps=0, progress=False)
    assert torch.equal(fitted["weight"], torch.full((1, 3), 4.0, dtype=torch.float64))


def test_num_steps_is_checked():
    x, y, net, model = _regression()
    with pytest.raises(ValueError, match="num_steps must be an int >= 0"):
        fit_map(model, (x, y), NUM_DATA, num_steps=-1)
