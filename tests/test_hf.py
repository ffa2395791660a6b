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
    """A Trainer's posterior after training and the random state it began with.

    :param kind: ``"bert"`` or ``"llama"``, or a peft BERT model.
    """
    pyro.clear_param_store()
    start = cases.RandomState()
    model = cases.MODELS[kind]() if isinstance(kind, str) else kind
    trainer = trainer_class(
        model=model,
        args=cases.arguments(tmp_path, **arguments),
        train_dataset=cases.Examples("bert" if model is kind else kind),
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
    return torch.utils.data.DataLoader(
        data, batch_size=batch_size, collate_fn=default_data_collator
    )


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
    # Both at their defaults: the Trainer's cosine schedule without warm-up is fit_ivon's,
    # and both choose beta2 from the run's length.
    arguments = {"lr_scheduler_type": "cosine", "max_grad_norm": 0.5}
    defaults = {"hess_init": IVON["hess_init"]}
    # four steps cannot forget hess_init: both say so
    with pytest.warns(UserWarning, match="IVONTrainer: after num_steps=4 steps at beta2=0.9,"):
        trained, state = _trained(IVONTrainer, kind, tmp_path, defaults, **arguments)
    lora = LoRAModel.from_peft(cases.MODELS[kind]())
    guide = IVONGuide(lora.model, hess_init=IVON["hess_init"])
    torch.set_rng_state(state)
    with pytest.warns(UserWarning, match="fit_ivon: after num_steps=4"):
        fit_ivon(
            lora.model,
            guide,
            _loader(kind),
            len(cases.Examples(kind)),
            num_steps=STEPS,
            lr=1e-2,
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


def _autocast_run(trainer_class, tmp_path, **arguments):
    """A float32 run's posterior and the dtypes the first LoRA A layer computed in."""
    model = cases.bert(dtype=torch.float32)
    dtypes = set()
    layer = next(m for name, m in model.named_modules() if name.endswith("lora_A.default"))
    layer.register_forward_hook(lambda module, inputs, output: dtypes.add(output.dtype))
    settings = BLOB if trainer_class is BLoBTrainer else IVON
    trained, _ = _trained(trainer_class, model, tmp_path, settings, **arguments)
    return trained, dtypes


@pytest.mark.parametrize("trainer_class", [BLoBTrainer, IVONTrainer])
def test_bf16_autocast_keeps_the_adapters_and_variational_parameters_in_float32(
    trainer_class, tmp_path
):
    reference, _ = _autocast_run(trainer_class, tmp_path / "fp32")
    trained, dtypes = _autocast_run(trainer_class, tmp_path / "bf16", bf16=True)
    assert torch.bfloat16 in dtypes  # accelerate's autocast ran the LoRA layers in bf16
    assert {value.dtype for value in trained.values()} == {torch.float32}
    # bf16 keeps 8 bits of mantissa (relative rounding 2^-8 = 0.4%): the gradients, and so
    # the four steps, are within a few percent of float32's (2% at most measured).
    for key, value in reference.items():
        assert float((trained[key] - value).norm() / value.norm()) < 0.05, key


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fp16 autocast needs a CUDA device")
@pytest.mark.parametrize("trainer_class", [BLoBTrainer, IVONTrainer])
def test_fp16_autocast_with_a_loss_scaler_on_cuda(trainer_class, tmp_path):
    # accelerate's GradScaler scales each microbatch's loss and unscales the method's sums
    # (the optimiser's tensors) before the update; a step that overflowed is skipped.
    reference, _ = _autocast_run(trainer_class, tmp_path / "fp32", use_cpu=False)
    trained, dtypes = _autocast_run(trainer_class, tmp_path / "fp16", use_cpu=False, fp16=True)
    assert torch.float16 in dtypes
    assert {value.dtype for value in trained.values()} == {torch.float32}
    for key, value in reference.items():  # fp16: 11 bits of mantissa, closer than bf16
        assert float((trained[key] - value).norm() / value.norm()) < 0.05, key


def test_bad_settings_are_errors_naming_the_fix(tmp_path):
    from peft import IA3Config, get_peft_model

    data = cases.Examples("bert")
    args = cases.arguments(tmp_path)
    no_lora = cases.bert_base()
    ia3 = get_peft_model(cases.bert_base(), IA3Config(target_modules=["key", "value"]))
    for trainer_class in (BLoBTrainer, IVONTrainer):
        for model in (no_lora, ia3):
            with pytest.raises(ValueError, match=f"{trainer_class.__name__}.*LoRA"):
                trainer_class(model=model, args=args, train_dataset=data)
        # 16 examples in batches of 4 are 4 batches per epoch: 8 microbatches per step can
        # never be gathered, every step would be cut short
        accumulation = cases.arguments(tmp_path, gradient_accumulation_steps=8)
        with pytest.raises(ValueError, match="gradient_accumulation_steps=8"):
            trainer_class(model=cases.bert(), args=accumulation, train_dataset=data)
        with pytest.raises(ValueError, match="optimizers"):
            optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
            trainer_class(model=cases.bert(), args=args, optimizers=(optimizer, None))
        with pytest.raises(ValueError, match="num_samples"):
            trainer_class(model=cases.bert(), args=args, train_dataset=data, num_samples=-1)
    with pytest.raises(ValueError, match="ess must be a positive"):
        IVONTrainer(model=cases.bert(), args=args, train_dataset=data, ess=0)
    # BLoB's B is a point weight: a lora_model with random B is refused, naming the layout
    both_random = LoRAModel.from_peft(cases.bert())
    with pytest.raises(ValueError, match="adapters_random='A'"):
        BLoBTrainer(model=both_random, args=args, train_dataset=data)


@pytest.mark.parametrize("validation", [False, True])
def test_laplace_callback_is_fit_laplace_lora_on_the_trainers_checkpoint(validation, tmp_path):
    # A plain Trainer fine-tunes (AdamW, shuffled batches); at the end the callback runs the
    # one Laplace-LoRA recipe over its training dataloader: K-FAC at the checkpoint, the
    # prior precision by the evidence, and the link on validation data when there is any
    # (else "mc"). fit_laplace_lora from the saved adapter, on batches in another order,
    # gives the same posterior and link (K-FAC's sums differ by rounding only).
    from transformers import Trainer, default_data_collator

    from pyro_bdl.hf import LaplaceCallback
    from pyro_bdl.inference import fit_laplace_lora
    from pyro_bdl.models import lora_model

    val = cases.Examples("bert", size=8, seed=2)
    callback = LaplaceCallback("kron", num_steps=100, val_dataset=val if validation else None)
    trainer = Trainer(
        model=cases.bert(),
        args=cases.arguments(tmp_path, train_sampling_strategy="random", learning_rate=1e-2),
        train_dataset=cases.Examples("bert"),
        callbacks=[callback],
    )
    trainer.train()
    trainer.save_model(str(tmp_path / "finetuned"))
    assert (tmp_path / "posterior" / "manifest.json").is_file()  # bdl.save's, by the callback

    pyro.clear_param_store()
    lora = lora_model(cases.bert_base(), adapter=tmp_path / "finetuned")
    # the callback's validation batches: the Trainer's evaluation size (the MC link's draws
    # are taken batch by batch, so its NLL depends on the batches)
    size = trainer.args.per_device_eval_batch_size
    loader = torch.utils.data.DataLoader(val, batch_size=size, collate_fn=default_data_collator)
    guide, link, scores = fit_laplace_lora(
        lora.model,
        _loader("bert"),
        len(cases.Examples("bert")),
        loader if validation else None,
        num_steps=100,
        links=("mc", "probit", "bridge") if validation else ("mc",),
    )
    expected = guide.approximation_parameters()
    cases.assert_same(callback.guide.approximation_parameters(), expected, **TOLERANCE)
    for site, delta in guide.prior_precision.items():
        torch.testing.assert_close(callback.guide.prior_precision[site], delta, **TOLERANCE)
    assert callback.guide.link == link and (scores is not None) == validation


def test_laplace_callbacks_grid_is_deprecated_and_ignored():
    from pyro_bdl.hf import LaplaceCallback

    with pytest.warns(DeprecationWarning, match="grid=.*evidence"):
        callback = LaplaceCallback("kron", grid=torch.logspace(-2, 2, 5))
    assert not hasattr(callback, "grid")
