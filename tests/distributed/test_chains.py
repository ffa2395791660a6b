"""Chains across W = 2 real processes (gloo): split by rank, gathered in order on rank 0,
equal to one process; a killed rank's chain resumes from its store; MCMC(num_chains=K)
inside a job is refused with a pointer to Chains."""

import json
import os

import pyro.distributions as dist
import pytest
import torch
import xarray as xr
from pyro.infer import MCMC
from safetensors.torch import load_file, save_file
from torch.multiprocessing import ProcessExitedException

import pyro_bdl as bdl
from pyro_bdl.data import TensorLoader
from pyro_bdl.inference import SGHMC, Chains
from pyro_bdl.inference.sgmcmc.checkpoint import DistributedChainsError
from pyro_bdl.inference.sgmcmc.store import DrawStore

from .launch import run_ranks

NUM_DATA = 24
NUM_CHAINS = 3


def _problem(calls=None):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(NUM_DATA, 3, generator=generator, dtype=torch.float64)
    y = x @ torch.tensor([1.0, -1.0, 0.5], dtype=torch.float64)
    torch.manual_seed(0)
    net = bdl.lift(torch.nn.Linear(3, 1).double(), bdl.priors.IIDNormal(1.0))

    def model(batch, num_data):
        if calls is not None:
            calls()
        x, y = batch
        bdl.observe("y", dist.Normal(net(x).squeeze(-1), 0.5), y, num_data)

    # a shuffling loader: its order comes from the chain's seed, on whichever rank
    loader = TensorLoader((x, y), batch_size=6, shuffle=True)
    return model, loader, (x, y)


def _chains(model, **kernel_options):
    kernel = SGHMC(model, step_size=1e-2, **kernel_options)
    return Chains(
        kernel, num_samples=4, warmup_steps=3, num_chains=NUM_CHAINS, seed=7, disable_progbar=True
    )


def _gather_and_save(rank, out):
    model, loader, _ = _problem()
    chains = _chains(model)
    chains.run(loader, NUM_DATA)
    samples = chains.get_samples(group_by_chain=True)
    labels = bdl.to_arviz(chains)["posterior"]["chain"].values.tolist()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(
            {
                "chain_ids": chains.chain_ids,
                "labels": labels,
                "shape": list(samples["weight"].shape),
            },
            f,
        )
    if rank == 0:
        save_file({k: v.contiguous() for k, v in samples.items()}, os.path.join(out, "samples.st"))
        bdl.to_arviz(chains).to_netcdf(os.path.join(out, "tree.nc"))


def test_chains_are_split_over_ranks_and_gathered_in_order_equal_to_one_process(
    tmp_path, monkeypatch
):
    # one draw of one site per message (a weight draw is 24 bytes): chunk by chunk
    monkeypatch.setattr(bdl.distributed, "GATHER_CHUNK_BYTES", 24)
    run_ranks(_gather_and_save, str(tmp_path))
    model, loader, _ = _problem()
    single = _chains(model)
    single.run(loader, NUM_DATA)
    expected = single.get_samples(group_by_chain=True)
    gathered = load_file(tmp_path / "samples.st")
    assert set(gathered) == set(expected)
    for name in expected:
        assert torch.equal(gathered[name], expected[name]), name
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["chain_ids"] == ranks[0]["labels"] == [0, 1, 2]
    assert ranks[1] == {"chain_ids": [1], "labels": [1], "shape": [1, 4, 1, 3]}  # its own
    tree = xr.open_datatree(tmp_path / "tree.nc", engine="h5netcdf")
    local = bdl.to_arviz(single)
    for group in ("posterior", "sample_stats"):
        xr.testing.assert_identical(
            tree[group].to_dataset().drop_attrs(), local[group].to_dataset().drop_attrs()
        )
    drop = {"created_at"}
    assert {k: v for k, v in tree.attrs.items() if k not in drop} == {
        k: v for k, v in local.attrs.items() if k not in drop
    }


def _run_with_checkpoint(rank, directory, out, die_after):
    calls = [0]

    def count():
        calls[0] += 1
        if rank == 1 and die_after is not None and calls[0] > die_after:
            os._exit(1)  # the rank is killed mid-chain: no clean-up, no saving

    model, _, data = _problem(count)
    chains = _chains(model, checkpoint=directory, checkpoint_every=1)
    chains.run(data, NUM_DATA)  # full batch: the chain is a function of its seed alone
    with open(os.path.join(out, f"calls{rank}.json"), "w") as f:
        json.dump(calls[0], f)
    if rank == 0:
        samples = chains.get_samples(group_by_chain=True)
        save_file({k: v.contiguous() for k, v in samples.items()}, os.path.join(out, "samples.st"))


def test_a_killed_ranks_chain_resumes_from_its_store(tmp_path):
    directory, out = tmp_path / "run", tmp_path / "out"
    out.mkdir()
    # rank 1 runs chain 1 (7 steps); its model is called twice at set-up (the model's
    # check and the outputs on the probe batch), ten times more at the first step (the
    # dense mass's curvature probe: 4 parameters), once a step and once more for each
    # kept draw's outputs on the probe: it dies at the third kept draw's step
    with pytest.raises(ProcessExitedException):
        run_ranks(_run_with_checkpoint, str(directory), str(out), 19)
    stored = DrawStore(directory / "chain_1" / "draws.zarr", chain=1)
    kept = stored.read(0, stored.num_written)["weight"]
    assert 0 < len(kept) < 4
    run_ranks(_run_with_checkpoint, str(directory), str(out), None)
    gathered = load_file(out / "samples.st")["weight"]
    assert torch.equal(gathered[1, : len(kept)], kept)
    # rank 1 computed only the steps after its chain's last saved state (after warm-up
    # and the kept draws), plus the set-up's two calls and the outputs on the probe batch
    # of each of the 4 kept draws (those read back from the store included)
    assert json.loads((out / "calls1.json").read_text()) == 2 + 7 - (3 + len(kept)) + 4
    model, _, data = _problem()
    uninterrupted = _chains(model)
    uninterrupted.run(data, NUM_DATA)
    assert torch.equal(gathered, uninterrupted.get_samples(group_by_chain=True)["weight"])


def _mcmc_with_chains(rank, out):
    model, loader, _ = _problem()
    mcmc = MCMC(SGHMC(model, step_size=1e-2), num_samples=2, num_chains=2, disable_progbar=True)
    try:
        mcmc.run(loader, NUM_DATA)
    except DistributedChainsError as error:
        with open(os.path.join(out, f"refused{rank}.txt"), "w") as f:
            f.write(str(error))


def test_mcmc_with_several_chains_in_a_job_is_refused_pointing_to_chains(tmp_path, monkeypatch):
    import pyro.infer.mcmc.api

    monkeypatch.setattr(pyro.infer.mcmc.api.mp, "cpu_count", lambda: 1)  # chains in sequence
    run_ranks(_mcmc_with_chains, str(tmp_path))
    for rank in range(2):
        assert "use pyro_bdl.inference.Chains" in (tmp_path / f"refused{rank}.txt").read_text()
