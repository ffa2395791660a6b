"""KL re-weighting of BLoB (Appendix B.1): exponential within a cycle, stable for any cycle."""

import math

import pytest

from pyro_bdl.inference import blob_kl_cycle, exponential_kl_weight, uniform_kl_weight


def test_cycle_is_the_rescaled_dataset_size_over_the_batch_size():
    # WG-S (640 examples), batch 32: L* = 100 * 640^(pi/8) = 1264.7..., L*/B = 39.5...
    assert blob_kl_cycle(640, 32) == 39
    # gamma = pi makes L* = 100 L0: the cycle is 100 epochs.
    assert blob_kl_cycle(50, 10, gamma=math.pi) == 500
    assert blob_kl_cycle(1, 10_000) == 1


def test_weights_double_within_a_cycle_sum_to_about_one_and_repeat():
    cycle = 6
    weights = [exponential_kl_weight(step, cycle) for step in range(2 * cycle)]
    assert weights[:cycle] == pytest.approx([2**i / (2 ** (cycle + 1) - 1) for i in range(1, 7)])
    assert weights[cycle:] == weights[:cycle]
    # sum_{i=1}^{M} 2^i / (2^(M+1) - 1) = (2^(M+1) - 2) / (2^(M+1) - 1)
    assert sum(weights[:cycle]) == pytest.approx((2**7 - 2) / (2**7 - 1))


def test_weights_are_stable_for_long_cycles():
    cycle = 5000  # 2^5001 is far beyond a double
    weights = [exponential_kl_weight(step, cycle) for step in range(cycle)]
    assert all(math.isfinite(w) and w >= 0 for w in weights)
    assert weights[0] == 0.0  # 2^-5000 underflows
    assert weights[-1] == pytest.approx(0.5)
    assert weights[-2] == pytest.approx(0.25)
    assert math.fsum(weights) == pytest.approx(1.0)


def test_uniform_weights_are_one_over_the_cycle():
    assert [uniform_kl_weight(step, 8) for step in range(3)] == [0.125] * 3


@pytest.mark.parametrize(
    "bad, error", [(0, ValueError), (-3, ValueError), (2.5, TypeError), (True, TypeError)]
)
def test_bad_cycle_lengths_and_sizes_are_errors(bad, error):
    with pytest.raises(error, match="cycle"):
        exponential_kl_weight(0, bad)
    with pytest.raises(error, match="batch_size"):
        blob_kl_cycle(100, bad)
