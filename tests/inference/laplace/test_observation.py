"""The likelihood's curvature columns, checked against autograd on log p(y | f)."""

import pyro
import pyro.distributions as dist
import pytest
import torch

import pyro_bdl as bdl
from pyro_bdl.inference.laplace.observation import Observation


def observed_site(distribution, obs, mask=None):
    """The message of the site bdl.observe makes."""

    def model():
        bdl.observe("y", distribution, obs, num_data=10 * distribution.batch_shape[0], mask=mask)

    trace = pyro.poutine.trace(model).get_trace()
    return trace.nodes["y"]


def likelihoods():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 3, generator=generator)
    bernoulli_logits = torch.randn(4, 2, generator=generator)
    loc = torch.randn(4, generator=generator)
    return [
        ("categorical", lambda f: dist.Categorical(logits=f), logits, torch.tensor([0, 2, 1, 2])),
        (
            "bernoulli",
            lambda f: dist.Bernoulli(logits=f.squeeze(-1)),
            bernoulli_logits.unsqueeze(-1),
            torch.tensor([[0.0, 1.0], [1.0, 1.0], [0.0, 0.0], [1.0, 0.0]]),
        ),
        (
            "normal",
            lambda f: dist.Normal(f.squeeze(-1), 0.7),
            loc.unsqueeze(-1),
            torch.tensor([0.3, -1.0, 2.0, 0.1]),
        ),
    ]


@pytest.mark.parametrize("name, make, natural, obs", likelihoods(), ids=lambda x: x)
def test_ggn_columns_square_to_the_likelihood_hessian(name, make, natural, obs):
    observation = Observation(observed_site(make(natural), obs))
    columns = observation.columns("ggn")
    # The columns of one position are non-zero only there: V V^T per example and position.
    outer = torch.einsum("cb...k,cb...l->b...kl", columns, columns)
    for i in range(natural.shape[0]):

        def negative_log_likelihood(f, i=i):
            return -make(f.unsqueeze(0)).log_prob(obs[i : i + 1]).sum()

        hessian = torch.autograd.functional.hessian(negative_log_likelihood, natural[i])
        if natural.dim() == 3:  # positions: the Hessian is block diagonal over them
            hessian = torch.stack([hessian[p, :, p, :] for p in range(natural.shape[1])])
        assert torch.allclose(outer[i], hessian, atol=1e-12)


@pytest.mark.parametrize("name, make, natural, obs", likelihoods(), ids=lambda x: x)
def test_empirical_fisher_column_is_the_score_and_log_likelihood_is_summed(
    name, make, natural, obs
):
    f = natural.clone().requires_grad_()
    observation = Observation(observed_site(make(f), obs))
    (score,) = torch.autograd.grad(make(f).log_prob(obs).sum(), f)
    assert torch.allclose(observation.columns("ef")[0], score, atol=1e-12)
    assert torch.allclose(observation.log_likelihood(), make(natural).log_prob(obs).sum())
    assert observation.num_examples == 4 and observation.num_data == 40


def test_monte_carlo_fisher_averages_to_the_hessian():
    logits = torch.tensor([[0.2, -1.0, 0.5]])
    observation = Observation(observed_site(dist.Categorical(logits=logits), torch.tensor([1])))
    pyro.set_rng_seed(0)
    columns = observation.columns("mc", num_samples=20000)
    estimate = torch.einsum("cbk,cbl->bkl", columns, columns)[0]
    probs = torch.softmax(logits[0], -1)
    hessian = torch.diag(probs) - torch.outer(probs, probs)
    # Each entry is a mean of 20000 bounded terms (|term| <= 1): standard error < 0.01.
    assert torch.allclose(estimate, hessian, atol=0.03)


def test_masked_positions_add_no_curvature_and_no_likelihood():
    logits = torch.randn(2, 3, 4)
    obs = torch.tensor([[0, 1, 3], [2, 2, 1]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    observation = Observation(observed_site(dist.Categorical(logits=logits), obs, mask))
    for fisher in ("ggn", "ef"):
        columns = observation.columns(fisher)
        assert torch.all(columns[:, ~mask] == 0)
        assert columns[:, mask].abs().sum() > 0
    expected = dist.Categorical(logits=logits).log_prob(obs)[mask].sum()
    assert torch.allclose(observation.log_likelihood(), expected)


def test_unsupported_likelihoods_are_refused_with_the_fix():
    probs = torch.full((3, 2), 0.5)
    with pytest.raises(ValueError, match="Categorical\\(logits=...\\)"):
        Observation(observed_site(dist.Categorical(probs=probs), torch.tensor([0, 1, 1])))
    with pytest.raises(ValueError, match="Poisson likelihood"):
        Observation(observed_site(dist.Poisson(torch.ones(3)), torch.tensor([0.0, 1.0, 2.0])))
    scale = torch.ones(3, requires_grad=True)
    with pytest.raises(ValueError, match="fixed observation noise"):
        Observation(observed_site(dist.Normal(torch.zeros(3), scale), torch.zeros(3)))


def test_exact_ggn_of_a_long_sequence_points_to_the_monte_carlo_fisher():
    logits = torch.randn(2, 600, 3)
    observation = Observation(
        observed_site(dist.Categorical(logits=logits), torch.zeros(2, 600, dtype=torch.long))
    )
    with pytest.raises(ValueError, match="fisher='mc'"):
        observation.columns("ggn")
    assert observation.columns("mc", num_samples=2).shape == (2, 2, 600, 3)
