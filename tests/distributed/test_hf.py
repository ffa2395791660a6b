"""The Trainer integration over W = 2 real processes (gloo), as ``torchrun`` starts them: a
BLoBTrainer, an IVONTrainer and a Trainer with a LaplaceCallback, each process with half
the batch, end where one process with the whole batch ends."""

import importlib.util
import os
from pathlib import Path

import pyro
import pytest
import torch
from safetensors.torch import load_file, save_file

from .launch import run_ranks

_spec = importlib.util.spec_from_file_location(
    "hf_cases", Path(__file__).resolve().parents[1] / "hf_cases.py"
)
cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cases)

BATCH = 4  # the global batch: 2 per process with W = 2
TOLERANCE = {"rtol": 1e-6, "atol": 1e-9}


def _trained(method: str, per_device: int, out: Path) -> dict[str, torch.Tensor]:
    """The posterior of one method's run: 4 steps of sequential batches of 4 examples."""
    from accelerate.state import AcceleratorState
    from transformers import Trainer

    from pyro_bdl.hf import BLoBTrainer, IVONTrainer, LaplaceCallback

    # A forked process inherits the parent's accelerate state (one process); start afresh.
    AcceleratorState._reset_state(reset_partial_state=True)
    pyro.clear_param_store()
    args = cases.arguments(out / method, per_device_train_batch_size=per_device, max_grad_norm=1.0)
    data = cases.Examples("bert")
    if method == "laplace":
        # The fit at adapters as a fine-tune leaves them (B not zero), which the Trainer's
        # steps at lr 0 keep: the plain Trainer's own data-parallel AdamW is not under test.
        model = cases.bert()
        generator = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.copy_(0.1 * torch.randn(param.shape, generator=generator))
        args = cases.arguments(
            out / method, per_device_train_batch_size=per_device, learning_rate=0.0
        )
        laplace = LaplaceCallback("kron", num_steps=20)
        Trainer(model=model, args=args, train_dataset=data, callbacks=[laplace]).train()
        return laplace.guide.approximation_parameters()
    # BLoB's flipout signs are drawn per example on each process: off, so that draws match
    trainer_class, settings = {
        "blob": (BLoBTrainer, {"kl_weighting": "uniform", "kl_lr": 0.01, "flipout": False}),
        "ivon": (IVONTrainer, {"hess_init": 0.5, "beta2": 0.99}),
    }[method]
    trainer = trainer_class(model=cases.bert(), args=args, train_dataset=data, **settings)
    trainer.train()
    return cases.posterior(trainer.guide)


def _all(per_device: int, out: Path) -> dict[str, torch.Tensor]:
    results = {}
    for method in ("blob", "ivon", "laplace"):
        for key, value in _trained(method, per_device, out).items():
            results[f"{method}.{key}"] = value.detach().contiguous()
    return results


def _rank(rank, out):
    save_file(_all(BATCH // 2, Path(out) / f"rank{rank}"), os.path.join(out, f"rank{rank}.st"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("trainers")
    # Spawned: a Trainer in a child forked from a parent whose OpenMP pool has run (any
    # earlier test that computed with two threads) hangs in its first steps.
    run_ranks(_rank, str(out), start_method="spawn")
    ranks = [load_file(out / f"rank{r}.st") for r in range(2)]
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    return ranks, _all(BATCH, out / "one")


@pytest.mark.parametrize("method", ["blob", "ivon", "laplace"])
def test_two_processes_with_half_the_batch_equal_one_with_all_of_it(runs, method):
    ranks, single = runs
    keys = [key for key in single if key.startswith(f"{method}.")]
    assert keys
    for key in keys:
        for rank in ranks:  # every process holds the same posterior
            torch.testing.assert_close(rank[key], single[key], **TOLERANCE, msg=key)
