import arviz_stats
import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
import xarray as xr
from pyro.infer import MCMC, SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal

import pyro_bdl as bdl
from pyro_bdl.data import TensorLoader
from pyro_bdl.inference import SGLD, Chains

NUM_DATA = 30


def _problem():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(NUM_DATA, 4, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 3, (NUM_DATA,), generator=generator)
    torch.manual_seed(0)
    net = bdl.lift(torch.nn.Linear(4, 3).double(), bdl.priors.IIDNormal(1.0))

    def model(x, y, num_data=NUM_DATA):
        logits = net(x)
        bdl.observe("y", dist.Categorical(logits=logits), y, num_data)
        return logits

    return x, y, model


@pytest.fixture(scope="module")
def run():
    x, y, model = _problem()
    pyro.set_rng_seed(0)
    mcmc = MCMC(
        SGLD(model, step_size=0.01),
        num_samples=20,
        warmup_steps=10,
        num_chains=2,
        disable_progbar=True,
    )
    mcmc.run(x, y)
    return x, y, model, mcmc


def test_mcmc_tree_has_arviz_groups_dims_and_attributes(run):
    x, y, model, mcmc = run
    tree = bdl.to_arviz(mcmc, model_args=(x, y), log_likelihood=True, posterior_predictive=True)
    posterior = tree["posterior"]
    assert posterior["weight"].dims == ("chain", "draw", "weight_dim_0", "weight_dim_1")
    assert posterior["weight"].shape == (2, 20, 3, 4)
    samples = mcmc.get_samples(group_by_chain=True)
    np.testing.assert_array_equal(posterior["bias"].values, samples["bias"].numpy())
    stats = tree["sample_stats"]
    potential = [mcmc._diagnostics[c]["sample_stats"]["potential_energy"] for c in range(2)]
    np.testing.assert_allclose(stats["lp"].values, -np.asarray(potential))
    assert set(stats.data_vars) == {"lp", "step_size", "temperature", "grad_norm"}
    assert tree["log_likelihood"]["y"].shape == (2, 20, NUM_DATA)
    assert tree["posterior_predictive"]["y"].shape == (2, 20, NUM_DATA)
    np.testing.assert_array_equal(tree["observed_data"]["y"].values, y.numpy())
    assert tree.attrs["method"] == "SGLD" and tree.attrs["step_size"] == 0.01
    assert tree.attrs["num_chains"] == 2


def test_posterior_predictive_draws_follow_the_model_not_the_data(run):
    x, y, model, mcmc = run
    tree = bdl.to_arviz(mcmc, model_args=(x, y), posterior_predictive=True)
    predicted = torch.as_tensor(tree["posterior_predictive"]["y"].values).reshape(-1, NUM_DATA)
    samples = mcmc.get_samples()  # (40 draws, ...) in the same chain-major order
    logits = torch.einsum("nj,dkj->dnk", x, samples["weight"]) + samples["bias"][:, None]
    probs = logits.softmax(-1)  # (40, 30, 3)
    # Predictions are draws of the likelihood, not the observations: under this model
    # about half of them differ from y (a predictive that returns the data has none).
    assert (predicted != y).double().mean() > 0.3
    # Each class appears as often as the model's probabilities say: over 1200 draws the
    # count of class k has mean sum p_k and variance sum p_k (1 - p_k); allow 4 sd.
    for k in range(3):
        p = probs[..., k]
        count = (predicted == k).double().sum()
        assert (count - p.sum()).abs() < 4 * (p * (1 - p)).sum().sqrt()


def test_log_likelihood_is_pointwise_and_unscaled(run):
    x, y, model, mcmc = run
    tree = bdl.to_arviz(mcmc, model_args=(x, y), log_likelihood=True)
    weight = torch.as_tensor(tree["posterior"]["weight"].values[1, 7])
    bias = torch.as_tensor(tree["posterior"]["bias"].values[1, 7])
    expected = dist.Categorical(logits=x @ weight.T + bias).log_prob(y)
    np.testing.assert_allclose(tree["log_likelihood"]["y"].values[1, 7], expected.numpy())


def test_log_likelihood_over_a_data_loader_matches_the_full_batch(run):
    x, y, model, mcmc = run
    loader = TensorLoader((x, y), batch_size=7)
    full = bdl.to_arviz(mcmc, model_args=(x, y), log_likelihood=True)

    def batched_model(batch, num_data):
        return model(*batch, num_data=num_data)

    batched = bdl.to_arviz(
        mcmc, model=batched_model, model_args=(loader, NUM_DATA), log_likelihood=True
    )
    np.testing.assert_allclose(
        batched["log_likelihood"]["y"].values, full["log_likelihood"]["y"].values
    )


