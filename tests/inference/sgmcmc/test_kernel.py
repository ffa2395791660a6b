"""The mechanics every SGMCMC kernel shares: minibatches, warm-up, thinning, statistics,
divergence, checkpoints, chains, initialisation and argument checks."""

import json
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import MCMC
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, TensorDataset

import pyro_bdl as bdl
from pyro_bdl.inference import SGHMC, SGLD, SGNHT, DivergenceError, RobbinsMonro
from pyro_bdl.inference.sgmcmc.chains import Chains
from pyro_bdl.inference.sgmcmc.dense import CURVATURE_ITERATIONS

KERNELS = [SGLD, SGHMC, SGNHT]
NUM_DATA = 24


def _data():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(NUM_DATA, 3, generator=generator, dtype=torch.float64)
    y = x @ torch.tensor([1.0, -1.0, 0.5], dtype=torch.float64)
    return x, y


def _loader(batch_size=6):
    x, y = _data()
    sampler = BatchSampler(SequentialSampler(range(NUM_DATA)), batch_size, drop_last=False)
    return DataLoader(TensorDataset(x, y), sampler=sampler, batch_size=None)


def _regression(record=None):
    torch.manual_seed(0)
    net = bdl.lift(torch.nn.Linear(3, 1).double(), bdl.priors.IIDNormal(1.0))

    def model(batch, num_data):
        x, y = batch
        if record is not None:
            record.append(x[:, 0].clone())
        bdl.observe("y", dist.Normal(net(x).squeeze(-1), 0.5), y, num_data)

    return net, model


@pytest.mark.parametrize("kernel_class", KERNELS)
def test_each_step_takes_the_next_minibatch_cycling_through_epochs(kernel_class):
    seen = []
    _, model = _regression(record=seen)
    kernel = kernel_class(model, step_size=1e-3)
    MCMC(kernel, num_samples=3, warmup_steps=4, disable_progbar=True).run(_loader(), NUM_DATA)
    x, _ = _data()
    batches = list(x[:, 0].split(6))
    # setup traces the first batch twice (the model's check, and the network's outputs on
    # it, the probe batch the convergence check follows), then 7 steps take batches
    # 0,1,2,3,0,1,2, each of the last 3 followed by its kept draw's outputs on the probe;
    # the first step measures the start's curvature for the dense mass of this small
    # model on its own batch (dense.py).
    probe = batches[0]
    curvature = [batches[0]] * CURVATURE_ITERATIONS
    expected = [probe, probe, batches[0], *curvature, *batches[1:], batches[0], probe]
    expected += [batches[1], probe, batches[2], probe]
    assert len(seen) == len(expected) == 12 + CURVATURE_ITERATIONS
    for got, want in zip(seen, expected):
        assert torch.equal(got, want)
    assert kernel.num_data == NUM_DATA


def test_thinning_runs_k_steps_per_kept_draw_and_warmup_one_each():
    _, model = _regression()
    kernel = SGHMC(model, step_size=1e-3, thin=4)
    mcmc = MCMC(kernel, num_samples=5, warmup_steps=3, disable_progbar=True)
    mcmc.run(_loader(), NUM_DATA)
    assert kernel.state.step == 3 + 5 * 4
    assert mcmc.get_samples()["weight"].shape == (5, 1, 3)
    stats = mcmc._diagnostics[0]["sample_stats"]
    assert {len(v) for v in stats.values()} == {5}


@pytest.mark.parametrize("kernel_class", KERNELS)
def test_sample_stats_and_logging(kernel_class):
    _, model = _regression()
    kernel = kernel_class(model, step_size=1e-3, temperature=0.7)
    mcmc = MCMC(kernel, num_samples=4, warmup_steps=2, disable_progbar=True)
    mcmc.run(_loader(), NUM_DATA)
    stats = mcmc._diagnostics[0]["sample_stats"]
    expected = {"potential_energy", "step_size", "temperature", "grad_norm"}
    if kernel_class is not SGLD:
        expected.add("kinetic_temperature")
    if kernel_class is SGNHT:
        expected.add("thermostat")
    assert set(stats) == expected
    assert stats["temperature"] == [0.7] * 4
    assert all(g > 0 for g in stats["grad_norm"])
    json.dumps(kernel.logging())
    json.dumps(kernel.diagnostics())


