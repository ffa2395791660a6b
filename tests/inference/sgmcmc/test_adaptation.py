"""Warm-up adaptation (issue 22): the fixed kernels are unchanged; adaptation stops at the
end of warm-up, survives a resumed checkpoint, and equalises an ill-conditioned Gaussian.
That the defaults match NUTS on the issue's five models is a long check of the validation
tier (``validation/test_sgmcmc_defaults.py``).
"""

import math
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import MCMC
from torch.utils.data import DataLoader, TensorDataset

from pyro_bdl.inference import SGHMC, SGLD, SGNHT

from .reference_models import CASES, sample

# the NUTS references are float64, and tests/pyro_models.py builds in the default dtype
pytestmark = pytest.mark.usefixtures("float64")

KERNELS = {"SGHMC": SGHMC, "SGLD": SGLD, "SGNHT": SGNHT}
FIXED = {"adapt_step_size": False, "adapt_mass_matrix": False}


def test_mass_equalises_an_ill_conditioned_gaussian():
    # The diagonal mass is the gradients' second moment over N T, the curvature (Fisher
    # identity): 1 and 1000 here (unadapted, both 1). It is estimated from the last slow
    # window's 950 gradients, which are correlated over about 20 steps: some 50
    # independent squares of a normal, a relative error of sqrt(2 / 50) = 0.2, on top
    # of the chain's few per cent of excess variance: within 50 % is 2.5 errors. (The
    # diagonal mass is the networks'; a model this small gets a dense one by default,
    # test_dense.py.)
    case = CASES["gaussian"]()
    kernel = SGHMC(case.model, dense_mass=False, **case.kernel_options)
    sample(case, kernel, 10, 2000)
    inverse_mass = kernel.inverse_mass_matrix["z"]
    torch.testing.assert_close(inverse_mass, torch.tensor([1.0, 1e-3]).double(), rtol=0.5, atol=0)


@pytest.mark.parametrize("kernel_class", [SGLD, SGHMC, SGNHT])
def test_nothing_changes_after_warmup(kernel_class):
    case = CASES["regression"]()
    kernel = kernel_class(case.model)
    seen = []

    def hook(kernel, params, stage, i):
        if stage == "Sample":
            mass = {name: value.clone() for name, value in kernel.inverse_mass_matrix.items()}
            seen.append((kernel.adapted_step_size, mass))

    pyro.set_rng_seed(0)
    mcmc = MCMC(kernel, num_samples=30, warmup_steps=300, disable_progbar=True, hook_fn=hook)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        mcmc.run(*case.args)
    step_size, mass = seen[0]
    assert all(s == step_size for s, _ in seen)
    assert all(torch.equal(m[name], mass[name]) for _, m in seen for name in mass)
    assert set(kernel.diagnostics()["sample_stats"]["step_size"]) == {step_size}


def _linear(num_data=40):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(num_data, 3, generator=generator, dtype=torch.float64)
    y = x @ torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    y = y + torch.randn(num_data, generator=generator, dtype=torch.float64)

    def model(x, y):
        w = pyro.sample("w", dist.Normal(torch.zeros(3, dtype=torch.float64), 1.0).to_event(1))
        with pyro.plate("data", len(y)):
            pyro.sample("obs", dist.Normal(x @ w, 1.0), obs=y)

    return model, (x, y)


@pytest.mark.parametrize("kernel_class", [SGLD, SGHMC])
@pytest.mark.parametrize("flags, warmup_steps", [(FIXED, 5), ({}, 0)])
def test_without_adaptation_a_kernel_is_the_fixed_step_for_step(kernel_class, flags, warmup_steps):
    # Both flags False, or no warm-up: the update of posteriors' Appendix B with the
    # given step size and unit mass, noise drawn as the kernel draws it (one flat N(0, I)).
    model, (x, y) = _linear()
    step_size, num_data, steps = 0.05, len(y), warmup_steps + 6
    # from zeros given as a dict: Pyro's init_to_feasible, the default start, draws from
    # the prior to find the support, which would shift the random stream
    start = {"w": torch.zeros(3, dtype=torch.float64)}
    kernel = kernel_class(model, step_size, init_params=start, **flags)
    pyro.set_rng_seed(0)
    mcmc = MCMC(kernel, num_samples=6, warmup_steps=warmup_steps, disable_progbar=True)
    mcmc.run(x, y)
    ours = mcmc.get_samples()["w"]
    pyro.set_rng_seed(0)
    w, m, trajectory = torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64), []
    for _ in range(steps):
        leaf = w.clone().requires_grad_(True)
        log_joint = dist.Normal(0.0, 1.0).log_prob(leaf).sum()
        log_joint = log_joint + dist.Normal(x @ leaf, 1.0).log_prob(y).sum()
        (g,) = torch.autograd.grad(log_joint, leaf)
        noise = torch.randn(3, dtype=torch.float64)
        if kernel_class is SGLD:
            w = w + step_size / num_data * g + math.sqrt(2 * step_size / num_data) * noise
        else:
            m = (1 - step_size) * m + step_size / num_data * g
            m = m + math.sqrt(2 * step_size / num_data) * noise
            w = w + step_size * m
        trajectory.append(w)
    torch.testing.assert_close(ours, torch.stack(trajectory[warmup_steps:]), rtol=1e-10, atol=1e-12)


