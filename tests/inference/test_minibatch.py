import pyro
import pyro.distributions as dist
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from pyro_bdl.inference import Minibatches
from pyro_bdl.inference.minibatch import DataPass


def _loader(n=5, batch_size=2):
    return DataLoader(TensorDataset(torch.arange(n)), batch_size=batch_size)


def test_loaders_become_batches_and_cycle_through_epochs():
    batches = Minibatches((_loader(), 7), {"other": _loader(4, 3), "flag": True})
    seen = []
    for _ in range(4):
        args, kwargs = batches.next()
        assert args[1] == 7 and kwargs["flag"] is True
        seen.append((args[0][0].tolist(), kwargs["other"][0].tolist()))
    assert seen == [([0, 1], [0, 1, 2]), ([2, 3], [3]), ([4], [0, 1, 2]), ([0, 1], [3])]
    assert batches.epoch == 2


def test_peek_returns_the_next_batch_without_consuming_it():
    batches = Minibatches((_loader(),), {})
    first = batches.peek()[0][0][0]
    assert torch.equal(batches.next()[0][0][0], first)
    assert torch.equal(batches.next()[0][0][0], torch.tensor([2, 3]))


def test_one_pass_walks_one_epoch_in_lockstep():
    batches = Minibatches((_loader(5, 2), _loader(6, 2)), {})
    passes = [(a[0][0].tolist(), a[1][0].tolist()) for a, _ in batches.one_pass()]
    assert passes == [([0, 1], [0, 1]), ([2, 3], [2, 3]), ([4], [4, 5])]
    assert batches.batches_per_epoch == 3
    plain = Minibatches((torch.ones(2),), {})
    assert len(list(plain.one_pass())) == 1 and not plain.has_loaders


def test_an_empty_loader_is_named():
    with pytest.raises(ValueError, match="argument 0 yields no batches"):
        Minibatches((_loader(0),), {})


def test_a_pass_enumerates_the_indices_of_the_models_own_subsample_plate():
    # pyro.plate("data", 23, subsample_size=5) draws 5 random indices per call; a pass
    # runs the model on 0..4, 5..9, ..., and on 18..22 for the last 3, with the 2 already
    # seen masked, so that every example counts once and the plate keeps its scale 23 / 5.
    data = torch.arange(23.0)

    def model():
        with pyro.plate("data", len(data), subsample_size=5) as ind:
            pyro.sample("obs", dist.Normal(0.0, 1.0), obs=data[ind])

    runs = DataPass(model, (), {})
    assert runs.plate.name == "data" and runs.runs == 5
    counted = torch.zeros(23)
    for args, kwargs, context in runs:
        with context:
            trace = pyro.poutine.trace(model).get_trace(*args, **kwargs)
        site = trace.nodes["obs"]
        assert site["scale"] == 23 / 5
        mask = torch.ones(5, dtype=torch.bool) if site["mask"] is None else site["mask"]
        counted.index_add_(0, site["value"].long(), mask.to(counted.dtype))
    assert torch.equal(counted, torch.ones(23))


def test_a_pass_over_dataloaders_or_full_data_needs_no_plate():
    def model(batch):
        with pyro.plate("data", 5, subsample_size=len(batch)):  # svi_torch.py's scaling
            pyro.sample("obs", dist.Normal(0.0, 1.0), obs=batch[0].double())

    loader_pass = DataPass(model, (_loader(5, 2),), {})
    assert loader_pass.plate is None and loader_pass.runs == 3
    whole = DataPass(lambda: pyro.sample("x", dist.Normal(0.0, 1.0), obs=torch.tensor(1.0)), (), {})
    assert whole.plate is None and len(list(whole)) == 1

    def two_plates():
        with pyro.plate("a", 10, subsample_size=2), pyro.plate("b", 10, subsample_size=2, dim=-2):
            pyro.sample("obs", dist.Normal(0.0, 1.0), obs=torch.zeros(2, 2))

    with pytest.raises(ValueError, match="more than one plate \\['a', 'b'\\]"):
        DataPass(two_plates, (), {})
