"""TensorLoader's passes, seeds and batch structures; sliced() gives a plain loader's own
batches from its own random draws; every consumer of DataLoaders accepts a TensorLoader."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import MCMC, SVI, TraceMeanField_ELBO
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import pyro_bdl as bdl
from pyro_bdl.data import TensorLoader
from pyro_bdl.data.tensor_loader import EpochBatches, SlicedTensors, sliced
from pyro_bdl.inference import (
    SGHMC,
    SGLD,
    Chains,
    IVONGuide,
    LaplaceGuide,
    MeanFieldGuide,
    Minibatches,
    fit_ivon,
    fit_map,
)


def _ids(batches) -> list[list[int]]:
    """The example indices of each batch of a loader over (arange, ...)."""
    return [batch[0].tolist() for batch in batches]


def _data(num_data=10):
    ids = torch.arange(num_data)
    return ids, torch.randn(num_data, 3, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("drop_last", [False, True])
def test_each_pass_is_a_fresh_shuffle_of_every_example(drop_last):
    loader = TensorLoader(_data(10), batch_size=4, shuffle=True, drop_last=drop_last, seed=0)
    passes = [_ids(loader) for _ in range(3)]
    assert len(loader) == (2 if drop_last else 3)
    for batches in passes:
        assert [len(b) for b in batches] == ([4, 4] if drop_last else [4, 4, 2])
        seen = sorted(i for b in batches for i in b)
        assert len(set(seen)) == len(seen) and (drop_last or seen == list(range(10)))
    assert passes[0] != passes[1] != passes[2]
    assert loader.batch_sampler.epoch == 3


def test_in_order_batches_are_views_of_the_tensors_and_rows_stay_paired():
    ids, x = _data(5)
    batches = list(TensorLoader((ids, x), batch_size=2))
    assert _ids(batches) == [[0, 1], [2, 3], [4]]
    assert batches[1][1].data_ptr() == x[2].data_ptr()  # a view: nothing copied
    for b_ids, b_x in TensorLoader((ids, x), batch_size=3, shuffle=True):
        torch.testing.assert_close(b_x, x[b_ids], rtol=0, atol=0)


def test_one_batch_of_every_example_is_the_data_as_given_even_shuffled():
    ids, x = _data(6)
    for batch_size in (6, 50):
        (batch,) = list(TensorLoader((ids, x), batch_size=batch_size, shuffle=True))
        assert batch[0].tolist() == list(range(6)) and batch[1].data_ptr() == x.data_ptr()


def test_without_a_seed_the_global_generator_draws_each_pass():
    loader = TensorLoader(_data(12), batch_size=5, shuffle=True)
    torch.manual_seed(1)
    first = [_ids(loader) for _ in range(2)]
    torch.manual_seed(1)
    assert [_ids(loader) for _ in range(2)] == first and first[0] != first[1]


def test_a_seed_fixes_every_pass_and_never_touches_the_global_generator():
    def run(seed):
        loader = TensorLoader(_data(12), batch_size=5, shuffle=True, seed=seed)
        return [_ids(loader) for _ in range(2)]

    torch.manual_seed(0)
    state = torch.get_rng_state()
    first = run(0)
    assert torch.equal(torch.get_rng_state(), state)
    assert run(0) == first and run(1) != first
    # seed 1's first pass is not seed 0's second (DistributedSampler's seed + epoch is)
    assert run(1)[0] != first[1]


def test_set_epoch_replays_a_pass():
    loader = TensorLoader(_data(12), batch_size=5, shuffle=True, seed=3)
    passes = [_ids(loader) for _ in range(3)]
    loader.set_epoch(1)
    assert _ids(loader) == passes[1] and _ids(loader) == passes[2]


@pytest.mark.parametrize("kind", ["tuple", "list", "dict", "tensor"])
def test_batches_keep_the_structure_of_the_data(kind):
    ids, x = _data(7)
    data = {"tuple": (ids, x), "list": [ids, x], "dict": {"ids": ids, "x": x}, "tensor": ids}
    batch = next(iter(TensorLoader(data[kind], batch_size=3, shuffle=True)))
    if kind == "tensor":
        assert torch.is_tensor(batch) and batch.shape == (3,)
        return
    assert type(batch) is type(data[kind])
    b_ids, b_x = batch.values() if kind == "dict" else batch
    assert torch.equal(b_x, x[b_ids])


def test_sharded_passes_split_each_epoch_like_a_distributed_sampler():
    # two ranks of 5 examples: padded to 6 by repeating the first drawn one
    ranks = [EpochBatches(5, 2, shuffle=True, seed=0, num_replicas=2, rank=r) for r in range(2)]
    for _ in range(2):
        shards = [torch.cat(list(batches)).tolist() for batches in ranks]
        assert len(shards[0]) == len(shards[1]) == 3
        assert set(shards[0] + shards[1]) == set(range(5))
    one = EpochBatches(5, 4, shuffle=True, seed=0)
    one.set_epoch(1)
    ranks[0].set_epoch(1), ranks[1].set_epoch(1)
    (first, _), together = list(one), [next(iter(b)) for b in ranks]
    assert sorted(first.tolist()) == sorted(torch.cat(together).tolist())
    dropping = [EpochBatches(5, 2, num_replicas=2, rank=r, drop_last=True) for r in range(2)]
    assert [torch.cat(list(b)).tolist() for b in dropping] == [[0, 2], [1, 3]]


def test_bad_data_and_settings_are_named():
    ids, x = _data(4)
    with pytest.raises(ValueError, match="same first dimension"):
        TensorLoader((ids, x[:3]))
    with pytest.raises(ValueError, match="one device"):
        TensorLoader((ids, torch.empty(4, device="meta")))
    with pytest.raises(ValueError, match="no example"):
        TensorLoader(torch.empty(0, 2))
    with pytest.raises(TypeError, match=r"data\[1\] must be a tensor"):
        TensorLoader((ids, [1, 2, 3, 4]))
    with pytest.raises(TypeError, match="data must be a tensor"):
        TensorLoader(TensorDataset(ids))
    with pytest.raises(ValueError, match="leaves no batch"):
        TensorLoader(ids, batch_size=5, drop_last=True)
    with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
        TensorLoader(ids, batch_size=0)
    with pytest.raises(ValueError, match="give a seed"):
        TensorLoader(ids, batch_size=2, shuffle=True, shard=True)


def test_shard_in_a_launched_job_without_a_process_group_is_an_error(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="init_process_group"):
        TensorLoader(_data(4), batch_size=2, shard=True)
    TensorLoader(_data(4), batch_size=2)  # unsharded: each process takes all the data


@pytest.mark.parametrize("own_generator", [True, False])
def test_sliced_gives_a_plain_loaders_batches_from_its_random_draws(own_generator):
    ids, x = _data(11)

    def plain():
        generator = torch.Generator().manual_seed(5) if own_generator else None
        return DataLoader(
            TensorDataset(ids, x), batch_size=4, shuffle=True, drop_last=True, generator=generator
        )

    results = []
    for loader in (plain(), sliced(plain())):
        torch.manual_seed(0)
        batches = [batch for _ in range(3) for batch in loader]
        results.append((batches, torch.get_rng_state()))  # the draws after three passes
    (collated, state), (indexed, indexed_state) = results
    assert type(indexed[0]) is list and len(indexed) == len(collated) == 6
    for a, b in zip(collated, indexed):
        assert all(torch.equal(u, v) for u, v in zip(a, b))
    assert torch.equal(state, indexed_state)


def test_sliced_leaves_other_loaders_alone():
    ids, _ = _data(4)

    class Custom(DataLoader):
        pass

    others = [
        Custom(TensorDataset(ids), batch_size=2),
        DataLoader(TensorDataset(ids), batch_size=2, collate_fn=lambda b: b),
        DataLoader(TensorDataset(ids), batch_size=None),
        DataLoader(TensorDataset(ids), batch_size=2, num_workers=1),
        DataLoader(list(ids), batch_size=2),
    ]
    for loader in others:
        assert sliced(loader) is loader
    assert isinstance(SlicedTensors(ids)[[1, 3]], torch.Tensor)


def test_minibatches_advance_a_distributed_samplers_epoch():
    ids, _ = _data(8)
    sampler = DistributedSampler(TensorDataset(ids), num_replicas=2, rank=0, seed=0)
    batches = Minibatches((DataLoader(TensorDataset(ids), batch_size=4, sampler=sampler),), {})
    passes = [batches.next()[0][0][0].tolist() for _ in range(3)]
    assert sampler.epoch == 2 and len({tuple(p) for p in passes}) == 3


# -- every consumer takes a TensorLoader where it takes a DataLoader -------------------

NUM_DATA, BATCH = 24, 8


def _classifier():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(NUM_DATA, 3, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 3, (NUM_DATA,), generator=generator)
    torch.manual_seed(0)
    net = bdl.lift(torch.nn.Linear(3, 3).double(), bdl.priors.IIDNormal(1.0))

    def model(batch, num_data):
        x, y = batch
        logits = net(x)
        bdl.observe("y", dist.Categorical(logits=logits), y, num_data)
        return logits

    return model, (x, y)


def _sgld(model, loader):
    mcmc = MCMC(SGLD(model, step_size=1e-3), num_samples=4, warmup_steps=4, disable_progbar=True)
    mcmc.run(loader, NUM_DATA)
    return mcmc.get_samples()


def _arviz(model, loader):
    samples = {"weight": torch.randn(4, 3, 3, dtype=torch.float64), "bias": torch.zeros(4, 3)}
    tree = bdl.to_arviz(samples, model=model, model_args=(loader, NUM_DATA), log_likelihood=True)
    return torch.as_tensor(tree["log_likelihood"]["y"].values)


def _chains(model, loader):
    kernel = SGHMC(model, step_size=1e-3, adapt_step_size=False, adapt_mass_matrix=False)
    chains = Chains(kernel, num_samples=3, num_chains=2, seed=0, disable_progbar=True)
    chains.run(loader, NUM_DATA)
    return chains.get_samples()


def _laplace(model, loader):
    guide = LaplaceGuide(model).fit(loader, NUM_DATA, num_steps=5, progress=False)
    return {**guide.median(), "probs": guide.predictive(loader, NUM_DATA)}


def _map(model, loader):
    return fit_map(model, loader, NUM_DATA, num_steps=5, progress=False)


def _ivon(model, loader):
    guide = IVONGuide(model)
    fit_ivon(model, guide, loader, NUM_DATA, num_steps=5, progress=False)
    return guide.approximation_parameters()


def _mean_field(model, loader):
    guide = MeanFieldGuide(model)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.05}), TraceMeanField_ELBO())
    batches = Minibatches((loader, NUM_DATA), {})
    for _ in range(5):
        args, kwargs = batches.next()
        svi.step(*args, **kwargs)
    return guide.approximation_parameters()


@pytest.mark.filterwarnings("ignore:.*R-hat", "ignore:.*hess_init")  # few steps: equality only
@pytest.mark.parametrize(
    "consumer",
    [_sgld, _chains, _laplace, _map, _ivon, _mean_field, _arviz],
    ids=lambda f: f.__name__,
)
def test_a_consumer_gives_with_a_tensor_loader_what_it_gives_with_a_dataloader(float64, consumer):
    # In order (no shuffle) both loaders give the same batches, so every result is equal;
    # the DataLoader is a subclass, which Minibatches iterates as PyTorch does, with a
    # generator of its own: one without draws from the global one at every pass.
    class Collated(DataLoader):
        pass

    results = []
    for make in (
        lambda data: TensorLoader(data, batch_size=BATCH),
        lambda data: Collated(TensorDataset(*data), batch_size=BATCH, generator=torch.Generator()),
    ):
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        model, data = _classifier()
        results.append(consumer(model, make(data)))
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)
