import gc
import weakref

import pyro
import pyro.distributions as dist
import pytest
import torch

import pyro_bdl as bdl
from pyro_bdl._offload import copied_to, kept_draws


def test_copied_to_copies_every_site_grouped_by_dtype():
    values = {
        "a": torch.arange(6.0, dtype=torch.float64).reshape(2, 3),
        "n": torch.tensor([1, 2, 3]),
        "b": torch.tensor(7.0, dtype=torch.float64),
    }
    copies = copied_to(values, torch.device("cpu"))
    assert list(copies) == ["a", "n", "b"]  # the caller's order
    for name, value in values.items():
        assert copies[name].dtype == value.dtype and copies[name].shape == value.shape
        torch.testing.assert_close(copies[name], value, rtol=0, atol=0)
        assert copies[name].data_ptr() != value.data_ptr()  # a copy, even on the same device
    # one flat buffer per dtype: the float64 sites share storage, the integer one not
    assert copies["a"].untyped_storage().data_ptr() == copies["b"].untyped_storage().data_ptr()
    assert copies["n"].untyped_storage().data_ptr() != copies["a"].untyped_storage().data_ptr()


class _TrackedDraws:
    """Makes draws and fails if a draw made earlier is still alive when the next is made."""

    def __init__(self):
        self.made: list[weakref.ref] = []

    def check_previous_freed(self):
        gc.collect()
        alive = sum(ref() is not None for ref in self.made)
        assert alive == 0, f"{alive} earlier draws are still held on the device"

    def __call__(self):
        self.check_previous_freed()
        value = torch.randn(5, 2)
        self.made.append(weakref.ref(value))
        return {"w": value}


def test_kept_draws_stacks_copies_and_holds_one_draw_at_a_time():
    torch.manual_seed(0)
    draws = kept_draws(_TrackedDraws(), num_samples=4)
    torch.manual_seed(0)
    expected = torch.stack([torch.randn(5, 2) for _ in range(4)])
    assert draws["w"].device.type == "cpu"
    torch.testing.assert_close(draws["w"], expected, rtol=0, atol=0)


def test_to_arviz_of_a_guide_holds_one_draw_at_a_time():
    # Before: Predictive kept every draw where the guide made it (a GPU for a large model)
    # and stacked them there; now each draw is copied off before the next is made.
    tracked = _TrackedDraws()

    class Guide:
        prototype_trace = None

        def __call__(self, x):
            tracked.check_previous_freed()
            value = pyro.sample("w", dist.Normal(torch.zeros(3), 1.0).to_event(1))
            tracked.made.append(weakref.ref(value))
            return {"w": value}

        def approximation_parameters(self):
            return {"loc.w": torch.zeros(3)}

        def hyperparameters(self):
            return {}

    tree = bdl.to_arviz(Guide(), num_samples=5, model_args=(torch.zeros(2),))
    assert tree["posterior"]["w"].shape == (1, 5, 3)
    assert len(tracked.made) == 5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kept_draws_of_cuda_tensors_live_on_the_cpu_and_do_not_grow_device_memory():
    one_draw = 2**20  # floats: 4 MiB per draw

    def draw():
        return {"w": torch.randn(one_draw, device="cuda"), "n": torch.ones(3, device="cuda")}

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    draws = kept_draws(draw, num_samples=50)
    torch.cuda.synchronize()
    assert all(value.device.type == "cpu" for value in draws.values())
    assert draws["w"].shape == (50, one_draw)
    # a draw and its flat copy at most, not 50 draws
    assert torch.cuda.max_memory_allocated() - before < 3 * 4 * one_draw