def test_arviz_stats_and_plots_accept_the_tree(run, tmp_path):
    x, y, model, mcmc = run
    tree = bdl.to_arviz(mcmc, model_args=(x, y), log_likelihood=True)
    summary = arviz_stats.summary(tree)
    assert len(summary) == 3 * 4 + 3
    assert np.isfinite(arviz_stats.rhat(tree)["weight"].values).all()
    assert (arviz_stats.ess(tree)["bias"].values > 0).all()
    loo = arviz_stats.loo(tree)
    assert np.isfinite(loo.elpd)
    import arviz_plots
    import matplotlib

    matplotlib.use("Agg")
    plot = arviz_plots.plot_trace_dist(tree, var_names=["bias"], backend="matplotlib")
    plot.savefig(tmp_path / "trace.png")
    assert (tmp_path / "trace.png").read_bytes()[:4] == b"\x89PNG"


def test_netcdf_round_trip(run, tmp_path):
    x, y, model, mcmc = run
    tree = bdl.to_arviz(mcmc, model_args=(x, y), log_likelihood=True, posterior_predictive=True)
    path = tmp_path / "posterior.nc"
    tree.to_netcdf(path, engine="h5netcdf")
    loaded = xr.open_datatree(path, engine="h5netcdf")
    for group in (
        "posterior",
        "sample_stats",
        "log_likelihood",
        "posterior_predictive",
        "observed_data",
    ):
        xr.testing.assert_identical(loaded[group].to_dataset(), tree[group].to_dataset())
    assert loaded.attrs["method"] == "SGLD"


def test_max_coords_per_var_keeps_a_reproducible_subset(run):
    x, y, model, mcmc = run
    tree = bdl.to_arviz(mcmc, max_coords_per_var=5, seed=3)
    again = bdl.to_arviz(mcmc, max_coords_per_var=5, seed=3)
    other = bdl.to_arviz(mcmc, max_coords_per_var=5, seed=4)
    weight = tree["posterior"]["weight"]
    assert weight.dims == ("chain", "draw", "weight_index") and weight.shape == (2, 20, 5)
    index = weight["weight_index"].values
    np.testing.assert_array_equal(index, again["posterior"]["weight_index"].values)
    assert not np.array_equal(index, other["posterior"]["weight_index"].values)
    flat = mcmc.get_samples(group_by_chain=True)["weight"].reshape(2, 20, 12).numpy()
    np.testing.assert_array_equal(weight.values, flat[..., index])
    assert tree["posterior"]["bias"].shape == (2, 20, 3)  # small enough to keep whole
    assert len(arviz_stats.summary(tree)) == 5 + 3


def test_var_names_selects_sites_and_rejects_unknown_ones(run):
    x, y, model, mcmc = run
    tree = bdl.to_arviz(mcmc, var_names=["bias"])
    assert list(tree["posterior"].data_vars) == ["bias"]
    with pytest.raises(ValueError, match="var_names"):
        bdl.to_arviz(mcmc, var_names=["nope"])


def test_chains_runner_and_dict_sources():
    x, y, model = _problem()
    chains = Chains(
        SGLD(model, step_size=0.01),
        num_samples=4,
        warmup_steps=2,
        num_chains=3,
        disable_progbar=True,
    )
    chains.run(x, y)
    tree = bdl.to_arviz(chains)
    assert tree["posterior"]["weight"].shape == (3, 4, 3, 4)
    assert tree["sample_stats"]["lp"].shape == (3, 4)
    flat = chains.get_samples()
    from_dict = bdl.to_arviz(flat, grouped_by_chain=False)
    assert from_dict["posterior"]["weight"].shape == (1, 12, 3, 4)
    assert "sample_stats" not in from_dict.children


def test_guide_source_has_an_approximation_group():
    x, y, model = _problem()

    class Guide(AutoNormal):
        def approximation_parameters(self):
            return {"loc.weight": self.locs.weight, "scale.weight": self.scales.weight}

        def hyperparameters(self):
            return {"init_scale": 0.1}

    guide = Guide(model, init_scale=0.1)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.01}), Trace_ELBO())
    for _ in range(3):
        svi.step(x, y)
    tree = bdl.to_arviz(guide, num_samples=6, model_args=(x, y))
    assert tree["posterior"]["weight"].shape == (1, 6, 3, 4)
    assert set(tree["posterior"].data_vars) == {"weight", "bias"}
    np.testing.assert_allclose(
        tree["approximation"]["loc.weight"].values, guide.locs.weight.detach().numpy()
    )
    assert tree.attrs["method"] == "Guide" and tree.attrs["init_scale"] == 0.1
    with pytest.raises(ValueError, match="num_samples"):
        bdl.to_arviz(guide)
    # the seed makes the guide's draws: the same seed the same ones, another seed others
    same = bdl.to_arviz(guide, num_samples=6, model_args=(x, y), seed=0)["posterior"]["weight"]
    other = bdl.to_arviz(guide, num_samples=6, model_args=(x, y), seed=1)["posterior"]["weight"]
    np.testing.assert_array_equal(same.values, tree["posterior"]["weight"].values)
    assert not np.allclose(other.values, same.values)


