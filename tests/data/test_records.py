import doctest

import pytest

import pyro_bdl.data.loader
import pyro_bdl.data.prompts
import pyro_bdl.data.records
import pyro_bdl.data.vocabulary
from pyro_bdl.data import RecordDataset, make_loader


def _labels(records):
    return [record["label"] for record in records]


@pytest.mark.parametrize(
    "module",
    [pyro_bdl.data.loader, pyro_bdl.data.prompts, pyro_bdl.data.records, pyro_bdl.data.vocabulary],
)
def test_docstring_examples_run(module):
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


def test_record_dataset_is_list_like():
    data = RecordDataset([{"label": i} for i in range(5)])
    assert len(data) == 5
    assert data[-1] == {"label": 4}
    assert _labels(data) == [0, 1, 2, 3, 4]
    assert repr(data) == "RecordDataset(5 records)"


def test_subset_is_seeded_and_keeps_file_order():
    data = RecordDataset([{"label": i} for i in range(100)])
    subset = _labels(data.subset(10, seed=1))
    assert subset == sorted(subset) and len(set(subset)) == 10
    assert _labels(data.subset(10, seed=1)) == subset
    assert _labels(data.subset(10, seed=2)) != subset
    assert len(data.subset(1000)) == 100
    with pytest.raises(ValueError, match=r"n must be an int >= 1, got 0"):
        data.subset(0)


def test_make_loader_order_is_reproducible():
    data = RecordDataset([{"label": i} for i in range(20)])

    def epochs(seed):
        loader = make_loader(data, _labels, batch_size=6, shuffle=True, seed=seed)
        return [list(loader) for _ in range(2)]

    first, second = epochs(0)
    assert epochs(0) == [first, second]
    assert first != second  # a new order every epoch
    assert epochs(1)[0] != first
    assert sorted(x for batch in first for x in batch) == list(range(20))
    assert [len(batch) for batch in first] == [6, 6, 6, 2]
    kept = make_loader(data, _labels, batch_size=6, drop_last=True)
    assert list(kept) == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17]]
    with pytest.raises(ValueError, match=r"batch_size must be an int >= 1, got 0"):
        make_loader(data, _labels, batch_size=0)