def test_resumed_warmup_continues_its_adaptation_exactly(tmp_path):
    # Interrupted in the middle of warm-up (inside a slow window), a chain resumed from
    # its checkpoint goes on with the same mass, squared gradients, step size and
    # stiffest direction: the same draws as a chain never interrupted.
    model, data = _linear()

    def run(directory, interrupt_at=None):
        pyro.set_rng_seed(1)
        kernel = SGHMC(model, checkpoint=directory, checkpoint_every=1)
        mcmc = MCMC(kernel, num_samples=5, warmup_steps=60, disable_progbar=True)

        def hook(kernel, params, stage, i):
            if stage == "Warmup" and i == interrupt_at:
                raise KeyboardInterrupt

        mcmc.sampler.hook = hook
        mcmc.run(*data)
        return mcmc.get_samples()["w"], kernel

    straight, reference = run(tmp_path / "straight")
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "resumed", interrupt_at=37)
    resumed, kernel = run(tmp_path / "resumed")
    assert torch.equal(resumed, straight)
    assert kernel.adapted_step_size == reference.adapted_step_size
    for key, inverse_mass in reference.inverse_mass_matrix.items():  # dense: one key
        assert torch.equal(kernel.inverse_mass_matrix[key], inverse_mass)
    # and the power method on the stiffest direction (stiffness.py) goes on mid-block
    assert kernel.state.adaptation.stiffness == reference.state.adaptation.stiffness


def test_a_start_buffer_saved_as_variances_resumes_as_second_moments():
    # Checkpoints of earlier versions hold the start buffer's variances where this one
    # holds second moments; restored, they must give the mass an uninterrupted run gives
    # (the identity second moment = variance + squared mean is exact for these weights).
    from pyro_bdl.inference.sgmcmc.adaptation import Adaptation

    torch.manual_seed(0)
    theta = [torch.zeros(3, dtype=torch.float64), torch.zeros(2, 2, dtype=torch.float64)]
    gradients = [[torch.randn_like(t) + 2.0 for t in theta] for _ in range(16)]

    def adaptation():
        options = {"scale": 10.0, "start": 0.2, "step_exponent": 1.0, "max_step_size": 1.0}
        return Adaptation(
            theta, 200, 0.1, adapt_step_size=False, adapt_mass_matrix=True,
            target_excess=0.1, **options,
        )  # fmt: skip

    straight, resumed = adaptation(), adaptation()
    for grads in gradients[:11]:
        straight.observe_gradient(grads)
    tensors, numbers = straight.state()
    old = dict(numbers)
    del old["start_buffer"]
    old_tensors = {**tensors}
    for key, mean in tensors.items():
        if key.startswith("means/"):
            squares = key.replace("means/", "squares/")
            old_tensors[squares] = tensors[squares] - mean * mean
    resumed.load_state(old_tensors, old)
    for grads in gradients[11:]:  # step 16 refreshes the mass
        straight.observe_gradient(grads)
        resumed.observe_gradient(grads)
    for ours, reference in zip(resumed.inverse_mass, straight.inverse_mass):
        torch.testing.assert_close(ours, reference, rtol=1e-12, atol=0)


