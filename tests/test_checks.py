import math

import numpy as np
import pytest
import torch

from pyro_bdl import _checks as checks


@pytest.mark.parametrize("value", [0.1, 1, np.float32(0.5), np.int64(3), torch.tensor(2.0)])
def test_real_accepts_every_scalar_kind(value):
    assert checks.real("step_size", value, positive=True) == pytest.approx(float(value))


@pytest.mark.parametrize(
    ("value", "error", "needle"),
    [
        (-0.1, ValueError, "step_size must be a positive finite number, got -0.1"),
        (0.0, ValueError, "positive"),
        (math.nan, ValueError, "nan"),
        (math.inf, ValueError, "inf"),
        (True, TypeError, "bool"),
        ("0.1", TypeError, "str"),
        (torch.ones(2), TypeError, "shape (2,)"),
        (None, TypeError, "NoneType"),
    ],
)
def test_real_names_the_argument_and_what_it_got(value, error, needle):
    with pytest.raises(error, match="step_size") as info:
        checks.real("step_size", value, positive=True)
    assert needle in str(info.value)


def test_real_bounds_and_infinity():
    assert checks.real("x", math.inf, finite=False, non_negative=True) == math.inf
    assert checks.real("x", 0.0, non_negative=True) == 0.0
    with pytest.raises(ValueError, match=r"x must be a finite number in \[1, 2\], got 3"):
        checks.real("x", 3, low=1, high=2)


def test_integer():
    assert checks.integer("thin", np.int64(4), low=1) == 4
    assert checks.integer("thin", torch.tensor(4), low=1) == 4
    with pytest.raises(TypeError, match="thin must be an int >= 1, got float 2.0"):
        checks.integer("thin", 2.0, low=1)
    with pytest.raises(ValueError, match="thin must be an int >= 1, got 0"):
        checks.integer("thin", 0, low=1)
    with pytest.raises(TypeError, match="bool"):
        checks.integer("thin", True, low=1)


def test_probability_and_choices_and_types():
    assert checks.probability("p", 1.0) == 1.0
    with pytest.raises(ValueError, match=r"p must be a number in \(0, 1\), got 1.0"):
        checks.probability("p", 1.0, open_low=True, open_high=True)
    with pytest.raises(ValueError, match="curvature must be one of 'kron', 'full'; got 'kronn'"):
        checks.one_of("curvature", "kronn", ("kron", "full"))
    with pytest.raises(ValueError, match="one of"):
        checks.one_of("curvature", ["kron"], {"kron"})
    with pytest.raises(TypeError, match="model must be a callable Pyro model, got int 3"):
        checks.function("model", 3, "a callable Pyro model")
    with pytest.raises(TypeError, match="seed must be an int, got the bool True"):
        checks.instance("seed", True, int, "an int")


def test_site_keys_lists_the_unknown_keys_the_closest_sites_and_the_sites():
    checks.site_keys("init_params", {"w": 0, "b": 1}, ["w", "b", "s"])
    with pytest.raises(ValueError) as info:
        checks.site_keys("init_params", ["ww", "zzz"], ["w", "b"])
    assert str(info.value) == (
        "init_params: unknown sites ['ww', 'zzz'] (did you mean 'w' for 'ww'?); the model's "
        "sites are ['w', 'b']"
    )
    sites = [f"layer{i}.weight" for i in range(20)]
    with pytest.raises(ValueError, match=r"'layer7.weight', \.\.\.\] \(20 in all\)"):
        checks.site_keys("fixed(values)", ["layer1.wieght"], sites)
