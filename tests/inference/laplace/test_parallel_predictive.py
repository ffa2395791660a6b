"""``Predictive(model, guide=LaplaceGuide, parallel=True)`` (issue 10, item 9).

Before the fix the lifted network received the batch of draws as weights and failed in
``F.linear`` ("t() expects a tensor with <= 2 dimensions"), and the guide would have
given every element of Pyro's vectorising plate the same draw.
"""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import Predictive

import pyro_bdl as bdl
from pyro_bdl.data import TensorLoader
from pyro_bdl.inference import LaplaceGuide


def _fitted(helpers, curvature="kron"):
    net = bdl.lift(helpers.mlp(), prior=bdl.priors.IIDNormal(0.5))
    x, y = helpers.classification_data()
    guide = LaplaceGuide(helpers.classifier(net), curvature=curvature)
    loader = TensorLoader((x, y), batch_size=20)
    guide.fit(loader, len(x), map=False, mode_tolerance=None, progress=False)
    return guide, net, x


@pytest.mark.parametrize("curvature", ["diag_ggn", "kron", "full"])
def test_parallel_draws_follow_the_laplace_posterior(helpers, curvature):
    guide, net, x = _fitted(helpers, curvature)
    num_samples = 4000
    pyro.set_rng_seed(0)
    predictive = Predictive(
        guide.model, guide=guide, num_samples=num_samples, parallel=True, return_sites=["2.bias"]
    )
    draws = predictive((x[:5], None), len(x))["2.bias"].reshape(num_samples, -1)
    loc, variance = guide.median()["2.bias"], guide.variance()["2.bias"]
    # Mean and variance of independent draws within 5 Monte Carlo standard errors.
    assert torch.all((draws.mean(0) - loc).abs() <= 5 * (variance / num_samples).sqrt())
    assert torch.all((draws.var(0) - variance).abs() <= 5 * variance * (2 / num_samples) ** 0.5)


def test_parallel_predictive_equals_the_network_at_each_draw(helpers):
    guide, net, x = _fitted(helpers)
    pyro.set_rng_seed(0)
    parallel = Predictive(
        guide.model, guide=guide, num_samples=6, parallel=True, return_sites=["_RETURN", "y"]
    )
    sites = ["0.weight", "0.bias", "2.weight", "2.bias"]
    samples = Predictive(guide.model, guide=guide, num_samples=6, return_sites=sites)(
        (x[:5], None), len(x)
    )
    conditioned = Predictive(
        guide.model, posterior_samples=samples, parallel=True, return_sites=["_RETURN", "y"]
    )((x[:5], None), len(x))
    for i in range(6):
        with net.fixed(
            {site: samples[site][i].reshape(net.parameter(site).shape) for site in sites}
        ):
            assert torch.allclose(conditioned["_RETURN"][i], net.module(x[:5]), atol=1e-12)
    out = parallel((x[:5], None), len(x))
    assert out["_RETURN"].shape == (6, 5, 3) and out["y"].shape == (6, 5)
    assert not torch.allclose(out["_RETURN"][0], out["_RETURN"][1])


def test_a_plain_pyro_likelihood_works_too(helpers):
    net = bdl.lift(helpers.mlp(), prior=bdl.priors.IIDNormal(0.5))
    x, y = helpers.classification_data()

    def model(x, y=None):
        logits = net(x)
        with pyro.plate("data", x.shape[-2]):
            return pyro.sample("y", dist.Categorical(logits=logits), obs=y)

    guide = pyro.infer.autoguide.AutoNormal(model)
    pyro.infer.SVI(model, guide, pyro.optim.Adam({"lr": 0.01}), pyro.infer.Trace_ELBO()).step(x, y)
    draws = Predictive(model, guide=guide, num_samples=7, parallel=True)(x[:4])
    assert draws["y"].shape == (7, 4)
