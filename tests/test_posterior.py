"""Every method's result answers the Posterior interface, and save, load, to_arviz and
predict_proba take each through it.

One tiny problem for all (48 examples, 5 features, 3 classes, float64): a lifted MLP for the
guides and chains, a peft LoRA on a linear layer for the BLoB guide and the baselines. Each
method is fitted for a few steps only: the test is of the interface, not of the fit. What
must hold for every method:

* the result is a ``Posterior`` (``as_posterior`` wraps a run);
* ``bdl.save`` then ``bdl.load`` in the same process gives a posterior whose predictions at
  a fixed seed are the original's (deterministic methods: equal; sampled ones: the same
  draws from the same seed, so equal too), to 1e-10 in float64;
* ``bdl.to_arviz`` of the loaded posterior has a ``posterior`` group whose sites and shapes
  are those of its draws;
* ``bdl.predict_proba`` returns ``(S, B, C)`` probabilities summing to one.
"""

import warnings

import pyro
import pytest
import torch
from persistence_cases import TinyNet, TwoHeads, batches, data
from pyro.infer import MCMC, SVI, TraceMeanField_ELBO

import pyro_bdl as bdl
from pyro_bdl.demo import classifier
from pyro_bdl.inference import (
    SGHMC,
    BLoBGuide,
    Chains,
    IVONGuide,
    LaplaceGuide,
    MeanFieldGuide,
    baselines,
)
from pyro_bdl.posterior import DrawsPosterior, Posterior, as_posterior

NUM_DATA = 48


def _mlp():
    torch.manual_seed(0)
    return classifier(bdl.lift(TwoHeads().double(), bdl.priors.IIDNormal(1.0)))