def test_potential_energy_is_minus_the_minibatch_log_joint():
    net, model = _regression()
    kernel = SGLD(model, step_size=1e-12, temperature=0.0)
    MCMC(kernel, num_samples=1, warmup_steps=0, disable_progbar=True).run(_loader(), NUM_DATA)
    x, y = _data()
    weight, bias = net.module.weight.detach(), net.module.bias.detach()
    log_prior = dist.Normal(0.0, 1.0).log_prob(torch.cat([weight.reshape(-1), bias])).sum()
    mean = x[:6] @ weight.reshape(-1) + bias
    log_lik = dist.Normal(mean, 0.5).log_prob(y[:6]).sum() * NUM_DATA / 6
    potential = kernel.diagnostics()["sample_stats"]["potential_energy"][0]
    assert potential == pytest.approx(-(log_prior + log_lik).item(), rel=1e-9)


@pytest.mark.parametrize("adapt", [False, True])
def test_step_size_schedule_is_recorded(adapt):
    # A schedule multiplies the given step size, or the adapted one.
    _, model = _regression()
    schedule = RobbinsMonro(b=2.0, gamma=1.0)
    kernel = SGLD(
        model, step_size=0.01, schedule=schedule, adapt_step_size=adapt, adapt_mass_matrix=adapt
    )
    MCMC(kernel, num_samples=3, warmup_steps=1, disable_progbar=True).run(_loader(), NUM_DATA)
    steps = kernel.diagnostics()["sample_stats"]["step_size"]
    base = kernel.adapted_step_size
    assert (base != 0.01) == adapt
    assert steps == pytest.approx([base * 2 / (2 + t) for t in (1, 2, 3)])


@pytest.mark.parametrize("kernel_class", KERNELS)
def test_chain_starts_at_the_module_weights_not_the_prior(kernel_class):
    net, model = _regression()
    with torch.no_grad():
        net.module.weight.fill_(7.0)
    kernel = kernel_class(model, step_size=1e-8, temperature=0.0)
    mcmc = MCMC(kernel, num_samples=1, warmup_steps=0, disable_progbar=True)
    mcmc.run(_loader(), NUM_DATA)
    assert torch.allclose(
        mcmc.get_samples()["weight"], torch.full((1, 1, 3), 7.0, dtype=torch.float64)
    )
    assert torch.equal(net.module.weight, torch.full((1, 3), 7.0, dtype=torch.float64))


def test_init_params_dict_and_strategy():
    _, model = _regression()
    start = {"weight": torch.full((1, 3), -3.0, dtype=torch.float64)}
    kernel = SGLD(model, step_size=1e-9, temperature=0.0, init_params=start)
    mcmc = MCMC(kernel, num_samples=1, warmup_steps=0, disable_progbar=True)
    mcmc.run(_loader(), NUM_DATA)
    assert torch.allclose(mcmc.get_samples()["weight"][0], start["weight"])


def test_divergence_stops_with_the_step_the_cause_and_the_draws_kept():
    _, model = _regression()
    kernel = SGLD(model, step_size=50.0, temperature=0.0)
    mcmc = MCMC(kernel, num_samples=200, warmup_steps=2, disable_progbar=True)
    with pytest.raises(DivergenceError, match=r"diverged at step \d+.*smaller step_size") as error:
        mcmc.run(_loader(), NUM_DATA)
    kept = error.value.draws["weight"]
    assert 0 < len(kept) < 200
    assert torch.isfinite(kept).all()
    assert torch.equal(kernel.get_draws()["weight"], kept)
    assert len(error.value.sample_stats["potential_energy"]) == len(kept)


