"""A warm-up that diverges is set back to its last sane state with half the step size
and goes on; divergences that keep coming stop it, naming the step size; after warm-up a
divergence stops the chain even while its values are finite."""

import math
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import MCMC

from pyro_bdl.inference import SGHMC, DivergenceError
from pyro_bdl.inference.sgmcmc.recovery import MAX_RECOVERIES, Sentinel


def _stiff_gaussian(stiffness):
    """A 2-d Gaussian whose precision has eigenvalues 1 and ``stiffness`` along the
    diagonals (a unit mass, as ``adapt_mass_matrix=False`` keeps, cannot whiten it)."""
    rotation = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64) / math.sqrt(2)
    precision = rotation @ torch.diag(torch.tensor([1.0, stiffness]).double()) @ rotation.T
    covariance = torch.linalg.inv(precision)

    def model():
        pyro.sample("z", dist.MultivariateNormal(torch.zeros(2, dtype=torch.float64), covariance))

    return model, covariance


def _run(kernel, warmup_steps=500, num_samples=3000):
    pyro.set_rng_seed(0)
    mcmc = MCMC(kernel, num_samples=num_samples, warmup_steps=warmup_steps, disable_progbar=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # it samples its "prior"
        mcmc.run()
    return mcmc.get_samples()["z"]


def test_a_warmup_that_diverges_recovers_and_its_draws_match_the_posterior():
    # a start step 10 times the stiffest direction's stability limit (SGHMC's step *
    # sqrt(stiffness) < 2, with the unit mass adapt_mass_matrix=False keeps)
    model, covariance = _stiff_gaussian(400.0)
    kernel = SGHMC(model, step_size=0.5, num_data=1, adapt_mass_matrix=False)
    draws = _run(kernel)
    # (without recovery the chain blows up at once and keeps draws up to 1e16, unreported)
    assert draws.abs().max() < 10
    assert 1 <= len(kernel.recoveries) <= MAX_RECOVERIES
    assert all(step < 500 for step in kernel.recoveries)
    # 3,000 draws: a few hundred effective ones along the soft direction (variance 1), so
    # 25 % on its variance and 0.25 sd on the means
    assert torch.allclose(draws.mean(0), torch.zeros(2, dtype=torch.float64), atol=0.25)
    soft = torch.tensor([1.0, 1.0], dtype=torch.float64) / math.sqrt(2)
    assert float((draws @ soft).var()) == pytest.approx(1.0, rel=0.25)
    # along the stiff direction (variance 1 / 400) the adapted step's own excess: 1.6
    # times the variance from a sane start (step_size=0.02, no recovery), 1.8 here
    stiff = torch.tensor([1.0, -1.0], dtype=torch.float64) / math.sqrt(2)
    assert 1.0 < float((draws @ stiff).var()) * 400 < 2.2


def test_divergences_that_keep_coming_stop_warmup_naming_the_step_size():
    # 1,000 times the stability limit: four halvings leave it 60 times too large
    model, _ = _stiff_gaussian(1e6)
    kernel = SGHMC(model, step_size=1.0, num_data=1, adapt_mass_matrix=False)
    with pytest.raises(DivergenceError) as error:
        _run(kernel, num_samples=10)
    assert len(kernel.recoveries) == MAX_RECOVERIES
    assert error.value.step < 500
    message = str(error.value)
    assert "warm-up diverged at steps" in message
    # below 1 / 32 of the one given: five halvings, and the adaptation shrank it too
    advised = float(message.split("pass step_size=")[1].split(" or smaller")[0])
    assert advised < 1 / 32


def test_a_divergence_after_warmup_stops_the_chain_before_its_values_overflow():
    # Forty draws in a stable chain, then a schedule makes the step 15 times its limit:
    # the chain grows a hundredfold a step. Left alone it overflows 50 steps later, having
    # kept 50 draws of up to 1e150; it stops within two draws instead.
    model, _ = _stiff_gaussian(400.0)
    kernel = SGHMC(
        model,
        step_size=0.05,
        num_data=1,
        adapt_step_size=False,
        adapt_mass_matrix=False,
        schedule=lambda step: 1.0 if step < 40 else 30.0,
    )
    with pytest.raises(DivergenceError) as error:
        _run(kernel, warmup_steps=0, num_samples=100)
    assert 40 < error.value.step < 60
    assert "the excess of the kinetic temperature read" in str(error.value)
    assert "try a smaller step_size" in str(error.value)
    kept = error.value.draws["z"]
    assert len(kept) >= 40
    assert kept[:40].abs().max() < 1


def test_a_noisy_statistic_is_no_divergence():
    # Chi-square readings of one degree of freedom (the noisiest statistic, one
    # parameter) with a potential that wanders: thousands of reads, no divergence.
    generator = torch.Generator().manual_seed(0)
    sentinel = Sentinel(target=0.1)
    chi2 = torch.randn(20_000, generator=generator, dtype=torch.float64).square()
    walk = torch.randn(20_000, generator=generator, dtype=torch.float64).cumsum(0)
    assert not any(sentinel.diverged(float(c) - 1, float(u) + c) for c, u in zip(chi2, walk))


def test_a_divergence_is_found_within_two_reads_of_its_jump():
    sentinel = Sentinel(target=0.1)
    generator = torch.Generator().manual_seed(0)
    for value in torch.randn(30, generator=generator, dtype=torch.float64):
        assert not sentinel.diverged(0.1 + 0.01 * float(value), 100.0 + float(value))
    assert not sentinel.diverged(66.0, 1e5)
    assert sentinel.diverged(995.0, 1e7)
