import warnings

import arviz_base
import arviz_stats
import numpy as np
import pytest
import scipy.special
import scipy.stats
import torch
import xarray as xr
from pyro.ops.stats import split_gelman_rubin

from pyro_bdl import diagnostics

# Same algorithm, same float64 operations up to summation order: agreement is to rounding.
RTOL = 1e-10


def arviz_reference(samples):
    """(rhat, ess_bulk, ess_tail) from arviz_stats' defaults, shaped like the coordinates."""
    with warnings.catch_warnings():
        # "chain dimension longer than draw dimension", and 0 / 0 on constant coordinates
        warnings.simplefilter("ignore")
        idata = arviz_base.from_dict({"posterior": {"w": samples}})
        return (
            arviz_stats.rhat(idata)["w"].values,
            arviz_stats.ess(idata, method="bulk")["w"].values,
            arviz_stats.ess(idata, method="tail")["w"].values,
        )


def hard_cases(seed, num_chains, num_draws):
    """Coordinates covering what the diagnostics special-case: (chain, draw, 12)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(num_chains, num_draws, 12))
    noise = rng.normal(size=(num_chains, num_draws))
    for t in range(1, num_draws):  # AR(1) with strong autocorrelation
        x[:, t, 0] = 0.9 * x[:, t - 1, 0] + noise[:, t]
    x[:, :, 1] += 2.0 * np.arange(num_chains)[:, None]  # chains that disagree
    x[:, :, 2] = 3.0  # constant: R-hat nan, ESS = number of draws
    x[:, :, 3] = np.round(x[:, :, 3])  # many ties
    x[:, :, 4] = np.arange(num_chains)[:, None]  # constant within chains: R-hat inf
    x[:, :, 5] = rng.integers(0, 2, size=(num_chains, num_draws))  # binary
    x[:, :, 6] = np.nan
    x[0, 1, 7] = np.nan  # a single nan spoils the coordinate
    x[:, :, 8] = np.exp(3 * x[:, :, 8])  # heavy right tail
    x[:, :, 9] = np.cumsum(x[:, :, 9], axis=1)  # random walk
    x[:, : num_draws // 2 + 1, 10] = np.inf  # median inf: folding gives inf - inf = nan
    x[0, 0, 11], x[-1, -1, 11] = np.inf, -np.inf
    return x


def one_chain_rhat(samples):
    """Rank-normalised split R-hat of one chain, from scipy's ranks and Pyro's
    ``split_gelman_rubin`` (arviz_stats returns nan for a single chain)."""
    (chain,) = samples
    half = len(chain) // 2
    kept = np.concatenate([chain[:half], chain[len(chain) - half :]])

    def split_rhat(values):
        ranks = scipy.stats.rankdata(values, axis=0)
        z = scipy.special.ndtri((ranks - 0.375) / (len(values) + 0.25))
        # split_gelman_rubin halves the chain again: kept is already the two halves
        return split_gelman_rubin(torch.as_tensor(z)[None], chain_dim=0, sample_dim=1).numpy()

    with np.errstate(invalid="ignore"):
        bulk = split_rhat(kept)
        tail = split_rhat(np.abs(kept - np.median(kept, axis=0)))
    return np.where(tail > bulk, tail, bulk)


def assert_matches_arviz(samples, **kwargs):
    expected = arviz_reference(samples)
    if samples.shape[0] == 1:
        expected = (one_chain_rhat(samples), *expected[1:])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # too few chains for R-hat
        actual = diagnostics.diagnose(samples, **kwargs)
    for name, e, a in zip(diagnostics.Diagnostics._fields, expected, actual, strict=True):
        assert a.shape == e.shape, name
        np.testing.assert_allclose(a, e, rtol=RTOL, atol=0, equal_nan=True, err_msg=name)


@pytest.mark.parametrize(
    "seed, num_chains, num_draws",
    [(0, 4, 100), (1, 2, 7), (2, 3, 51), (3, 4, 4), (4, 4, 5), (5, 2, 1000), (6, 8, 6)],
)
def test_matches_arviz_on_hard_cases(seed, num_chains, num_draws):
    assert_matches_arviz(hard_cases(seed, num_chains, num_draws))


@pytest.mark.parametrize("seed", range(20))
def test_matches_arviz_on_random_small_discrete_draws(seed):
    rng = np.random.default_rng(100 + seed)
    num_chains, num_draws = rng.integers(1, 6), rng.integers(4, 30)
    levels = rng.integers(2, 6)  # few distinct values: ties everywhere
    samples = rng.integers(0, levels, size=(num_chains, num_draws, 5)).astype(float)
    samples += rng.integers(0, 2, size=(num_chains, 1, 5))  # chains that may disagree
    assert_matches_arviz(samples)


@pytest.mark.parametrize("shape", [(4, 60, 3, 5), (2, 33, 2, 2, 2), (3, 20)])
def test_matches_arviz_on_any_coordinate_shape(shape):
    rng = np.random.default_rng(len(shape))
    samples = rng.standard_t(df=3, size=shape) + rng.normal(
        size=shape[:1] + (1,) * (len(shape) - 1)
    )
    assert_matches_arviz(samples)


@pytest.mark.parametrize("num_draws", [40, 41, 500])
def test_a_single_chain_is_split_in_halves_for_rhat(num_draws):
    # Issue 22: one chain gets a split R-hat (it was nan), Pyro's definition; its ESS is
    # arviz's.
    rng = np.random.default_rng(num_draws)
    samples = rng.normal(size=(1, num_draws, 3))
    samples[0, :, 1] += np.linspace(0, 3, num_draws)  # a trend: the halves disagree
    samples[0, :, 2] = np.cumsum(samples[0, :, 2])  # a random walk
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rhat = diagnostics.rhat(samples)
    np.testing.assert_allclose(rhat, one_chain_rhat(samples), rtol=RTOL)
    assert rhat[0] < 1.1 and rhat[1] > 1.2 and rhat[2] > 1.1
    assert_matches_arviz(samples)


def test_too_few_draws_gives_nan_with_a_warning():
    with pytest.warns(UserWarning, match="4 draws"):
        result = diagnostics.diagnose(np.zeros((4, 3, 2)))
    assert all(np.isnan(values).all() and values.shape == (2,) for values in result)


@pytest.mark.parametrize("prob", [0.95, (0.1, 0.7)])
def test_tail_prob_matches_arviz(prob):
    samples = hard_cases(8, 4, 50)
    idata = arviz_base.from_dict({"posterior": {"w": samples}})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # inf - inf in np.quantile
        expected = arviz_stats.ess(idata, method="tail", prob=prob)["w"].values
    actual = diagnostics.ess_tail(samples, prob)
    np.testing.assert_allclose(actual, expected, rtol=RTOL, atol=0, equal_nan=True)


def test_single_diagnostics_equal_the_combined_pass():
    samples = hard_cases(9, 4, 30)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        combined = diagnostics.diagnose(samples)
        singles = (
            diagnostics.rhat(samples),
            diagnostics.ess_bulk(samples),
            diagnostics.ess_tail(samples),
        )
    for c, s in zip(combined, singles, strict=True):
        np.testing.assert_array_equal(c, s)


def test_chunking_and_threads_do_not_change_results():
    rng = np.random.default_rng(10)
    samples = rng.normal(size=(4, 40, 100, 100)).cumsum(axis=1)  # 10^4 coordinates
    samples[:, :, 0, :7] = np.round(samples[:, :, 0, :7])
    reference = diagnostics.diagnose(samples, chunk_size=10_000, num_threads=1)
    for chunk_size, num_threads in [(13, 1), (37, 2), (1024, 3)]:
        result = diagnostics.diagnose(samples, chunk_size=chunk_size, num_threads=num_threads)
        for r, x in zip(reference, result, strict=True):
            np.testing.assert_array_equal(x, r)
            assert x.shape == (100, 100)


def test_torch_input_matches_numpy():
    samples = np.random.default_rng(11).normal(size=(3, 20, 4))
    for array in (samples, samples.astype(np.float32)):
        expected = diagnostics.diagnose(array)
        result = diagnostics.diagnose(torch.from_numpy(array))
        for e, r in zip(expected, result, strict=True):
            np.testing.assert_array_equal(r, e)


def test_bad_input_is_rejected_with_the_fix():
    with pytest.raises(ValueError, match=r"samples must be shaped \(chain, draw, \*coords\)"):
        diagnostics.rhat(np.zeros(10))
    with pytest.raises(ValueError, match="chunk_size must be an int >= 1, got 0"):
        diagnostics.rhat(np.zeros((2, 10)), chunk_size=0)
    with pytest.raises(ValueError, match="prob must be"):
        diagnostics.ess_tail(np.zeros((2, 10)), prob=1.5)


def test_summary_matches_arviz_summary():
    rng = np.random.default_rng(12)
    posterior = {"w": rng.normal(size=(4, 50, 3, 2)), "b": rng.normal(size=(4, 50))}
    idata = arviz_base.from_dict({"posterior": posterior})
    result = diagnostics.summary(idata)
    expected = arviz_stats.summary(idata, fmt="xarray", round_to="none")
    assert set(result.data_vars) == {"w", "b"}
    assert list(result["w"].coords["summary"].values) == [
        "mean",
        "sd",
        "ess_bulk",
        "ess_tail",
        "r_hat",
    ]
    for name in result.data_vars:
        for stat in result[name].coords["summary"].values:
            np.testing.assert_allclose(
                result[name].sel(summary=stat).values,
                expected[name].sel(summary=stat).values,
                rtol=RTOL,
                err_msg=f"{name} {stat}",
            )


def test_summary_selects_variables_and_formats():
    rng = np.random.default_rng(13)
    idata = arviz_base.from_dict(
        {"posterior": {"w": rng.normal(size=(2, 10, 3)), "b": rng.normal(size=(2, 10))}}
    )
    assert list(diagnostics.summary(idata, var_names=["b"]).data_vars) == ["b"]
    assert isinstance(diagnostics.summary(idata.posterior.to_dataset()), xr.Dataset)
    frame = diagnostics.summary(idata, fmt="dataframe")
    assert frame.shape == (4, 5) and "r_hat" in frame.columns
    with pytest.raises(ValueError, match="var_names"):
        diagnostics.summary(idata, var_names=["nope"])
    with pytest.raises(ValueError, match="no group 'prior'"):
        diagnostics.summary(idata, group="prior")
    with pytest.raises(ValueError, match="fmt must be"):
        diagnostics.summary(idata, fmt="json")


def test_summary_of_too_few_draws_keeps_the_moments():
    samples = np.random.default_rng(14).normal(size=(2, 3, 4))
    idata = arviz_base.from_dict({"posterior": {"w": samples}})
    with pytest.warns(UserWarning, match="4 draws"):
        result = diagnostics.summary(idata)["w"]
    np.testing.assert_allclose(result.sel(summary="mean"), samples.mean(axis=(0, 1)))
    np.testing.assert_allclose(result.sel(summary="sd"), samples.std(axis=(0, 1)))
    assert np.isnan(result.sel(summary=["ess_bulk", "ess_tail", "r_hat"])).all()


def test_summary_streams_a_dask_backed_posterior_block_by_block(monkeypatch):
    pytest.importorskip("dask")
    rng = np.random.default_rng(3)
    posterior = xr.Dataset(
        {
            "w": (("chain", "draw", "i", "j"), rng.normal(size=(4, 30, 9, 7)).astype(np.float32)),
            "s": (("chain", "draw"), rng.normal(size=(4, 30))),
        }
    )
    in_memory = diagnostics.summary(posterior)
    lazy = posterior.chunk({"chain": 1, "draw": 10, "i": 2})
    # 4 x 30 float32 draws of 16 coordinates per block: w in blocks of 2 rows of 7 (aligned
    # to the stored chunks of 2 rows), s in one block
    monkeypatch.setattr(diagnostics, "STREAM_BLOCK_BYTES", 4 * 30 * 4 * 16)
    read = []
    original = diagnostics._diagnose

    def spy(values, *args, **kwargs):
        read.append(np.shape(values))
        return original(values, *args, **kwargs)

    monkeypatch.setattr(diagnostics, "_diagnose", spy)
    streamed = diagnostics.summary(lazy)
    xr.testing.assert_allclose(streamed, in_memory, rtol=RTOL)
    assert read == [(4, 30, 2, 7)] * 4 + [(4, 30, 1, 7), (4, 30)]


@pytest.mark.parametrize(
    "shape, chunks, entries",
    [
        ((9, 7), (2, 7), 16),
        ((9, 7), (2, 7), 3),
        ((5,), (5,), 100),
        ((), (), 1),
        ((3, 4, 5), (1, 2, 5), 11),
    ],
)
def test_coordinate_blocks_cover_every_coordinate_once(shape, chunks, entries):
    seen = np.zeros(shape, dtype=int)
    for block in diagnostics._coordinate_blocks(shape, chunks, entries):
        seen[block] += 1
        assert seen[block].size <= max(entries, shape[-1] if shape else 1)
    assert (seen == 1).all()


# -- function space ----------------------------------------------------------------------------
# The sign-flip network of tests/sign_flip.py: chains around a mode and its mirror image hold
# different weights and make the same predictions.


def test_mirrored_modes_have_high_weight_rhat_and_function_rhat_near_one():
    from tests.sign_flip import MODE, draws_near, mirrored, sign_flip_model

    model, x, _ = sign_flip_model()
    # 4 chains of 100 independent draws: the largest R-hat of iid draws over 640 outputs is
    # 1.03 on average (1.034 at most in 20 seeds), so over these 16 outputs 1.05 is a wide
    # bound. The chains' weights differ by 2 x 1.5 against a spread of 0.05: two pairs of
    # chains that never overlap, for which the rank-normalised R-hat of four chains is 1.73.
    samples = draws_near([MODE, mirrored(MODE)] * 2, num_draws=100)
    probs = diagnostics.network_outputs(model, x[::25], samples=samples)
    assert probs.shape == (4, 100, 8, 2) and probs.dtype == np.float64
    assert np.nanmax(diagnostics.rhat(samples["0.weight"])) > 1.7
    fs = diagnostics.function_space(probs)
    assert fs.max_rhat < 1.05 and fs.converged()
    assert fs.rhat.shape == (8, 2) and fs.min_ess > 200  # 400 iid draws
    # Same function in every chain: the predictives agree on every input and their total
    # variation is the Monte Carlo error of a 100-draw mean (about 0.005).
    assert fs.agreement == 1.0 and fs.total_variation < 0.01


def test_chains_that_disagree_in_function_space_have_high_function_rhat():
    from tests.sign_flip import MODE, draws_near, flipped_output, sign_flip_model

    model, x, _ = sign_flip_model()
    samples = draws_near([MODE, flipped_output(MODE)] * 2, num_draws=100)
    fs = diagnostics.function_space(diagnostics.network_outputs(model, x[::25], samples=samples))
    # The flipped output layer predicts the other class wherever |w2 tanh(w1 x)| is large.
    assert fs.max_rhat > 1.5 and not fs.converged()  # 1.73 for chains that never overlap
    assert fs.agreement < 0.5 and fs.total_variation > 0.5


def test_agreement_and_total_variation_of_known_predictives():
    # Two chains, constant draws: predictives [0.9, 0.1] and [0.4, 0.6] on input 0 (top
    # classes differ, TV 0.5) and the same [0.2, 0.8] on input 1 (agree, TV 0).
    chain_0 = np.array([[0.9, 0.1], [0.2, 0.8]])
    chain_1 = np.array([[0.4, 0.6], [0.2, 0.8]])
    probs = np.stack([np.broadcast_to(c, (5, 2, 2)) for c in (chain_0, chain_1)])
    assert diagnostics.agreement(probs) == pytest.approx(0.5)
    assert diagnostics.total_variation(probs) == pytest.approx(0.25)
    fs = diagnostics.function_space(probs)
    # Input 1's outputs never change (nan, converged); input 0's differ between chains
    # that each stay put: infinite R-hat.
    assert np.isnan(fs.rhat[1]).all() and np.isinf(fs.rhat[0]).all() and not fs.converged()


def test_function_space_names_what_is_wrong_with_its_input():
    with pytest.raises(ValueError, match=r"\(chain, draw, probe"):
        diagnostics.function_space(np.zeros((2, 10)))
    logits = np.random.default_rng(0).normal(size=(2, 10, 3, 4))
    with pytest.raises(ValueError, match="apply a softmax to logits first"):
        diagnostics.agreement(logits)
    fs = diagnostics.function_space(logits, probabilities=False)  # R-hat of any output
    assert np.isnan(fs.agreement) and fs.rhat.shape == (3, 4)
    with pytest.raises(ValueError, match="two chains or more"):
        diagnostics.total_variation(np.full((1, 10, 3, 2), 0.5))


def test_network_outputs_needs_draws_grouped_by_chain():
    from tests.sign_flip import MODE, sign_flip_model

    model, x, _ = sign_flip_model()
    ungrouped = {"0.weight": MODE["0.weight"].double()[None], "2.weight": torch.zeros(3, 2, 1)}
    with pytest.raises(ValueError, match="grouped by chain"):
        diagnostics.network_outputs(model, x, samples=ungrouped)


def test_function_space_of_too_few_draws_is_nan_not_converged():
    probs = np.full((1, 2, 3, 2), 0.5) + np.array([0.1, -0.1])  # 2 draws: R-hat undefined
    probs[0, 1] = np.array([0.3, 0.7])
    with pytest.warns(UserWarning, match="need at least 4 draws"):
        fs = diagnostics.function_space(probs)
    assert np.isnan(fs.max_rhat) and np.isnan(fs.min_ess) and not fs.converged()


def test_function_rhat_of_few_draws_over_many_outputs_is_what_chance_gives():
    # One chain of 10 independent draws of 1,500 outputs: some output's two halves are
    # told apart by chance, so the largest split R-hat is the ceiling of 10 draws (the
    # same with four times the outputs), above 2: the value the cold-posterior
    # experiment's serial chain reported at every temperature.
    ceiling = diagnostics.independent_max_rhat((1, 10, 6000))
    assert ceiling > 2 and diagnostics.independent_max_rhat((1, 10, 1500)) == ceiling
    iid = np.random.default_rng(1).uniform(size=(1, 10, 750, 2))
    fs = diagnostics.function_space(iid, probabilities=False)
    assert fs.max_rhat == pytest.approx(ceiling) and not fs.judgeable
    # 4 chains of 100 draws over 16 outputs: chance stays far below the 1.1 that judges
    outputs = np.random.default_rng(2).uniform(size=(4, 100, 8, 2))
    fs = diagnostics.function_space(outputs, probabilities=False)
    assert fs.independent_max_rhat < 1.05 and fs.judgeable