def test_constrained_sites_are_sampled_in_unconstrained_space():
    x, y = _data()

    def model(x, y):
        scale = pyro.sample("scale", dist.LogNormal(0.0, 1.0))
        w = pyro.sample("w", dist.Normal(torch.zeros(3, dtype=torch.float64), 1.0).to_event(1))
        bdl.observe("y", dist.Normal(x @ w, scale), y, NUM_DATA)

    mcmc = MCMC(SGHMC(model, step_size=0.01), num_samples=50, warmup_steps=20, disable_progbar=True)
    mcmc.run(x, y)
    scale = mcmc.get_samples()["scale"]
    assert (scale > 0).all() and scale.shape == (50,)


def test_a_constrained_site_without_data_has_the_prior_moments():
    # LogNormal(0.2, 0.5) alone: the chain moves z = log s, whose law is N(0.2, 0.25)
    # only with the log-Jacobian term (without it the drift is that of
    # N(0.2 - 0.25, 0.25)). SGLD at step size eps on a Gaussian of precision lam has
    # the stationary variance 1 / (lam (1 - eps lam / 2)), exactly, and the lag-k
    # correlation (1 - eps lam)^k: thinned 2 at eps lam = 0.4, rho = 0.36, so the mean of
    # 2000 draws has the standard error sqrt(variance (1 + rho) / (1 - rho) / 2000) =
    # 0.018, a fourteenth of the missing Jacobian's shift; the variance's is about 5 %.
    # The 2000 draws are 20 independent chains of 100 at once (the site has 20 copies,
    # and the fixed kernel's update is elementwise), each past its 50 warm-up steps
    # ((1 - eps lam)^50 = 1e-11 of its start left).
    loc, scale, step_size, chains = 0.2, 0.5, 0.1, 20

    def model():
        s = dist.LogNormal(torch.tensor(loc, dtype=torch.float64), scale)
        pyro.sample("s", s.expand([chains]).to_event(1))

    pyro.set_rng_seed(0)
    fixed = {"adapt_step_size": False, "adapt_mass_matrix": False}
    kernel = SGLD(model, step_size=step_size, num_data=1, thin=2, **fixed)
    mcmc = MCMC(kernel, num_samples=100, warmup_steps=50, disable_progbar=True)
    with warnings.catch_warnings():  # it samples its prior; 100 draws a chain: R-hat 1.04
        warnings.simplefilter("ignore")
        mcmc.run()
    z = mcmc.get_samples()["s"].log().reshape(-1)
    lam = 1 / scale**2
    variance = 1 / (lam * (1 - step_size * lam / 2))
    rho = (1 - step_size * lam) ** 2
    assert abs(z.mean() - loc) < 4 * (variance * (1 + rho) / (1 - rho) / len(z)) ** 0.5
    assert abs(z.var() / variance - 1) < 0.25


def test_resume_from_checkpoint_continues_and_replays(tmp_path):
    _, model = _regression()
    pyro.set_rng_seed(0)
    kernel = SGHMC(model, step_size=1e-2, checkpoint=tmp_path, checkpoint_every=2)
    first = MCMC(kernel, num_samples=4, warmup_steps=5, disable_progbar=True)
    first.run(_loader(), NUM_DATA)
    steps_done = kernel.state.step

    resumed_kernel = SGHMC(model, step_size=1e-2, checkpoint=tmp_path, checkpoint_every=2)
    resumed = MCMC(resumed_kernel, num_samples=7, warmup_steps=5, disable_progbar=True)
    resumed.run(_loader(), NUM_DATA)
    old, new = first.get_samples()["weight"], resumed.get_samples()["weight"]
    assert torch.equal(new[:4], old)  # replayed from disk, not recomputed
    assert resumed_kernel.state.step == steps_done + 3
    assert not torch.equal(new[4], new[3])
    assert len(resumed_kernel.diagnostics()["sample_stats"]["step_size"]) == 7

    other = SGHMC(model, step_size=5e-2, checkpoint=tmp_path)
    with pytest.raises(ValueError, match="checkpoint: .* holds a chain with settings"):
        MCMC(other, num_samples=1, warmup_steps=5, disable_progbar=True).run(_loader(), NUM_DATA)


