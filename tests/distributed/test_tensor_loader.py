"""TensorLoader(shard=True) over W = 2 real processes (gloo): each rank a disjoint shard of
every pass, reshuffled per pass the same on both ranks, so that a data-parallel fit and
chain with B / 2 per rank equal one process with a shuffled TensorLoader of batch B."""

import os

import pyro
import pytest
import torch
from pyro.infer import MCMC
from safetensors.torch import load_file, save_file

from pyro_bdl.data import TensorLoader
from pyro_bdl.inference import SGHMC, fit_map

from .launch import run_ranks
from .test_data_parallel import BATCH, NUM_DATA, _problem

pytestmark = pytest.mark.filterwarnings("ignore:.*R-hat")  # a few draws: equality only

# NUM_DATA = 32 and the global batch BATCH = 8 of test_data_parallel: 4 per rank, 4 per pass
STEPS = 6  # into the second pass


def _shards(data, world: int) -> TensorLoader:
    return TensorLoader(data, batch_size=BATCH // world, shuffle=True, seed=7, shard=True)


def _run(world: int) -> dict[str, torch.Tensor]:
    """Two passes of this rank's example ids, a MAP fit and an SGHMC chain."""
    results = {}
    loader = _shards(torch.arange(NUM_DATA), world)
    for epoch in range(2):
        results[f"pass{epoch}"] = torch.cat(list(loader))
    loader.set_epoch(1)
    results["pass1.again"] = torch.cat(list(loader))
    model, dataset = _problem()
    loader, optimizer = _shards(dataset.tensors, world), pyro.optim.Adam({"lr": 0.05})
    fitted = fit_map(model, loader, NUM_DATA, num_steps=STEPS, optimizer=optimizer, progress=False)
    results.update({f"map.{name}": value for name, value in fitted.items()})
    model, dataset = _problem()
    pyro.set_rng_seed(3)
    kernel = SGHMC(model, step_size=1e-2, adapt_step_size=False, adapt_mass_matrix=False)
    mcmc = MCMC(kernel, num_samples=STEPS, disable_progbar=True)
    mcmc.run(_shards(dataset.tensors, world), NUM_DATA)
    results.update({f"sghmc.{name}": value for name, value in mcmc.get_samples().items()})
    return {key: value.detach().contiguous() for key, value in results.items()}


def _rank(rank, out):
    pyro.clear_param_store()
    save_file(_run(world=2), os.path.join(out, f"rank{rank}.st"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("tensor_loader")
    run_ranks(_rank, str(out))
    pyro.clear_param_store()
    return [load_file(out / f"rank{r}.st") for r in range(2)], _run(world=1)


def test_each_pass_splits_into_disjoint_shards_reshuffled_alike_on_every_rank(runs):
    ranks, single = runs
    for epoch in range(2):
        shards = [rank[f"pass{epoch}"] for rank in ranks]
        assert len(shards[0]) == len(shards[1]) == NUM_DATA // 2
        assert sorted(torch.cat(shards).tolist()) == list(range(NUM_DATA))
        # the ranks' k-th batches together are the k-th global batch of one process
        for k in range(NUM_DATA // BATCH):
            together = torch.cat([s[k * BATCH // 2 : (k + 1) * BATCH // 2] for s in shards])
            whole = single[f"pass{epoch}"][k * BATCH : (k + 1) * BATCH]
            assert sorted(together.tolist()) == sorted(whole.tolist())
    assert not torch.equal(single["pass0"], single["pass1"])
    for rank in ranks:
        assert torch.equal(rank["pass1.again"], rank["pass1"])


@pytest.mark.parametrize("method", ["map", "sghmc"])
def test_a_data_parallel_fit_on_the_shards_equals_one_process(runs, method):
    # the same examples per global batch, summed in another order: equal to rounding
    ranks, single = runs
    keys = [key for key in single if key.startswith(method + ".")]
    assert keys
    for key in keys:
        for rank in ranks:
            torch.testing.assert_close(rank[key], single[key], rtol=1e-6, atol=1e-9, msg=key)
