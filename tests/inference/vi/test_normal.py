"""VariationalNormal: its closed-form (tempered) KL, tempered log density and STL gradient."""

import pyro.distributions as dist
import pytest
import torch
from torch.distributions import kl_divergence

from pyro_bdl.inference import VariationalNormal


def _normal(loc, scale):
    return torch.distributions.Normal(torch.tensor(loc, dtype=torch.float64), scale)


def _params(seed=0, shape=(4, 3)):
    generator = torch.Generator().manual_seed(seed)
    loc = torch.randn(shape, generator=generator, dtype=torch.float64)
    scale = torch.rand(shape, generator=generator, dtype=torch.float64) + 0.1
    return loc, scale


def test_kl_equals_torch_kl_of_the_same_gaussians():
    loc, scale = _params()
    prior = dist.Normal(torch.tensor(0.3, dtype=torch.float64), 0.7).expand(loc.shape)
    ours = kl_divergence(VariationalNormal(loc, scale), prior)
    expected = kl_divergence(torch.distributions.Normal(loc, scale), _normal(0.3, 0.7))
    torch.testing.assert_close(ours, expected, rtol=1e-12, atol=1e-12)


def test_kl_dispatches_through_independent_as_in_trace_mean_field_elbo():
    loc, scale = _params()
    q = VariationalNormal(loc, scale).to_event(2)
    p = dist.Normal(torch.zeros((), dtype=torch.float64), 1.0).expand(loc.shape).to_event(2)
    expected = kl_divergence(torch.distributions.Normal(loc, scale), _normal(0.0, 1.0))
    torch.testing.assert_close(kl_divergence(q, p), expected.sum(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("temperature", [0.0, 0.3, 1.0, 2.5])
def test_tempered_kl_is_cross_entropy_minus_t_entropy(temperature):
    loc, scale = _params()
    q, prior = torch.distributions.Normal(loc, scale), _normal(0.2, 0.5)
    cross_entropy = kl_divergence(q, prior) + q.entropy()
    expected = cross_entropy - temperature * q.entropy()
    ours = kl_divergence(VariationalNormal(loc, scale, temperature), prior)
    torch.testing.assert_close(ours, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("temperature", [0.3, 2.5])
def test_tempered_kl_is_t_times_kl_to_the_tempered_prior_up_to_a_constant(temperature):
    # Posteriors paper, section 4: E_q[-log p] - T H(q) = T KL(q || p^(1/T)) + c, and for a
    # Normal prior p^(1/T) is the Normal with variance T sigma_p^2. c must not depend on q.
    tempered_prior = _normal(0.2, 0.5 * temperature**0.5)
    constants = []
    for seed in range(3):
        loc, scale = _params(seed)
        ours = kl_divergence(VariationalNormal(loc, scale, temperature), _normal(0.2, 0.5))
        tempered = temperature * kl_divergence(
            torch.distributions.Normal(loc, scale), tempered_prior
        )
        constants.append(ours - tempered)
    for constant in constants:
        torch.testing.assert_close(constant, torch.full_like(constant, constants[0][0, 0].item()))


def test_log_prob_is_temperature_times_the_normal_log_density():
    loc, scale = _params()
    x = torch.randn(loc.shape, dtype=torch.float64)
    expected = torch.distributions.Normal(loc, scale).log_prob(x)
    torch.testing.assert_close(VariationalNormal(loc, scale, 0.4).log_prob(x), 0.4 * expected)
    torch.testing.assert_close(VariationalNormal(loc, scale).log_prob(x), expected)


def test_stick_the_landing_log_density_has_no_direct_parameter_gradient():
    # d/dloc log q(loc + scale * eps; loc, scale) is exactly 0 (the two paths cancel);
    # sticking the landing keeps only the path through the draw: -(x - loc) / scale^2.
    loc, scale = _params()
    for stl, expected in [(False, torch.zeros_like(loc)), (True, None)]:
        loc_ = loc.clone().requires_grad_()
        q = VariationalNormal(loc_, scale, stick_the_landing=stl)
        x = q.rsample()
        (grad,) = torch.autograd.grad(q.log_prob(x).sum(), loc_)
        if expected is None:
            expected = -(x - loc).detach() / scale**2
        torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-10)


def test_expand_keeps_temperature_and_stick_the_landing():
    loc, scale = _params(shape=(3,))
    q = VariationalNormal(loc, scale, 0.5, stick_the_landing=True).expand((2, 3))
    assert isinstance(q, VariationalNormal)
    assert q.batch_shape == (2, 3) and q.temperature == 0.5 and q.stick_the_landing


@pytest.mark.parametrize(
    "temperature, error",
    [(-1.0, ValueError), (float("nan"), ValueError), ("1", TypeError), (True, TypeError)],
)
def test_bad_temperature_is_an_error_naming_the_argument(temperature, error):
    with pytest.raises(error, match="temperature"):
        VariationalNormal(torch.zeros(()), torch.ones(()), temperature)