def test_interrupted_run_resumes_after_the_last_saved_state(tmp_path):
    _, model = _regression()
    # checkpoint_every=1: every kept draw is written with the state after it
    kernel = SGLD(model, step_size=1e-3, checkpoint=tmp_path, checkpoint_every=1)
    mcmc = MCMC(kernel, num_samples=6, warmup_steps=0, disable_progbar=True)

    def interrupt(kernel, params, stage, i):
        if i == 2:
            raise KeyboardInterrupt

    mcmc.sampler.hook = interrupt
    with pytest.raises(KeyboardInterrupt):
        mcmc.run(_loader(), NUM_DATA)
    kept = kernel.get_draws()["weight"]
    assert len(kept) == 3
    resumed_kernel = SGLD(model, step_size=1e-3, checkpoint=tmp_path, checkpoint_every=1)
    resumed = MCMC(resumed_kernel, num_samples=6, warmup_steps=0, disable_progbar=True)
    resumed.run(_loader(), NUM_DATA)
    assert torch.equal(resumed.get_samples()["weight"][:3], kept)
    assert resumed_kernel.state.step == 6


def test_several_chains_through_pyro_mcmc():
    _, model = _regression()
    mcmc = MCMC(
        SGLD(model, step_size=1e-3),
        num_samples=5,
        warmup_steps=2,
        num_chains=2,
        disable_progbar=True,
    )
    mcmc.run(_loader(), NUM_DATA)
    samples = mcmc.get_samples(group_by_chain=True)["weight"]
    assert samples.shape == (2, 5, 1, 3)
    assert not torch.equal(samples[0], samples[1])


def test_several_chains_in_worker_processes(monkeypatch):
    # Pyro runs chains in processes only with a spare core per chain; pretend there are.
    monkeypatch.setattr(torch.multiprocessing, "cpu_count", lambda: 8)
    _, model = _regression()
    mcmc = MCMC(
        SGLD(model, step_size=1e-3),
        num_samples=4,
        warmup_steps=2,
        num_chains=2,
        mp_context="fork",
        disable_progbar=True,
    )
    mcmc.run(_data(), NUM_DATA)
    assert mcmc.get_samples(group_by_chain=True)["weight"].shape == (2, 4, 1, 3)
    assert len(mcmc._diagnostics[1]["sample_stats"]["grad_norm"]) == 4