def test_each_chain_adapts_on_its_own_under_chains():
    from pyro_bdl.inference import Chains

    model, data = _linear()
    chains = Chains(SGLD(model), num_samples=20, warmup_steps=50, num_chains=2, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        chains.run(*data)
    steps = chains.diagnostics()["sample_stats"]
    first, second = (set(steps[f"chain {c}"]["step_size"]) for c in range(2))
    assert len(first) == len(second) == 1 and first != second  # adapted, each its own
    assert chains.get_samples(group_by_chain=True)["w"].shape == (2, 20, 3)


def test_loader_minibatches_adapt_too():
    # A DataLoader argument (a fresh minibatch per step, scaled N / B by bdl.observe):
    # the squared gradients include the minibatch noise, and the chain stays finite.
    import pyro_bdl as bdl

    model, (x, y) = _linear(200)

    def loader_model(batch, num_data):
        xb, yb = batch
        w = pyro.sample("w", dist.Normal(torch.zeros(3, dtype=torch.float64), 1.0).to_event(1))
        bdl.observe("obs", dist.Normal(xb @ w, 1.0), yb, num_data)

    loader = DataLoader(TensorDataset(x, y), batch_size=20, shuffle=True)
    exact = torch.linalg.solve(x.T @ x + torch.eye(3, dtype=torch.float64), x.T @ y)
    # from the posterior's mode, as SGMCMC chains start from a MAP fit: with gradients
    # this noisy (N / B = 10) a far start takes thousands of steps to come in
    kernel = SGHMC(loader_model, init_params={"w": exact})
    pyro.set_rng_seed(0)
    mcmc = MCMC(kernel, num_samples=200, warmup_steps=200, disable_progbar=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        mcmc.run(loader, len(y))
    w = mcmc.get_samples()["w"]
    assert torch.isfinite(w).all()
    # posterior sds are about 0.07 and the 200 draws have an ESS of at least 20: 0.1 is
    # over six Monte Carlo standard errors
    assert (w.mean(0) - exact).abs().max() < 0.1


@pytest.mark.parametrize(
    "make, match",
    [
        (
            lambda m: SGLD(m, adapt_step_size=False),
            "step_size: none given and adapt_step_size=False",
        ),
        (lambda m: SGHMC(m, temperature=0.0), "step_size: none given at temperature 0"),
        (lambda m: SGHMC(m, step_size=2.0), r"step_size \* friction / mass must be below 2"),
        (lambda m: SGNHT(m, step_size=0.5, friction=5.0), r"step_size \* friction / mass"),
        (lambda m: SGLD(m, target_excess=0.0), "target_excess must be a positive"),
        (lambda m: SGLD(m, adapt_mass_matrix="yes"), "adapt_mass_matrix must be True or False"),
    ],
)
def test_bad_adaptation_settings_are_named(make, match):
    model, _ = _linear()
    with pytest.raises((ValueError, TypeError), match=match):
        make(model)


def test_no_step_size_and_no_warmup_is_named():
    model, data = _linear()
    mcmc = MCMC(SGHMC(model), num_samples=2, warmup_steps=0, disable_progbar=True)
    with pytest.raises(ValueError, match="with warmup_steps=0 nothing is adapted"):
        mcmc.run(*data)


def test_the_issues_fixed_step_run_warns_naming_its_sites():
    # Issue 22's reproducer: SGHMC at step_size 1e-2, fixed, on the breast-cancer model
    # stays where it started (n_eff 2.6 - 5.7 in Pyro's summary) and used to say nothing.
    case = CASES["breast_cancer"]()
    kernel = SGHMC(case.model, step_size=1e-2, **FIXED)
    pyro.set_rng_seed(0)
    mcmc = MCMC(kernel, num_samples=2000, warmup_steps=1000, disable_progbar=True)
    with pytest.warns(RuntimeWarning) as caught:
        mcmc.run(*case.args)
    (message,) = [str(w.message) for w in caught if "kept draws have" in str(w.message)]
    assert message.startswith("SGHMC: the 2000 kept draws have split R-hat up to")
    assert "bulk ESS down to" in message and "the sites 'w', 'b'" in message
    assert "was not adapted: let warm-up adapt it" in message


def _normal_mean(num_data):
    # y_i ~ N(mu, 1) with mu ~ N(0, 10): a conjugate posterior of sd about N^-1/2, whose
    # per-datum gradients spread exactly as its Fisher information
    import pyro_bdl as bdl

    generator = torch.Generator().manual_seed(0)
    y = 1.0 + torch.randn(num_data, generator=generator, dtype=torch.float64)

    def model(batch, num_data):
        (yb,) = batch
        mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0, dtype=torch.float64), 10.0))
        bdl.observe("obs", dist.Normal(mu.expand(yb.shape), 1.0), yb, num_data)

    return model, y


def _run_normal_mean(kernel_class, batch_size):
    model, y = _normal_mean(1000)
    loader = DataLoader(TensorDataset(y), batch_size=batch_size, shuffle=True)
    pyro.set_rng_seed(0)
    kernel = kernel_class(model)
    mcmc = MCMC(kernel, num_samples=300, warmup_steps=500, disable_progbar=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mcmc.run(loader, len(y))
    return kernel, [str(w.message) for w in caught if "kept draws have" in str(w.message)]


@pytest.mark.parametrize("kernel_class", [SGLD, SGHMC])
def test_a_step_held_down_by_minibatch_noise_is_named_with_its_batch(kernel_class):
    # Batches of 10 of 1,000 data: the gradient noise is N / B - 1 = 99 times the signal
    # (measured 68 - 73), warm-up holds the step 34-fold (SGLD; SGHMC 7-fold) below what
    # batches of the whole data set get, and 300 draws have not explored the posterior.
    # The warning names that cause and the batch that brings the noise to the signal's
    # level (N / (1 + 99 / noise), about N / 2, in equal batches), not only more draws.
    kernel, (message,) = _run_normal_mean(kernel_class, 10)
    whole, messages = _run_normal_mean(kernel_class, 1000)
    assert kernel.adapted_step_size < whole.adapted_step_size / (5 if kernel_class is SGHMC else 20)
    assert 30 < kernel.gradient_noise < 300 and abs(whole.gradient_noise) < 1
    assert "minibatch gradient noise held the step size down" in message
    assert "(batches of about 10 of the 1000 data)" in message
    # noise 68 - 73 against the 99 of N / B - 1: two batches an epoch, not 3 of which one
    # is small
    assert "batches of 500, 2 of about equal size an epoch, bring it to the signal's" in message
    assert message.endswith("check the traces (bdl.to_arviz and bdl.diagnostics.summary)")
    assert not any("gradient noise" in m for m in messages)
