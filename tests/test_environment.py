"""The environment that `make test` builds: CPU torch, peft and transformers importable,
and no torchvision (its CUDA build breaks `import transformers` beside a CPU torch)."""

import importlib.util


def test_peft_and_transformers_work_beside_the_installed_torch():
    # Whatever torch the user has: what matters is that peft and transformers import
    # beside it and a LoRA adapter runs forward and backward on it.
    import peft
    import torch
    import transformers

    assert transformers.AutoModel is not None
    module = torch.nn.Sequential(torch.nn.Linear(3, 2))
    lora = peft.get_peft_model(module, peft.LoraConfig(r=1, target_modules=["0"]))
    lora(torch.randn(4, 3)).sum().backward()
    trainable = [name for name, p in lora.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)


def test_torchvision_is_kept_out():
    assert importlib.util.find_spec("torchvision") is None


def test_test_peers_installed_without_torchvision_import():
    import laplace

    assert laplace.Laplace is not None
