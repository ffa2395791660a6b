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
    with pytest.warns(DeprecationWarning, match=RENAMED[old].replace(".", r"\.")) as caught:
        __import__(old)  # as an import statement does
    # The warning points at the importer (here, this file), not at the alias or importlib.
    assert caught[0].filename == __file__
    alias = sys.modules[old]
    assert alias is new
    for name in new.__all__:
        assert getattr(alias, name) is getattr(new, name)
