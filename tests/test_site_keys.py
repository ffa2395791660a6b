"""Every argument keyed by site name refuses a key that names no site.

A misspelt key that were ignored would run without the value the user meant (the chain
from the default start, the Laplace fit at another mode, a weight at the default prior):
each case below names the argument, the unknown key, the closest site and the sites.
"""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import MCMC

import pyro_bdl as bdl
from pyro_bdl.inference import SGHMC, SGLD, Chains, LaplaceGuide
from pyro_bdl.priors import LayerwiseNormal

N = 20


def _data():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(N, 3, generator=generator)
    return x, x @ torch.tensor([1.0, -1.0, 0.5]) + 0.1 * torch.randn(N, generator=generator)


def regression(x, y=None):
    w = pyro.sample("w", dist.Normal(torch.zeros(3), 1.0).to_event(1))
    bdl.observe("y", dist.Normal(x @ w, 0.5), y, N)


def _lifted(prior=None):
    torch.manual_seed(0)
    module = torch.nn.Linear(3, 1)
    net = bdl.lift(module, prior or bdl.priors.IIDNormal(1.0))

    def model(x, y=None):
        bdl.observe("y", dist.Normal(net(x).squeeze(-1), 0.5), y, N)

    return net, model


def _fitted_laplace():
    _, model = _lifted()
    guide = LaplaceGuide(model, curvature="full")
    guide.fit(*_data(), map=False, mode_tolerance=None, progress=False)
    return guide


def _sgld_init_params():
    MCMC(SGLD(regression, step_size=1e-3, init_params={"ww": torch.zeros(3)}), 2).run(*_data())


def _mcmc_initial_params():
    kernel = SGLD(regression, step_size=1e-3)
    MCMC(kernel, 2, initial_params={"ww": torch.zeros(3)}, disable_progbar=True).run(*_data())


def _chains_init_params():
    kernel = SGHMC(regression, step_size=1e-3)
    chains = Chains(kernel, 2, init_params=lambda chain: {"ww": torch.zeros(3)})
    chains.run(*_data())


def _laplace_map():
    _, model = _lifted()
    values = {"weight": torch.zeros(1, 3), "biass": torch.zeros(1)}
    LaplaceGuide(model, curvature="full").fit(*_data(), map=values, progress=False)


def _laplace_prior_precision():
    _fitted_laplace().prior_precision = {"wieght": 2.0}


def _fixed():
    net, _ = _lifted()
    with net.fixed({"weight": torch.zeros(1, 3), "bias": torch.zeros(1), "bais": torch.ones(1)}):
        pass


def _layerwise_prior():
    _lifted(LayerwiseNormal({"weight": 1.0, "bais": 2.0}, default=1.0))


def _as_prior_prefix():
    prior = _fitted_laplace().as_prior(prefix="old.")
    _lifted(prior)


CASES = [
    (_sgld_init_params, "init_params: unknown site 'ww'", "'w' for 'ww'", "sites are ['w']"),
    (_mcmc_initial_params, "initial_params: unknown site 'ww'", "'w' for 'ww'", "['w']"),
    (_chains_init_params, "init_params: unknown site 'ww'", "'w' for 'ww'", "['w']"),
    (_laplace_map, "fit(map=...): unknown site 'biass'", "'bias' for", "['weight', 'bias']"),
    (_laplace_prior_precision, "prior_precision: unknown site 'wieght'", "'weight' for", "bias"),
    (_fixed, "fixed(values): unknown site 'bais'", "'bias' for 'bais'", "['weight', 'bias']"),
    (_layerwise_prior, "LayerwiseNormal(scale): unknown site 'bais'", "'bias' for", "weight"),
    (
        _as_prior_prefix,
        "as_prior(prefix='old.'): unknown sites ['weight', 'bias']",
        "under this prefix are ['old.weight', 'old.bias']",
        "",
    ),
]


@pytest.mark.parametrize(
    "call, argument, hint, sites", CASES, ids=lambda c: getattr(c, "__name__", "")
)
def test_an_unknown_site_key_is_a_named_error(call, argument, hint, sites):
    with pytest.raises(ValueError) as info:
        call()
    message = str(info.value)
    for part in (argument, hint, sites):
        assert part in message, message


def test_fixed_ignores_other_sites_only_when_told():
    net, _ = _lifted()
    draw = {"weight": torch.ones(1, 3), "bias": torch.zeros(1), "other": torch.ones(2)}
    with net.fixed(draw, strict=False):
        assert torch.equal(net.module.weight, torch.ones(1, 3))