def test_chains_in_one_process_group_draws_by_chain():
    _, model = _regression()
    starts = [torch.full((1, 3), float(c), dtype=torch.float64) for c in range(3)]
    chains = Chains(
        SGHMC(model, step_size=1e-3, temperature=0.0),
        num_samples=2,
        warmup_steps=3,
        num_chains=3,
        init_params=lambda c: {"weight": starts[c]},
        disable_progbar=True,
    )
    chains.run(_loader(), NUM_DATA)
    grouped = chains.get_samples(group_by_chain=True)["weight"]
    assert grouped.shape == (3, 2, 1, 3)
    for c in range(3):  # T = 0, tiny steps: each chain stays near its own start
        assert torch.allclose(grouped[c], starts[c].expand(2, 1, 3), atol=0.1)
    assert chains.get_samples()["weight"].shape == (6, 1, 3)
    assert set(chains.diagnostics()["sample_stats"]) == {"chain 0", "chain 1", "chain 2"}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"step_size": -0.1}, "step_size must be a positive finite number, got -0.1"),
        ({"step_size": 0.1, "temperature": -1}, "temperature must be a non-negative"),
        ({"step_size": 0.1, "thin": 0}, "thin must be an int >= 1"),
        ({"step_size": 0.1, "num_data": 0}, "num_data must be an int >= 1"),
        ({"step_size": 0.1, "friction": -2.0}, "friction must be a non-negative"),
        ({"step_size": 0.1, "mass": 0.0}, "mass must be a positive"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    _, model = _regression()
    with pytest.raises(ValueError, match=message):
        SGHMC(model, **kwargs)


def test_a_model_without_observed_sites_warns_that_it_samples_the_prior():
    # Issue 22: it raised the num_data error, which told nothing of the missing data.
    def model():
        pyro.sample("w", dist.Normal(0.0, 1.0))

    with pytest.warns(
        UserWarning, match=r"no observed site, so the kernel samples the prior of \['w'\]"
    ):
        mcmc = MCMC(SGLD(model, step_size=0.1), num_samples=2, disable_progbar=True)
        mcmc.run()
    assert mcmc.get_samples()["w"].shape == (2,)


def test_a_model_that_subsamples_with_its_own_plate_is_refused():
    # Issue 10, item 11: pyro.plate("data", len(x)) counts the minibatch as all the data.
    torch.manual_seed(0)
    net = bdl.lift(torch.nn.Linear(3, 1).double(), bdl.priors.IIDNormal(1.0))

    def model(batch, num_data):
        x, y = batch
        with pyro.plate("data", len(x)):
            pyro.sample("y", dist.Normal(net(x).squeeze(-1), 0.5), obs=y)

    kernel = SGLD(model, step_size=1e-3, num_data=NUM_DATA)
    with pytest.raises(ValueError, match="'y' has a batch of 6 examples and no num_data scale"):
        MCMC(kernel, num_samples=2, disable_progbar=True).run(_loader(), NUM_DATA)
    # Full batch, the same model is right, and needs no num_data.
    mcmc = MCMC(SGLD(model, step_size=1e-3), num_samples=2, disable_progbar=True)
    mcmc.run(_data(), NUM_DATA)
    assert mcmc.kernel.num_data == NUM_DATA


def test_init_params_and_initial_params_take_the_site_dtype_and_device():
    # CPU float32 starting values for a float64 model (on a GPU: CPU values, CUDA model).
    _, model = _regression()
    start = {"weight": torch.full((1, 3), 2.0), "bias": torch.zeros(1)}
    kernel = SGLD(model, step_size=1e-9, temperature=0.0, init_params=start)
    mcmc = MCMC(kernel, num_samples=1, disable_progbar=True)
    mcmc.run(_loader(), NUM_DATA)
    assert mcmc.get_samples()["weight"].dtype == torch.float64
    mcmc = MCMC(
        SGLD(model, step_size=1e-9, temperature=0.0),
        num_samples=1,
        initial_params={"weight": torch.full((1, 3), 2.0), "bias": torch.zeros(1)},
        disable_progbar=True,
    )
    mcmc.run(_loader(), NUM_DATA)
    assert torch.allclose(mcmc.get_samples()["weight"], torch.full((1, 1, 3), 2.0).double())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("kernel_class", KERNELS)
def test_a_cuda_model_runs_from_cpu_init_params(kernel_class):
    torch.manual_seed(0)
    net = bdl.lift(torch.nn.Linear(3, 1).double().cuda(), bdl.priors.IIDNormal(1.0))

    def model(batch, num_data):
        x, y = (t.cuda() for t in batch)
        bdl.observe("y", dist.Normal(net(x).squeeze(-1), 0.5), y, num_data)

    start = {"weight": torch.zeros(1, 3), "bias": torch.zeros(1)}
    kernel = kernel_class(model, step_size=1e-3, init_params=start)
    mcmc = MCMC(kernel, num_samples=5, warmup_steps=3, disable_progbar=True)
    mcmc.run(_loader(), NUM_DATA)
    assert mcmc.get_samples()["weight"].is_cuda
    assert kernel.get_draws()["weight"].device.type == "cpu"
