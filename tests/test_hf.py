"""BLoBTrainer, IVONTrainer and LaplaceCallback inside Hugging Face's Trainer.

The Trainer's runs are compared with the library's own loops (``fit_blob``, ``fit_ivon``,
``LaplaceGuide.fit``) on tiny float64 BERT and Llama LoRA models: the same seed and the
same batches give the same steps, so they agree to rounding (1e-6, the issue's tolerance,
is far above float64 rounding over a few steps and far below what a wrong step changes).
"""

import importlib.util
from pathlib import Path

import pyro
import pytest
import torch

from pyro_bdl.hf import BLoBTrainer, IVONTrainer
from pyro_bdl.inference import BLoBGuide, IVONGuide, fit_blob, fit_ivon
from pyro_bdl.models import LoRAModel

_spec = importlib.util.spec_from_file_location(
    "hf_cases", Path(__file__).resolve().parent / "hf_cases.py"
)
cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cases)

TOLERANCE = {"rtol": 1e-6, "atol": 1e-9}
STEPS, BATCH = 4, 4
BLOB = {"eps": 0.1, "kl_lr": 0.01}
IVON = {"hess_init": 0.5, "beta2": 0.99}


def _trained(trainer_class, kind, tmp_path, settings, **arguments):
    """A Trainer's posterior after training, the random state it began with, its model."""
    pyro.clear_param_store()
    start = cases.RandomState()
    trainer = trainer_class(
        model=cases.MODELS[kind](),
        args=cases.arguments(tmp_path, **arguments),
        train_dataset=cases.Examples(kind),
        callbacks=[start],
        **settings,
    )
    trainer.train()
    result = cases.posterior(trainer.guide)
    pyro.clear_param_store()
    return result, start.state


def _loader(kind, batch_size=BATCH):
    from transformers import default_data_collator

    data = cases.Examples(kind)
    return torch.utils.data.DataLoader(data, batch_size=batch_size, collate_fn=default_data_collator)


@pytest.mark.parametrize("kind", ["bert", "llama"])
def test_blob_trainer_steps_are_fit_blobs(kind, tmp_path):
    # A warm-up of one step of four, then linear decay: the Trainer's "linear" schedule is
    # fit_blob's (warmup_ratio 0.25); clipping and weight decay on both sides.
    arguments = {"warmup_steps": 1, "max_grad_norm": 0.5, "weight_decay": 0.01}
    trained, state = _trained(BLoBTrainer, kind, tmp_path, BLOB, **arguments)
    lora = LoRAModel.from_peft(
        cases.MODELS[kind](), adapters_random="A", head="point" if kind == "bert" else "frozen"
    )
    guide = BLoBGuide(lora.model, lora.net, eps=BLOB["eps"])
    torch.set_rng_state(state)
    fit_blob(
        lora.model,
        guide,
        _loader(kind),
        len(cases.Examples(kind)),
        num_steps=STEPS,
        lr=1e-2,
        kl_lr=BLOB["kl_lr"],
        weight_decay=0.01,
        warmup_ratio=0.25,
        max_grad_norm=0.5,
        progress=False,
    )
    cases.assert_same(cases.posterior(guide), trained, **TOLERANCE)


@pytest.mark.parametrize("kind", ["bert", "llama"])
def test_ivon_trainer_steps_are_fit_ivons(kind, tmp_path):
    arguments = {"lr_scheduler_type": "constant", "max_grad_norm": 0.5}
    trained, state = _trained(IVONTrainer, kind, tmp_path, IVON, **arguments)
    lora = LoRAModel.from_peft(cases.MODELS[kind]())
    guide = IVONGuide(lora.model, hess_init=IVON["hess_init"])
    torch.set_rng_state(state)
    fit_ivon(
        lora.model,
        guide,
        _loader(kind),
        len(cases.Examples(kind)),
        num_steps=STEPS,
        lr=1e-2,
        beta2=IVON["beta2"],
        max_grad_norm=0.5,
        progress=False,
    )
    cases.assert_same(cases.posterior(guide), trained, **TOLERANCE)
