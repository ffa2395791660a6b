"""The K-FAC curvatures' options answer bad input with a named error."""

import math

import pytest

from pyro_bdl.inference import Kron, KronLowRank

CASES = {
    "Kron": [
        (lambda: Kron(fisher="fisher"), ValueError, "fisher"),
        (lambda: Kron(fisher=None), ValueError, "fisher"),
        (lambda: Kron(num_samples=0), ValueError, "num_samples"),
        (lambda: Kron(num_samples=1.5), TypeError, "num_samples"),
        (lambda: Kron(max_dense=0), ValueError, "max_dense"),
        (lambda: Kron(max_dense=True), TypeError, "max_dense"),
        (lambda: Kron(rank=0), ValueError, "rank"),
        (lambda: Kron(rank="64"), TypeError, "rank"),
    ],
    "KronLowRank": [
        (lambda: KronLowRank(rank=0), ValueError, "rank"),
        (lambda: KronLowRank(rank=2.5), TypeError, "rank"),
        (lambda: KronLowRank(rank=True), TypeError, "rank"),
        (lambda: KronLowRank(rank=math.nan), TypeError, "rank"),
        (lambda: KronLowRank(fisher="gn"), ValueError, "fisher"),
        (lambda: KronLowRank(num_samples=-1), ValueError, "num_samples"),
    ],
}


@pytest.mark.parametrize(
    "entry, call, error, argument",
    [(entry, *case) for entry, cases in CASES.items() for case in cases],
)
def test_bad_option_is_a_named_error(entry, call, error, argument):
    with pytest.raises(error) as raised:
        call()
    assert argument in str(raised.value), f"{entry}: {raised.value}"
