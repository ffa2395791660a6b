"""Renamed public modules keep their old import path for one release, with a warning that
names the new one; the old path gives the new module itself, so every name is the same."""

import importlib
import sys

import pytest

RENAMED = {
    "pyro_bdl.inference.laplace.state": "pyro_bdl.inference.laplace.serialization",
    "pyro_bdl.inference.laplace.lora": "pyro_bdl.inference.laplace.laplace_lora",
    "pyro_bdl.inference.laplace.prior": "pyro_bdl.inference.laplace.laplace_prior",
}


@pytest.mark.parametrize("old", list(RENAMED))
def test_an_old_module_path_warns_and_is_the_new_module(old):
    new = importlib.import_module(RENAMED[old])
    sys.modules.pop(old, None)  # imported afresh: the warning comes at the import
    with pytest.warns(DeprecationWarning, match=RENAMED[old].replace(".", r"\.")):
        alias = importlib.import_module(old)
    assert alias is new
    for name in new.__all__:
        assert getattr(alias, name) is getattr(new, name)


def test_the_draw_helpers_keep_their_former_private_path():
    from pyro_bdl import _draws, _offload

    assert _draws.kept_draws is _offload.kept_draws and _draws.draw_at is _offload.draw_at
