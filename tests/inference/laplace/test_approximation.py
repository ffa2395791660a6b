"""The Laplace fit as a value: fit makes one LaplaceFit, tuning makes new ones, none changes.

A classifier (a lifted 5-8-3 MLP, K-FAC) on 60 examples, float64; the comparisons are
exact, since the same fit is read through two routes.
"""

import dataclasses

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import pyro_bdl as bdl
from pyro_bdl.inference import LaplaceFit, LaplaceGuide
from pyro_bdl.inference.laplace import tuning
from pyro_bdl.inference.laplace.predictive import glm_predictive


@pytest.fixture
def fitted(helpers):
    x, y = helpers.classification_data()
    net = bdl.lift(helpers.mlp(bias=False), prior=bdl.priors.IIDNormal(1.0))
    guide = LaplaceGuide(helpers.classifier(net), curvature="kron")
    guide.fit(DataLoader(TensorDataset(x, y), batch_size=20), 60, map=False, progress=False)
    return guide, x


def _copy(fit: LaplaceFit) -> dict:
    return {name: value.clone() for name, value in fit.prior_precision.items()}


def test_tuning_replaces_the_fit_and_leaves_the_old_one_as_it_was(fitted):
    guide, _ = fitted
    before = guide.laplace_fit
    delta = _copy(before)
    guide.optimize_prior_precision(num_steps=200)
    after = guide.laplace_fit
    assert after is not before and after.loc is before.loc and after.blocks is before.blocks
    for name, value in delta.items():  # the old value is unchanged, the new one moved
        assert torch.equal(before.prior_precision[name], value)
        assert not torch.equal(after.prior_precision[name], value)
    # the tuning is a function of the fit: the same call on the old fit gives the new one
    again = tuning.optimize_prior_precision(
        before, "marglik", (), {}, structure="layer", num_steps=200, lr=0.1, grid=None,
        link="probit", num_samples=100, progress=False,
    )  # fmt: skip
    for name, value in after.prior_precision.items():
        assert torch.equal(again.prior_precision[name], value)
    with pytest.raises(dataclasses.FrozenInstanceError):
        after.link = "probit"


def test_the_predictive_of_an_old_fit_is_the_guides_at_its_prior_precision(fitted):
    guide, x = fitted
    before = guide.laplace_fit
    guide.prior_precision = 0.25
    assert guide.laplace_fit.prior_precision != before.prior_precision
    batch = ((x[:7], None), 60)
    old = glm_predictive(
        before, batch, {}, link="probit", num_samples=1, return_samples=False,
        generator=None, prior_precision=None, progress=False,
    )  # fmt: skip
    at_old = guide.predictive(*batch, link="probit", prior_precision=_copy(before))
    torch.testing.assert_close(old, at_old, rtol=0, atol=0)
    # and the evidence of the old fit is the guide's at that prior precision
    torch.testing.assert_close(
        tuning.evidence(before), guide.log_marginal_likelihood(_copy(before)), rtol=0, atol=0
    )


def test_the_link_and_prior_precision_belong_to_the_fit(fitted, helpers):
    guide, *_ = fitted
    guide.link = "bridge"
    assert guide.laplace_fit.link == "bridge"
    with pytest.raises(ValueError, match="link"):
        guide.link = "softmax"
    unfitted = LaplaceGuide(helpers.classifier(helpers.mlp()))
    assert unfitted.link == "mc" and unfitted.exact_hessian_reason is None
    for read in (lambda: unfitted.laplace_fit, lambda: unfitted.prior_precision):
        with pytest.raises(RuntimeError, match="fit"):
            read()
    with pytest.raises(RuntimeError, match="fit"):
        unfitted.link = "probit"


def test_a_new_temperature_tempers_the_fitted_posterior(fitted):
    # the cold-posterior experiment fits once and reads the posterior at several T
    guide, _ = fitted
    before = guide.laplace_fit
    variance = guide.variance()
    guide.temperature = 0.25
    assert guide.laplace_fit.temperature == 0.25 and before.temperature == 1.0
    for name, value in guide.variance().items():
        torch.testing.assert_close(value, 0.25 * variance[name], rtol=1e-15, atol=0)
    with pytest.raises(ValueError, match="temperature"):
        guide.temperature = 0.0
