"""The chunked zarr store of a chain's draws, and opening stores lazily as one DataTree."""

import shutil

import numpy as np
import pyro
import pytest
import torch
import xarray as xr
from pyro.infer import MCMC

import pyro_bdl as bdl
from pyro_bdl.inference import SGLD, Chains
from pyro_bdl.inference.sgmcmc import store as store_module
from pyro_bdl.inference.sgmcmc.store import DrawStore, open_tree

from .test_kernel import NUM_DATA, _data, _loader, _regression


def _draw(i):
    return {"w": torch.full((5, 7), float(i)), "b": torch.tensor(-float(i), dtype=torch.float64)}


def test_draws_wait_for_a_full_chunk_then_go_to_disk_in_one_piece(tmp_path):
    # 5 x 7 float32 + one float64 = 148 bytes a draw: a 600-byte budget holds 4 draws
    store = DrawStore(tmp_path / "draws.zarr", chain=3, buffer_bytes=600)
    for i in range(6):
        store.append(_draw(i), {"potential_energy": i / 2})
        if store.chunk_is_full:
            store.flush()
    assert (store.num_written, len(store), store.draws_per_chunk) == (4, 6, 4)
    array = store._arrays("posterior")["w"]
    assert array.shards[:2] == (1, 4) and array.dtype == np.float32
    got = store.read(2, 6)  # two draws from disk, two from memory
    assert torch.equal(got["w"], torch.stack([_draw(i)["w"] for i in range(2, 6)]))
    assert got["b"].dtype == torch.float64
    store.flush()
    assert store.stats()["potential_energy"] == [i / 2 for i in range(6)]
    reopened = DrawStore(tmp_path / "draws.zarr", chain=3)
    assert len(reopened) == 6
    reopened.truncate(5)
    assert len(DrawStore(tmp_path / "draws.zarr", chain=3)) == 5
    tree = open_tree(tmp_path)  # the directory holding draws.zarr: one chain
    posterior = tree["posterior"]
    assert posterior["w"].dims == ("chain", "draw", "w_dim_0", "w_dim_1")
    assert list(posterior["chain"].values) == [3] and posterior.sizes["draw"] == 5


def test_inner_chunks_cut_the_first_axis_that_does_not_fit():
    assert store_module._inner_chunks((1000, 1000), 4 * 16) == (4, 1000)
    assert store_module._inner_chunks((8, 4), 4) == (8, 4)
    assert store_module._inner_chunks((10, 100_000), 4 * 8) == (1, 8192)
    assert store_module._inner_chunks((), 8) == ()


def test_names_that_cannot_be_stored_are_refused(tmp_path):
    store = DrawStore(tmp_path / "draws.zarr", chain=0)
    store.append({"draw": torch.zeros(2)}, {})
    with pytest.raises(ValueError, match="named 'draw' cannot be stored"):
        store.flush()


def test_to_arviz_of_a_checkpoint_opens_every_chain_lazily(tmp_path):
    _, model = _regression()
    kernel = SGLD(model, step_size=1e-3, checkpoint=tmp_path, checkpoint_every=2)
    chains = Chains(
        kernel, num_samples=5, warmup_steps=2, num_chains=3, seed=0, disable_progbar=True
    )
    chains.run(_loader(), NUM_DATA)
    stored = bdl.to_arviz(tmp_path)
    in_memory = bdl.to_arviz(chains)
    for group in ("posterior", "sample_stats"):
        lazy = stored[group].to_dataset()
        assert all(v.chunks is not None for v in lazy.data_vars.values())  # dask-backed
        xr.testing.assert_equal(lazy.compute(), in_memory[group].to_dataset())
    assert stored.attrs["method"] == "SGLD" and stored.attrs["num_chains"] == 3
    one = bdl.to_arviz(tmp_path / "chain_1", var_names=["bias"])
    assert list(one["posterior"].data_vars) == ["bias"]
    assert list(one["posterior"]["chain"].values) == [1]
    with pytest.raises(ValueError, match=r"\['log_likelihood'\] need the draws in memory"):
        bdl.to_arviz(tmp_path, log_likelihood=True)
    with pytest.raises(FileNotFoundError, match="holds no chain store"):
        bdl.to_arviz(tmp_path / "chain_1" / "draws.zarr" / "posterior")


def test_draws_kept_after_the_last_state_are_dropped_on_opening(tmp_path):
    _, model = _regression()
    kernel = SGLD(model, step_size=1e-3, checkpoint=tmp_path)
    mcmc = MCMC(kernel, num_samples=4, warmup_steps=0, disable_progbar=True)
    mcmc.run(_data(), NUM_DATA)
    # a run killed between writing draws and its state: two extra draws on disk
    store = kernel.kept.checkpoint.store
    for _ in range(2):
        store.append(kernel.constrained_values(), {key: 0.0 for key in kernel.kept.stats})
    store.flush()
    assert store.num_written == 6
    tree = bdl.to_arviz(tmp_path)
    assert tree["posterior"].sizes["draw"] == 4
    np.testing.assert_array_equal(
        tree["posterior"]["weight"].values[0], mcmc.get_samples()["weight"].numpy()
    )


def test_a_store_left_half_made_by_a_killed_run_is_made_afresh(tmp_path):
    _, model = _regression()

    def run():
        pyro.set_rng_seed(0)
        kernel = SGLD(model, step_size=1e-3, checkpoint=tmp_path)
        mcmc = MCMC(kernel, num_samples=4, warmup_steps=0, disable_progbar=True)
        mcmc.run(_data(), NUM_DATA)
        return kernel, mcmc.get_samples()["weight"]

    kernel, first = run()
    # killed while creating its store, before any state was saved: one statistic's array
    # was never made (the distributed resume test met it when a rank's kill ended the job)
    checkpoint = kernel.kept.checkpoint
    checkpoint.state_path.unlink()
    store = checkpoint.store
    shutil.rmtree(store.path / "sample_stats" / "potential_energy")
    _, again = run()
    assert torch.equal(again, first)
