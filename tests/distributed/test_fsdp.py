"""FSDP: a frozen base sharded with torch's fully_shard (FSDP2) under the lifted sites, on
two CPU processes; SGHMC, a K-FAC Laplace fit and fit_map give what the replicated base
gives."""

import os

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import MCMC
from safetensors.torch import load_file, save_file

import pyro_bdl as bdl
from pyro_bdl.inference import SGHMC, LaplaceGuide, fit_map

from .launch import run_ranks

fsdp = pytest.importorskip("torch.distributed.fsdp")
if not hasattr(fsdp, "fully_shard"):
    pytest.skip("this torch has no fully_shard (FSDP2)", allow_module_level=True)

NUM_DATA = 16


def _fits(rank: int, shard: bool) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    base = torch.nn.Linear(4, 8).requires_grad_(False)  # the frozen base
    network = torch.nn.Sequential(base, torch.nn.Tanh(), torch.nn.Linear(8, 3))
    if shard:
        fsdp.fully_shard(network[0])
    net = bdl.lift(network, bdl.priors.IIDNormal(1.0), random=["2.weight", "2.bias"])
    x = torch.randn(NUM_DATA, 4, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 3, (NUM_DATA,), generator=torch.Generator().manual_seed(2))
    shard_x, shard_y = x[rank::2], y[rank::2]

    def model(x, y, num_data):
        logits = net(x)
        bdl.observe("y", dist.Categorical(logits=logits), y, num_data)
        return logits

    mcmc = MCMC(SGHMC(model, step_size=1e-2, temperature=0.0), num_samples=3, disable_progbar=True)
    mcmc.run(shard_x, shard_y, NUM_DATA)
    guide = LaplaceGuide(model, curvature="kron").fit(
        shard_x, shard_y, NUM_DATA, map=False, progress=False
    )
    pyro.clear_param_store()
    fitted = fit_map(model, shard_x, shard_y, NUM_DATA, num_steps=3, progress=False)
    return {
        "sghmc": mcmc.get_samples()["2.weight"],
        "evidence": guide.log_marginal_likelihood().reshape(1),
        "variance": guide.variance()["2.weight"],
        "map": fitted["2.weight"],
    }


def _rank(rank, out):
    for shard in (False, True):
        results = {k: v.detach().contiguous() for k, v in _fits(rank, shard).items()}
        save_file(results, os.path.join(out, f"rank{rank}_shard{int(shard)}.st"))


def test_sharded_frozen_base_gives_the_replicated_results(tmp_path):
    run_ranks(_rank, str(tmp_path))
    replicated = load_file(tmp_path / "rank0_shard0.st")
    for rank in range(2):
        sharded = load_file(tmp_path / f"rank{rank}_shard1.st")
        for key, value in replicated.items():
            torch.testing.assert_close(sharded[key], value, rtol=1e-6, atol=1e-7, msg=key)