def test_a_dict_of_draws_follows_pyro_get_samples_convention(run):
    # Issue 10, item 3: mcmc.get_samples() is (draws, ...); 40 draws are not 40 chains.
    x, y, model, mcmc = run
    tree = bdl.to_arviz(mcmc.get_samples())
    assert dict(tree["posterior"].sizes)["chain"] == 1
    assert tree["posterior"]["weight"].shape == (1, 40, 3, 4)
    grouped = bdl.to_arviz(mcmc.get_samples(group_by_chain=True), grouped_by_chain=True)
    assert grouped["posterior"]["weight"].shape == (2, 20, 3, 4)
    np.testing.assert_array_equal(
        grouped["posterior"]["bias"].values, mcmc.get_samples(group_by_chain=True)["bias"].numpy()
    )
    with pytest.raises(ValueError, match="different numbers of draws"):
        bdl.to_arviz({"a": torch.zeros(5, 2), "b": torch.zeros(4)})
    with pytest.raises(
        ValueError, match=r"source\['a'\] has shape \(5,\).*\(chain, draw, \.\.\.\)"
    ):
        bdl.to_arviz({"a": torch.zeros(5)}, grouped_by_chain=True)


def test_draws_of_another_dtype_are_conditioned_into_the_model_at_its_dtype(run):
    # CPU (here float32) draws go to the device and dtype of each site of the model.
    x, y, model, mcmc = run
    draws = {name: value.float() for name, value in mcmc.get_samples().items()}
    tree = bdl.to_arviz(draws, model=model, model_args=(x, y), log_likelihood=True)
    reference = bdl.to_arviz(
        mcmc.get_samples(), model=model, model_args=(x, y), log_likelihood=True
    )
    np.testing.assert_allclose(
        tree["log_likelihood"]["y"].values, reference["log_likelihood"]["y"].values, rtol=1e-5
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cpu_draws_are_conditioned_into_a_cuda_model(run):
    x, y, model, mcmc = run
    net = bdl.lift(torch.nn.Linear(4, 3).double().cuda(), bdl.priors.IIDNormal(1.0))

    def cuda_model(x, y, num_data=NUM_DATA):
        logits = net(x.cuda())
        bdl.observe("y", dist.Categorical(logits=logits), y.cuda(), num_data)
        return logits

    tree = bdl.to_arviz(
        mcmc, model=cuda_model, model_args=(x, y), log_likelihood=True, posterior_predictive=True
    )
    reference = bdl.to_arviz(mcmc, model_args=(x, y), log_likelihood=True)
    np.testing.assert_allclose(
        tree["log_likelihood"]["y"].values, reference["log_likelihood"]["y"].values, rtol=1e-6
    )


def test_function_space_group_from_the_kernels_probe_and_from_a_given_probe():
    from pyro_bdl.diagnostics import function_space, network_outputs

    x, y, model = _problem()
    chains = Chains(SGLD(model, step_size=0.01), num_samples=5, warmup_steps=2, num_chains=2,
                    seed=0, disable_progbar=True)  # fmt: skip
    chains.run(x, y)
    # The kernel followed the outputs on its first batch (all 30 inputs here) at every
    # kept draw: the same as computing them from the draws afterwards, to rounding.
    tree = bdl.to_arviz(chains)
    followed = tree["function_space"]["probs"]
    assert followed.dims == ("chain", "draw", "probe", "class") and followed.shape == (2, 5, 30, 3)
    grouped = chains.get_samples(group_by_chain=True)
    np.testing.assert_allclose(followed.values, network_outputs(model, x, y, samples=grouped),
                               rtol=1e-12)  # fmt: skip
    given = bdl.to_arviz(chains, probe=(x[:7], None))["function_space"]["probs"]
    assert given.shape == (2, 5, 7, 3)
    # network_outputs reads an ArviZ tree's posterior chain by chain, as the dict
    np.testing.assert_allclose(network_outputs(model, x[:7], None, samples=tree), given.values)
    assert np.isfinite(function_space(given.values).max_rhat)
    with pytest.raises(TypeError, match="probe must be a tuple of the model's arguments"):
        bdl.to_arviz(chains, probe=x)
    # A dict of draws has no kernel: no group unless a probe is given.
    assert "function_space" not in bdl.to_arviz(grouped, grouped_by_chain=True).children
