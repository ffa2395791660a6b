"""The end-of-run convergence warning: weight space, and for a lifted network function space
first (the sign-flip network of tests/sign_flip.py, whose mirrored modes make the same
predictions)."""

import warnings

import pyro
import pytest
import torch

from pyro_bdl.inference import SGHMC, Chains
from pyro_bdl.inference.sgmcmc.convergence import SymmetricModesWarning, convergence_warning
from tests.sign_flip import MODE, draws_near, flipped_output, mirrored, sign_flip_model

FIXED = {"adapt_step_size": False, "adapt_mass_matrix": False}


def _warnings_over_chains(centres, num_draws=200):
    """The warning after each chain, for chains of independent draws around ``centres``,
    recorded through the monitors a kernel sets up for each chain of a run."""
    model, x, y = sign_flip_model()
    kernel = SGHMC(model, step_size=1e-3, probe=(x[::25], y[::25]), **FIXED)
    samples = draws_near(centres, num_draws)
    found = []
    for chain in range(len(centres)):
        kernel._chain_id = chain  # as Chains runs them: one kernel, set up per chain
        kernel.setup(0, x, y)
        weights, outputs = kernel.kept.monitor, kernel.function_monitor
        for i in range(num_draws):
            params = {name: value[chain, i] for name, value in samples.items()}
            weights.add(weights.coordinates(params).tolist())
            outputs.add(params)
        found.append(convergence_warning(weights, outputs))
    return found


def test_chains_in_mirrored_modes_warn_that_only_weight_space_rhat_is_high():
    # 200 independent draws (spread 0.05) around a mode, then as many around its mirror
    # image. Across both chains the weights' R-hat is high (modes 3 apart never overlap)
    # and the outputs' is not: 16 outputs of 400 iid draws, R-hat within 1.01 and ESS near
    # 400 (the ESS estimate of 200 iid draws alone spreads enough that the first chain's
    # smallest over 16 outputs may fall under 100, so its verdict is not asserted).
    _, (message, category) = _warnings_over_chains([MODE, mirrored(MODE)])
    assert category is SymmetricModesWarning
    assert message.startswith(
        "in function space the predictive has converged: the network's outputs on the 8 "
        "probe inputs, over 2 chains of 200 kept draws"
    )
    assert "the chains sit in different modes that make the same predictions" in message
    assert "agree on the top class for 100% of the inputs" in message


def test_chains_that_disagree_in_function_space_warn_that_the_predictive_has_not_converged():
    *_, (message, category) = _warnings_over_chains([MODE, flipped_output(MODE)])
    assert category is RuntimeWarning
    assert message.startswith("in function space, the network's outputs on the 8 probe inputs")
    assert "the predictive distribution has not converged; in weight space, split R-hat" in message


def test_a_run_of_chains_follows_one_probe_batch_without_moving_the_chains_random_stream():
    model, x, y = sign_flip_model()

    def run(probe):
        kernel = SGHMC(model, step_size=1e-2, thin=2, probe=probe, **FIXED)
        chains = Chains(kernel, 6, 4, num_chains=2, seed=0, disable_progbar=True,
                        init_params=lambda c: MODE if c == 0 else mirrored(MODE))  # fmt: skip
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            chains.run(x, y)
        return kernel, chains.get_samples(group_by_chain=True), caught

    # With y=None the probe's forward pass samples labels: it must not change the chains.
    kernel, sampled, caught = run((x[:10], None))
    monitor = kernel.function_monitor
    assert monitor.shape == (10, 2) and [len(c) for c in monitor._outputs] == [6, 6]
    _, observed, _ = run((x[:10], y[:10]))
    for name in sampled:
        assert torch.equal(sampled[name], observed[name])
    # 6 draws of a chain with a small fixed step: nothing has converged, and the warning
    # says so in function space first.
    messages = [str(w.message) for w in caught if "SGHMC" in str(w.message)]
    assert messages and all(m.startswith("SGHMC: in function space") for m in messages)


def test_probe_must_be_a_tuple_of_the_models_arguments():
    model, x, _ = sign_flip_model()
    with pytest.raises(TypeError, match="probe must be a tuple of the model's arguments"):
        SGHMC(model, step_size=1e-2, probe=x)


def test_a_model_that_is_not_a_network_keeps_the_weight_space_warning():
    import pyro.distributions as dist

    def model(y):
        mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
        pyro.sample("y", dist.Normal(mu, 1.0), obs=y)

    kernel = SGHMC(model, step_size=1e-2, num_data=5, **FIXED)
    kernel.setup(0, torch.zeros(5))
    assert kernel.function_monitor is None


def test_a_function_rhat_that_chance_explains_is_not_reported_as_a_finding():
    # One chain of 6 independent draws: over the 16 outputs, independent draws of this shape
    # reach a split R-hat far above 1.1, so the warning says the draws are too few for
    # R-hat to judge instead of calling its value a sign of non-convergence.
    [(message, category)] = _warnings_over_chains([MODE], num_draws=6)
    # (draws_near is seeded: this chain's R-hat is 2.02, independent draws' 2.19)
    assert category is RuntimeWarning and "bulk ESS down to" in message
    assert "(2.19: too few draws for R-hat to judge)" in message
