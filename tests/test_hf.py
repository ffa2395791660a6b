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
# Uniform KL weights (1 / batches per epoch): over four steps BLoB's exponential weights of
# a cycle of 25 or more steps are all below 1e-7, and the KL would not count.
BLOB = {"eps": 0.1, "kl_lr": 0.01, "kl_weighting": "uniform"}
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
        kl_weighting="uniform",
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


@pytest.mark.parametrize("microbatch, accumulation", [(2, 2), (1, 4)])
@pytest.mark.parametrize("kind", ["bert", "llama"])
@pytest.mark.parametrize("trainer_class", [BLoBTrainer, IVONTrainer])
def test_accumulated_microbatches_take_the_step_of_one_batch(
    trainer_class, kind, microbatch, accumulation, tmp_path
):
    # k microbatches of B share the step's weight noise; their gradients (and IVON's
    # Hessian estimate) are averaged and BLoB's KL weight is the k B batch's. Flipout's
    # signs are drawn per example, microbatch by microbatch: off, so that the draws match.
    settings = {**BLOB, "flipout": False} if trainer_class is BLoBTrainer else IVON
    one, _ = _trained(trainer_class, kind, tmp_path / "one", settings)
    accumulated, _ = _trained(
        trainer_class,
        kind,
        tmp_path / "accumulated",
        settings,
        per_device_train_batch_size=microbatch,
        gradient_accumulation_steps=accumulation,
    )
    cases.assert_same(accumulated, one, **TOLERANCE)


@pytest.mark.parametrize("trainer_class", [BLoBTrainer, IVONTrainer])
def test_a_checkpoint_resumes_to_the_uninterrupted_run(trainer_class, tmp_path):
    # Shuffled batches and flipout, a checkpoint after step 3 of 4 per epoch, 6 steps: the
    # resumed run restores the posterior, the method's state and the Trainer's (batches
    # skipped, random state) and ends where the uninterrupted run ends.
    settings = BLOB if trainer_class is BLoBTrainer else IVON
    arguments = {
        "max_steps": 6,
        "train_sampling_strategy": "random",
        "save_strategy": "steps",
        "save_steps": 3,
        "max_grad_norm": 1.0,
    }
    uninterrupted, _ = _trained(trainer_class, "bert", tmp_path / "run", settings, **arguments)
    checkpoint = tmp_path / "run" / "checkpoint-3"
    assert (checkpoint / "posterior" / "manifest.json").is_file()
    trainer = trainer_class(
        model=cases.bert(),
        args=cases.arguments(tmp_path / "resumed", **arguments),
        train_dataset=cases.Examples("bert"),
        **settings,
    )
    trainer.train(resume_from_checkpoint=str(checkpoint))
    cases.assert_same(cases.posterior(trainer.guide), uninterrupted, **TOLERANCE)