def _lora(dropout: float = 0.0):
    """peft LoRA (rank 2) on TinyNet: A random, B a point weight; the model carries ``net``."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    config = LoraConfig(r=2, lora_alpha=4, target_modules=["proj"], lora_dropout=dropout)
    net = bdl.lift(get_peft_model(TinyNet(), config).double(), bdl.priors.IIDNormal(0.5),
                   "lora_A", "lora_B")  # fmt: skip
    model = classifier(net)
    model.net = net
    return model


def _svi(guide, model, steps: int = 5):
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.05}), TraceMeanField_ELBO())
    stream = batches()
    for _ in range(steps):
        svi.step(*next(stream))
    return guide


def _laplace(model):
    x, y = data()
    guide = LaplaceGuide(model, "kron")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # the curvature at the initial values, the select link step skipped: an interface test
        guide.fit((x, y), NUM_DATA, map=False, progress=False)
    return guide


def _chains(model, num_chains: int):
    x, y = data()
    kernel = SGHMC(model, step_size=1e-3)
    if num_chains == 1:
        run = MCMC(kernel, num_samples=4, warmup_steps=2, disable_progbar=True)
    else:
        run = Chains(kernel, 4, 2, num_chains=num_chains, seed=0, disable_progbar=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # four draws are far from converged, on purpose
        run.run((x, y), NUM_DATA)
    return run


def _baseline(method: str, **options):
    def fit(model):
        x, y = data()
        loader = torch.utils.data.DataLoader(list(zip(x, y)), batch_size=16)
        run = getattr(baselines, method)
        return run(model, loader, NUM_DATA, num_steps=3, progress=False, **options)

    return fit


# name -> (the model's builder, the fit, predict_proba's num_samples)
METHODS = {
    "laplace": (_mlp, _laplace, 5),
    "mean_field": (_mlp, lambda m: _svi(MeanFieldGuide(m), m), 3),
    "ivon": (_mlp, lambda m: _svi(IVONGuide(m), m), 3),
    "blob": (_lora, lambda m: _svi(BLoBGuide(m, m.net), m), 3),
    "mcmc": (_mlp, lambda m: _chains(m, 1), None),
    "chains": (_mlp, lambda m: _chains(m, 2), None),
    "map": (_lora, _baseline("map_estimate"), None),
    "mc_dropout": (lambda: _lora(0.1), _baseline("mc_dropout", num_samples=3), None),
    "deep_ensemble": (_lora, _baseline("deep_ensemble", num_members=2), None),
    "bbb": (_lora, _baseline("bbb", num_samples=3), 3),
}


def _probs(posterior, num_samples):
    x, _ = data()
    pyro.set_rng_seed(3)
    generator = {"generator": torch.Generator().manual_seed(3)}
    extra = generator if isinstance(posterior, LaplaceGuide) else {}
    return bdl.predict_proba(posterior, (x, None), NUM_DATA, num_samples=num_samples, **extra)


@pytest.mark.parametrize("name", list(METHODS))
def test_every_method_goes_through_save_load_to_arviz_and_predict_proba(name, tmp_path):
    build, fit, num_samples = METHODS[name]
    pyro.clear_param_store()
    model = build()
    result = fit(model)
    posterior = as_posterior(result)
    assert isinstance(posterior, Posterior)
    before = _probs(posterior, num_samples)

    bdl.save(result, tmp_path / name)
    loaded = as_posterior(bdl.load(tmp_path / name, model))
    after = _probs(loaded, num_samples)

    x, _ = data()
    assert before.shape[1:] == (len(x), 3) and before.dtype == torch.float64
    torch.testing.assert_close(before.sum(-1), torch.ones(before.shape[:2], dtype=torch.float64))
    torch.testing.assert_close(after, before, rtol=1e-10, atol=1e-10)

    draws = loaded.draws(num_samples or 2, (x, None), NUM_DATA, seed=0)
    tree = bdl.to_arviz(loaded, num_samples=num_samples or 2, model_args=((x, None), NUM_DATA))
    assert set(tree["posterior"].data_vars) == set(draws.samples)
    for site, value in draws.samples.items():
        assert tree["posterior"][site].shape == tuple(value.shape)
    assert tree.attrs["method"] == draws.attrs["method"]


def test_a_run_is_read_through_pyros_public_interface_only():
    """A stand-in for MCMC with only get_samples, diagnostics and the run's settings."""
    draws = {"w": torch.arange(12.0, dtype=torch.float64).reshape(2, 3, 2)}

    class Run:
        kernel = type("Kernel", (), {"model": None})()
        num_chains, num_samples, warmup_steps = 2, 3, 1

        def get_samples(self, group_by_chain=False):
            return draws

        def diagnostics(self):
            return {"sample_stats": {f"chain {c}": {"lp": [0.0, 1.0, 2.0]} for c in range(2)}}

    posterior = as_posterior(Run())
    assert isinstance(posterior, DrawsPosterior)
    drawn = posterior.draws()
    torch.testing.assert_close(drawn.samples["w"], draws["w"])
    assert drawn.sample_stats["lp"].shape == (2, 3)
    assert drawn.attrs["method"] == "Kernel" and drawn.attrs["warmup_steps"] == 1
    # four evenly spaced of the six draws, the chains one after the other
    torch.testing.assert_close(
        posterior.sample(4)["w"][:, 0], torch.tensor([0.0, 4, 6, 10]).double()
    )


def test_anything_else_is_refused_naming_the_argument():
    with pytest.raises(TypeError, match="predict_proba: source must be a method's result"):
        bdl.predict_proba(lambda x: x, torch.zeros(2))
    with pytest.raises(ValueError, match="has no draws yet"):
        as_posterior(MCMC(SGHMC(_mlp(), step_size=1e-3), num_samples=2))


def test_a_run_too_short_for_pyros_diagnostics_keeps_its_draws_and_says_so():
    """Pyro's MCMC.diagnostics() takes split R-hat, which needs 4 draws per chain."""
    pyro.clear_param_store()
    model = _mlp()
    x, y = data()
    mcmc = MCMC(SGHMC(model, step_size=1e-3), num_samples=2, warmup_steps=1, disable_progbar=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mcmc.run((x, y), NUM_DATA)
    with pytest.warns(UserWarning, match="sample statistics .* are left out"):
        drawn = as_posterior(mcmc).draws()
    assert drawn.sample_stats == {} and drawn.num_draws == 2
