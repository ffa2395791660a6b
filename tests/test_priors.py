import pyro.distributions as dist
import pytest
import torch
from torch.distributions import kl_divergence

import pyro_bdl as bdl
from pyro_bdl.priors import IsotropicNormal, normal_parameters, normal_prior


def _reference(loc, scale, shape):
    loc = torch.tensor(loc, dtype=torch.float64)
    scale = torch.tensor(scale, dtype=torch.float64)
    return dist.Normal(loc, scale).expand(shape).to_event(len(shape))


def test_isotropic_normal_equals_the_expanded_normal():
    weight = torch.randn(5, 3, dtype=torch.float64)
    prior = normal_prior(weight, 0.5, 0.3)
    reference = _reference(0.5, 0.3, (5, 3))
    assert isinstance(prior, IsotropicNormal)
    assert prior.event_shape == (5, 3) and prior.batch_shape == ()
    assert torch.allclose(prior.log_prob(weight), reference.log_prob(weight), rtol=1e-12)
    batch = torch.randn(4, 5, 3, dtype=torch.float64)
    assert torch.allclose(prior.log_prob(batch), reference.log_prob(batch), rtol=1e-12)
    grad = torch.func.grad(prior.log_prob)(weight)
    assert torch.allclose(grad, -(weight - 0.5) / 0.3**2)
    q = dist.Normal(torch.randn(5, 3, dtype=torch.float64), 0.2).to_event(2)
    assert torch.allclose(kl_divergence(q, prior), kl_divergence(q, reference))
    expanded = prior.expand((2,))
    assert expanded.batch_shape == (2,) and expanded.event_shape == (5, 3)


def test_tensor_scales_use_the_generic_normal():
    weight = torch.zeros(2, 2)
    prior = normal_prior(weight, 0.0, torch.tensor([1.0, 2.0]))
    assert not isinstance(prior, IsotropicNormal)
    assert torch.allclose(prior.base_dist.scale, torch.tensor([[1.0, 2.0], [1.0, 2.0]]))


def test_normal_parameters_read_every_independent_normal_and_nothing_else():
    weight = torch.zeros(2, 3)
    isotropic = normal_prior(weight, 0.5, 2.0)
    loc, scale = normal_parameters(isotropic, weight)
    assert torch.equal(loc, torch.full((2, 3), 0.5)) and torch.equal(scale, torch.full((2, 3), 2.0))
    per_column = dist.Normal(torch.tensor([0.0, 1.0, 2.0]), 3.0).expand([2, 3]).to_event(2)
    loc, scale = normal_parameters(per_column, weight)
    assert torch.equal(loc, torch.tensor([[0.0, 1.0, 2.0]] * 2))
    assert torch.equal(scale, torch.full((2, 3), 3.0))
    assert normal_parameters(dist.Laplace(0.0, 1.0).expand([2, 3]).to_event(2), weight) is None


def test_iid_normal_rejects_a_non_positive_scale():
    with pytest.raises(ValueError, match="scale must be a positive finite number"):
        bdl.priors.IIDNormal(0.0)


def test_layerwise_fan_in_prior():
    prior = bdl.priors.LayerwiseNormal.fan_in(gain=2.0, bias_scale=0.3)
    assert prior.scale_of("w", torch.zeros(4, 16)) == pytest.approx(0.5)
    assert prior.scale_of("b", torch.zeros(4)) == pytest.approx(0.3)
    mapping = bdl.priors.LayerwiseNormal({"a": 0.1})
    with pytest.raises(KeyError, match="no scale for 'b'"):
        mapping.scale_of("b", torch.zeros(1))
