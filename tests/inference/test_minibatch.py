import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from pyro_bdl.inference import Minibatches


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
