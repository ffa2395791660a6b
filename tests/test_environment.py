"""The environment that `make test` builds: CPU torch, peft and transformers importable,
and no torchvision (its CUDA build breaks `import transformers` beside a CPU torch)."""

import importlib.util


def test_peft_and_transformers_import_beside_cpu_torch():
    import peft
    import torch
    import transformers

    assert torch.__version__.startswith("2.13.0")
    assert peft.PeftModel is not None and transformers.AutoModel is not None


def test_torchvision_is_kept_out():
    assert importlib.util.find_spec("torchvision") is None


def test_test_peers_installed_without_torchvision_import():
    import laplace

    assert laplace.Laplace is not None
