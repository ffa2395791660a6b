r"""Bayesian LoRA in the training loop LLM users already run: Hugging Face's ``Trainer``.

A LoRA fine-tuning script with ``transformers.Trainer`` becomes a Bayesian one by
changing one line:

- :class:`BLoBTrainer` trains BLoB (Wang et al., 2024) and :class:`IVONTrainer` IVON
  (Shen et al., 2024) in place of AdamW on the adapters. Both take the Trainer's
  arguments (a peft model or a :func:`~pyro_bdl.models.lora_model`, ``TrainingArguments``,
  datasets, collator) and the method's settings, and take the steps of
  :class:`~pyro_bdl.inference.BLoBSVI` and :class:`~pyro_bdl.inference.IVONSVI`, the
  implementation :func:`~pyro_bdl.inference.fit_blob` and
  :func:`~pyro_bdl.inference.fit_ivon` run, with the Trainer's learning rate and schedule,
  gradient accumulation (:meth:`~pyro_bdl.inference.BLoBSVI.accumulate` per microbatch),
  mixed precision (accelerate's autocast; the adapters and variational parameters stay
  float32), gradient clipping (``max_grad_norm``, on the means), checkpoints that resume
  step for step, and data parallelism over the processes that ``torchrun`` or
  ``accelerate launch`` start. Evaluation predicts with the Bayesian model average;
  ``trainer.guide`` is the posterior, which :func:`pyro_bdl.save` writes (the Trainer's
  ``save_model`` writes it to ``<output_dir>/posterior``, beside the adapter of its mean).
- :class:`LaplaceCallback` fits Laplace-LoRA (Yang et al., 2024) at the end of a plain
  Trainer's run, over its training data, and saves it beside the Trainer's output.

Example::

    trainer = Trainer(model=peft_model, args=args, train_dataset=train, data_collator=collate)
    trainer = BLoBTrainer(model=peft_model, args=args, train_dataset=train, data_collator=collate)
    trainer = IVONTrainer(model=peft_model, args=args, train_dataset=train, data_collator=collate)
    trainer = Trainer(model=peft_model, args=args, train_dataset=train, data_collator=collate,
                      callbacks=[LaplaceCallback("kron")])
    trainer.train()

**References**

[1] Y. Wang et al., "BLoB: Bayesian Low-Rank Adaptation by Backpropagation for Large
Language Models", NeurIPS 2024.
[2] Y. Shen et al., "Variational Learning is Effective for Large Deep Networks", ICML 2024.
[3] A. X. Yang et al., "Bayesian low-rank adaptation for large language models", ICLR 2024.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainerCallback

from pyro_bdl import _checks, persistence
from pyro_bdl.inference.laplace import LaplaceGuide, fit_laplace_lora
from pyro_bdl.inference.laplace.curvature import make_curvature
from pyro_bdl.inference.laplace.predictive import LINKS
from pyro_bdl.inference.vi import IVONSVI, BLoBGuide, BLoBSVI, IVONGuide
from pyro_bdl.inference.vi.ivon_svi import BETA2_MAX, _default_beta2, _warn_if_hess_init_remains
from pyro_bdl.models.heads import IGNORE_INDEX, NextToken
from pyro_bdl.models.lora import LoRAModel
from pyro_bdl.predict import predict_proba
from pyro_bdl.priors import IIDNormal

__all__ = ["BLoBTrainer", "IVONTrainer", "LaplaceCallback", "POSTERIOR"]

#: The directory, inside the Trainer's output (and each checkpoint), of the posterior.
POSTERIOR = "posterior"

# Trainer arguments that would replace what these trainers are made of.
_REPLACED = {
    "model_init": "a model made afresh per run would not be the model the guide is over",
    "optimizers": "the method's update is the optimiser",
    "optimizer_cls_and_kwargs": "the method's update is the optimiser",
    "compute_loss_func": "the loss is the method's (the model's likelihood)",
}


class _VariationalTrainer(Trainer):
    """What :class:`BLoBTrainer` and :class:`IVONTrainer` share: the Pyro model of the
    peft model, the method's steps as the Trainer's, the Bayesian model average, the
    posterior in checkpoints. A subclass makes its guide and its training step."""

    #: how the subclass lifts a peft model: :meth:`LoRAModel.from_peft`'s arguments
    _layout: dict = {}

    def __init__(
        self,
        model: Any = None,
        args: Any = None,
        *trainer_args,
        prior_std: float | None = None,
        num_samples: int = 10,
        num_data: int | None = None,
        **trainer_kwargs,
    ):
        name = type(self).__name__
        for key, reason in _REPLACED.items():
            if trainer_kwargs.get(key) not in (None, (None, None)):
                raise ValueError(f"{name}: {key} cannot be given ({reason})")
        self.lora = _lora_model(name, model, self._layout, prior_std)
        self.num_samples = _checks.integer("num_samples", num_samples, low=0)
        self._num_data = None if num_data is None else _checks.integer("num_data", num_data, low=1)
        super().__init__(self.lora.peft_model, args, *trainer_args, **trainer_kwargs)
        if self.args.deepspeed or self.args.fsdp:
            raise ValueError(
                f"{name}: DeepSpeed and FSDP are not supported; the adapters' posterior is "
                "replicated on every process and data parallelism runs through DDP "
                "(torchrun or accelerate launch without a DeepSpeed or FSDP config)"
            )
        _check_accumulation(name, self.args, self.train_dataset)
        self.guide = self._make_guide()
        self.svi: BLoBSVI | IVONSVI | None = None
        self._resumed: dict | None = None  # the training state of a checkpoint
        self._saving_checkpoint = False

    # -- what a subclass provides ---------------------------------------------------------

    def _make_guide(self):
        raise NotImplementedError

    def _make_svi(self, backward: Callable) -> BLoBSVI | IVONSVI:
        raise NotImplementedError

    def _learning_rates(self) -> dict[str, float]:
        """The learning rates the Trainer's scheduler drives, by :meth:`update`'s names."""
        return {"lr": self.args.learning_rate}

    # -- training ---------------------------------------------------------------------------

    @property
    def num_data(self) -> int:
        """:math:`N`, the size of the training set (the likelihood's scale)."""
        if self._num_data is None:
            if self.train_dataset is None or not hasattr(self.train_dataset, "__len__"):
                raise ValueError(
                    f"{type(self).__name__}: the training set has no length; pass num_data=N, "
                    "the number of training examples"
                )
            self._num_data = len(self.train_dataset)
        return self._num_data

    def create_optimizer(self, model=None) -> torch.optim.Optimizer:
        """The method's step as the Trainer's optimiser (see :class:`_MethodStep`)."""
        if self.optimizer is None:
            self.svi = self._make_svi(self.accelerator.backward)
            if self._resumed is not None:
                self.svi.load_state_dict(self._resumed)
            self.optimizer = _MethodStep(self.svi, self._learning_rates())
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        """The Trainer's scheduler; the run's length is also the method's."""
        if isinstance(self.svi, BLoBSVI):
            self.svi.num_steps = num_training_steps
        return super().create_scheduler(num_training_steps, optimizer)

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        """Accumulate one microbatch into the method's step; the optimiser's step updates.

        :return: the microbatch's mean NLL over the accumulation steps (the Trainer sums
            them into the logged training loss).
        """
        model.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager(), self.accelerator.autocast():
            loss = self.svi.accumulate(inputs, self.num_data)
        self.optimizer_step.adopt()
        if self.accelerator.sync_gradients:  # the last microbatch: average, as DDP would
            self.svi.reduce_gradients()
        steps = getattr(self, "current_gradient_accumulation_steps", None)
        return loss.detach() / (steps or self.args.gradient_accumulation_steps)

    @property
    def optimizer_step(self) -> _MethodStep:
        """The method's step (the optimiser inside accelerate's wrapper)."""
        optimizer = self.optimizer
        while not isinstance(optimizer, _MethodStep):
            optimizer = optimizer.optimizer
        return optimizer

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        """The Trainer's log, with the method's statistics of the last step (the means'
        gradient norm before the clip, BLoB's KL and its weight)."""
        record = self.optimizer_step.record if self.optimizer is not None else {}
        if "loss" in logs and record:
            # the Trainer's own grad_norm is of the peft model's parameters, which the
            # method does not train (it substitutes its tensors): 0, so left out
            logs.pop("grad_norm", None)
            for key, value in record.items():
                if key not in ("loss", "nll"):
                    logs[key] = float(value)
        super().log(logs, *args, **kwargs)

    # -- evaluation: the Bayesian model average ---------------------------------------------

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """The Bayesian model average of ``num_samples`` weight draws (the means for 0).

        :return: the NLL of the labels under the average, its log probabilities (as the
            "logits", so that a softmax or argmax of them is the average's) and the labels.
        """
        inputs = self._prepare_inputs(inputs)
        labels = inputs.get("labels")
        with torch.no_grad(), self.accelerator.autocast():
            probs = self.predict_proba(inputs)
        loss = None if labels is None else _nll(probs, labels, self.lora.model.head)
        if prediction_loss_only:
            return loss, None, None
        return loss, probs.clamp_min(torch.finfo(probs.dtype).tiny).log(), labels

    @torch.no_grad()
    def predict_proba(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The Bayesian model average's class probabilities for one batch.

        :param dict batch: a batch of the collator (labels are not needed).
        :return: probabilities ``(B, C)`` (``(B, L, V)`` for a causal LM).
        """
        model = self.lora.model  # num_data None: the likelihood's scale plays no part here
        if self.num_samples == 0:
            means = {name: value.unsqueeze(0) for name, value in self.guide.median().items()}
            return predict_proba(model, batch, None, samples=means)[0]
        total = 0.0
        for _ in range(self.num_samples):  # one draw at a time: no (S, B, L, V) tensor
            total = total + self.guide.predict_proba(batch, None, num_samples=1)[0]
        return total / self.num_samples

    # -- checkpoints --------------------------------------------------------------------------

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        # The adapter the Trainer writes holds the posterior mean; the posterior itself (with
        # the training state in a checkpoint) goes to <output_dir>/posterior.
        if not self.args.should_save or self.guide.prototype_trace is None:
            super()._save(output_dir, state_dict)
            return
        output_dir = self.args.output_dir if output_dir is None else output_dir
        with self.lora.net.fixed(self.guide.median()):
            super()._save(output_dir, state_dict)
        training = self._saving_checkpoint and self.svi is not None
        persistence.save(self.svi if training else self.guide, Path(output_dir) / POSTERIOR)

    def _save_checkpoint(self, model, trial) -> None:
        self._saving_checkpoint = True
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._saving_checkpoint = False

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        directory = Path(resume_from_checkpoint) / POSTERIOR
        if not directory.is_dir():
            raise ValueError(
                f"{type(self).__name__}: {resume_from_checkpoint} holds no {POSTERIOR}/ "
                "directory; resume from a checkpoint this trainer class wrote"
            )
        self._release_guide()
        loaded = persistence.load(directory, self.lora.model)
        if not isinstance(loaded, (BLoBSVI, IVONSVI)):
            raise ValueError(f"{directory} holds a posterior without its training state")
        self.guide, self._resumed = loaded.guide, loaded.state_dict()

    def _release_guide(self) -> None:
        """Let go of the guide a checkpoint replaces (BLoB takes its flipout hooks off)."""


class BLoBTrainer(_VariationalTrainer):
    r"""A ``transformers.Trainer`` that trains BLoB: variational LoRA A, point B, flipout.

    Each step is :class:`~pyro_bdl.inference.BLoBSVI`'s, :func:`~pyro_bdl.inference.fit_blob`'s
    recipe: AdamW at ``learning_rate`` (with ``weight_decay``) on the NLL of the means
    :math:`M`, the B matrices and the head, then SGD at ``kl_lr`` on the re-weighted KL
    (Algorithm 1, Appendix B.1). Both learning rates follow the Trainer's schedule
    (``lr_scheduler_type``, warm-up); ``max_grad_norm`` clips the NLL gradient of the
    means (AdamW's parameters), as a plain LoRA run clips its adapters'. The KL weights'
    cycle is that of the whole step's batch (per device x accumulation x processes).

    The model: a peft model (its LoRA A weights become the variational ones and the B
    weights and a ``modules_to_save`` head point estimates, with the prior
    :math:`\mathcal{N}(0, \sigma_p^2)`), or a :func:`~pyro_bdl.models.lora_model` built with
    ``adapters_random="A", head="point"``. The Trainer's ``train()`` puts it in training
    mode, so its LoRA dropout runs as in plain LoRA training. ``trainer.guide`` is the
    :class:`~pyro_bdl.inference.BLoBGuide`.

    Example::

        args = TrainingArguments("out", learning_rate=5e-4, num_train_epochs=5,
                                 per_device_train_batch_size=16, warmup_steps=0.06)
        trainer = BLoBTrainer(model=peft_model, args=args, train_dataset=train,
                              eval_dataset=val, data_collator=collate)
        trainer.train()
        bdl.save(trainer.guide, "blob")        # trainer.save_model() writes out/posterior

    :param model: a peft model with LoRA adapters, or a :class:`~pyro_bdl.models.LoRAModel`.
    :param args: ``TrainingArguments``; the other positional and keyword arguments are
        the Trainer's (``data_collator``, ``train_dataset``, ``eval_dataset``,
        ``processing_class``, ``compute_metrics``, ``callbacks``, ...).
    :param float prior_std: :math:`\sigma_p` (default: a ``LoRAModel``'s prior, 0.2 for a
        peft model; Table 4: 0.2 RoBERTa, 2 Llama2).
    :param float eps: :math:`\epsilon` of the initialisation of :math:`G` (Table 4: 0.05).
    :param float kl_lr: SGD's learning rate for the KL (Table 4: 0.002 RoBERTa, 0.01 Llama2).
    :param str kl_weighting: ``"exponential"`` (BLoB) or ``"uniform"``.
    :param float gamma: :math:`\gamma` of the KL cycle (Table 4: 8).
    :param bool flipout: flipout at the LoRA A projections.
    :param int num_samples: weight draws of the Bayesian model average at evaluation (0:
        the means, "BLoB (N=0)").
    :param int num_data: :math:`N` (default: the length of ``train_dataset``).
    """

    _layout = {"adapters_random": "A", "head": "point"}

    def __init__(
        self,
        model: Any = None,
        args: Any = None,
        *trainer_args,
        prior_std: float | None = None,
        eps: float = 0.05,
        kl_lr: float = 0.002,
        kl_weighting: str = "exponential",
        gamma: float = 8.0,
        flipout: bool = True,
        num_samples: int = 10,
        num_data: int | None = None,
        **trainer_kwargs,
    ):
        self._settings = {"kl_weighting": kl_weighting, "gamma": gamma}
        self._guide_settings = {"eps": eps, "flipout": flipout}
        self.kl_lr = _checks.real("kl_lr", kl_lr, non_negative=True)
        super().__init__(
            model,
            args,
            *trainer_args,
            prior_std=prior_std,
            num_samples=num_samples,
            num_data=num_data,
            **trainer_kwargs,
        )

    def _make_guide(self) -> BLoBGuide:
        try:
            return BLoBGuide(self.lora.model, self.lora.net, **self._guide_settings)
        except ValueError as error:
            raise ValueError(
                f"BLoBTrainer: {error}; pass the peft model itself, or "
                "lora_model(..., adapters_random='A', head='point')"
            ) from None

    def _make_svi(self, backward: Callable) -> BLoBSVI:
        args = self.args
        return BLoBSVI(
            self.lora.model,
            self.guide,
            num_steps=max(1, args.max_steps),
            lr=args.learning_rate,
            kl_lr=self.kl_lr,
            weight_decay=args.weight_decay,
            max_grad_norm=args.max_grad_norm or None,
            backward=backward,
            **self._settings,
        )

    def _learning_rates(self) -> dict[str, float]:
        return {"lr": self.args.learning_rate, "kl_lr": self.kl_lr}

    def _release_guide(self) -> None:
        self.guide.flipout = False


class IVONTrainer(_VariationalTrainer):
    r"""A ``transformers.Trainer`` that trains IVON on the LoRA weights (and the head).

    Each step is :class:`~pyro_bdl.inference.IVONSVI`'s (Algorithm 1 of Shen et al.),
    :func:`~pyro_bdl.inference.fit_ivon`'s: ``mc_samples`` forward and backward passes at
    weights drawn from :math:`\mathcal{N}(m, 1 / (\lambda (h + \delta)))`, shared by the
    step's microbatches, then the update of :math:`m`, :math:`h` and the momentum. The
    learning rate is the Trainer's ``learning_rate`` (IVON's scale: ``ivon-opt`` uses
    about 0.1) on the Trainer's schedule; ``max_grad_norm`` clips :math:`\hat g`.

    The model: a peft model (its LoRA weights and a ``modules_to_save`` head are the
    random weights, with the prior :math:`\mathcal{N}(0, \sigma_p^2)`, whose precision is
    IVON's weight decay :math:`\delta`), or a :func:`~pyro_bdl.models.lora_model`. The
    Trainer's ``weight_decay`` plays no part (the prior is the decay). ``trainer.guide`` is
    the :class:`~pyro_bdl.inference.IVONGuide`.

    Example::

        args = TrainingArguments("out", learning_rate=0.1, max_steps=2000,
                                 per_device_train_batch_size=16)
        trainer = IVONTrainer(model=peft_model, args=args, train_dataset=train,
                              data_collator=collate, hess_init=1e-3)
        trainer.train()

    :param model: a peft model with LoRA adapters, or a :class:`~pyro_bdl.models.LoRAModel`.
    :param args: ``TrainingArguments``; the other arguments are the Trainer's.
    :param float prior_std: :math:`\sigma_p` (default: a ``LoRAModel``'s prior, 0.2 for a
        peft model).
    :param float ess: the effective sample size :math:`\lambda` (default :math:`N / T`).
    :param float temperature: :math:`T`, giving :math:`\lambda = N / T` (pass one of the two).
    :param float hess_init: where :math:`h` starts.
    :param float beta1: the momentum's decay.
    :param float beta2: the Hessian estimate's decay (default:
        :func:`~pyro_bdl.inference.fit_ivon`'s :math:`1 - 5 / T` over the run's :math:`T`
        optimiser steps, within [0.9, 0.99999],
        so that :math:`h` forgets ``hess_init``; a run whose :math:`h` still holds more than
        10% of it warns at the end of ``train``).
    :param int mc_samples: weight draws per step.
    :param float clip_radius: the clip of each coordinate of the preconditioned update.
    :param int num_samples: weight draws of the Bayesian model average at evaluation (0:
        the means).
    :param int num_data: :math:`N` (default: the length of ``train_dataset``).
    """

    _layout = {"adapters_random": "AB", "head": "random"}

    def __init__(
        self,
        model: Any = None,
        args: Any = None,
        *trainer_args,
        prior_std: float | None = None,
        ess: float | None = None,
        temperature: float | None = None,
        hess_init: float = 1.0,
        beta1: float = 0.9,
        beta2: float | None = None,
        mc_samples: int = 1,
        clip_radius: float = math.inf,
        num_samples: int = 10,
        num_data: int | None = None,
        **trainer_kwargs,
    ):
        self._guide_settings = {"ess": ess, "temperature": temperature, "hess_init": hess_init}
        self._beta2 = beta2  # None: chosen from the run's length in create_scheduler
        self._settings = {
            "beta1": beta1,
            "beta2": BETA2_MAX if beta2 is None else beta2,
            "mc_samples": mc_samples,
            "clip_radius": clip_radius,
        }
        super().__init__(
            model,
            args,
            *trainer_args,
            prior_std=prior_std,
            num_samples=num_samples,
            num_data=num_data,
            **trainer_kwargs,
        )

    def _make_guide(self) -> IVONGuide:
        return IVONGuide(self.lora.model, **self._guide_settings)

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        """The Trainer's scheduler; the run's length also sets the default ``beta2``."""
        if self._beta2 is None:
            self.svi.beta2 = _default_beta2(num_training_steps)
        return super().create_scheduler(num_training_steps, optimizer)

    def train(self, *args, **kwargs):
        """The Trainer's ``train``; warns at the end when :math:`h` still holds ``hess_init``."""
        output = super().train(*args, **kwargs)
        if self.svi is not None and self.svi.step_count > 0:
            _warn_if_hess_init_remains(self.svi, self.state.global_step, type(self).__name__)
        return output

    def _make_svi(self, backward: Callable) -> IVONSVI:
        args = self.args
        return IVONSVI(
            self.lora.model,
            self.guide,
            lr=args.learning_rate,
            max_grad_norm=args.max_grad_norm or None,
            backward=backward,
            **self._settings,
        )


class _MethodStep(torch.optim.Optimizer):
    """The Trainer's optimiser: its ``step`` is the method's update.

    Its parameter groups carry the learning rates the Trainer's scheduler sets (one per
    rate of the method, named as :meth:`update` takes them) and, once the method has
    seen the model, the tensors whose gradients it accumulates, so that accelerate's loss
    scaler (fp16) unscales them and skips a step that overflowed. Its state is the
    method's, saved with the posterior (safetensors), not in the Trainer's pickle.
    """

    def __init__(self, svi: BLoBSVI | IVONSVI, learning_rates: dict[str, float]):
        groups = [{"params": [], "lr": lr, "name": name} for name, lr in learning_rates.items()]
        super().__init__(groups, {})
        self.svi = svi
        #: the statistics of the last update (tensors)
        self.record: dict = {}

    def adopt(self) -> None:
        """Put the method's tensors in the first group, once it has made them."""
        params = self.param_groups[0]["params"]
        if not params:
            params.extend(self.svi.grad_tensors())

    def step(self, closure=None) -> None:
        self.record = self.svi.update(**{group["name"]: group["lr"] for group in self.param_groups})

    def zero_grad(self, set_to_none: bool = True) -> None:
        # the method clears its sums at each update: between microbatches they must stay
        pass

    def state_dict(self) -> dict:
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        return {"state": {}, "param_groups": [{**group, "params": []} for group in groups]}

    def load_state_dict(self, state_dict: dict) -> None:
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            group.update({k: v for k, v in saved.items() if k not in ("params", "name")})


class LaplaceCallback(TrainerCallback):
    r"""Laplace-LoRA at the end of a Trainer's run, saved beside its output.

    At ``on_train_end`` the trained adapters (and a ``modules_to_save`` head) of the
    Trainer's peft model get Laplace-LoRA's post-hoc approximation at their values
    (Yang et al., 2024), by :func:`~pyro_bdl.inference.fit_laplace_lora`, the one recipe:
    the curvature (``curvature``, K-FAC by default) over the Trainer's training
    dataloader (each process its shard under ``torchrun``), the prior precision of every
    weight tensor by the evidence, and the linearised predictive's link chosen on
    validation data when there is any (``val_dataset``, else the Trainer's eval
    dataloader once it has evaluated), else Laplace-LoRA's ``"mc"``. The posterior is
    saved with :func:`pyro_bdl.save` to ``<output_dir>/posterior``: a peft adapter
    directory too, holding the fine-tuned adapters. The fit runs with dropout off; the
    model's mode is restored afterwards. ``callback.guide`` is the
    :class:`~pyro_bdl.inference.LaplaceGuide`.

    Example::

        laplace = LaplaceCallback("kron")
        trainer = Trainer(model=peft_model, args=args, train_dataset=train,
                          eval_dataset=val, data_collator=collate, callbacks=[laplace])
        trainer.train()
        probs = laplace.guide.predictive(test_batch, len(train))

    :param str curvature: the Laplace structure (see :class:`~pyro_bdl.inference.LaplaceGuide`).
    :param float prior_scale: :math:`\sigma_p` of the prior the tuning starts from.
    :param val_dataset: validation examples on which the link is chosen (the Trainer's
        collator batches them).
    :param grid: deprecated and ignored: the prior precision is tuned by the evidence, as
        in Laplace-LoRA, which needs no validation data (it was a grid search on them).
    :param int num_steps: Adam steps of the evidence's tuning.
    :param str directory: the posterior's directory inside ``output_dir``.
    :param int num_data: :math:`N` (default: the training dataloader's dataset's length).
    :param task: for :meth:`~pyro_bdl.models.LoRAModel.from_peft`, with
        ``label_token_ids`` (a causal LM's multiple choice).
    """

    def __init__(
        self,
        curvature: str = "kron",
        *,
        prior_scale: float = 0.2,
        val_dataset: Any = None,
        grid: torch.Tensor | None = None,
        num_steps: int = 1000,
        directory: str = POSTERIOR,
        num_data: int | None = None,
        task: str | None = None,
        label_token_ids: list[int] | None = None,
    ):
        make_curvature(curvature)  # a name it does not know is an error now, not at the end
        if grid is not None:
            warnings.warn(
                "LaplaceCallback(grid=...) is deprecated and ignored (it goes in the next "
                "release): the prior precision is tuned by the evidence on the training data, "
                "as Laplace-LoRA does, and validation data choose the predictive's link; "
                "drop grid=",
                DeprecationWarning,
                stacklevel=2,
            )
        self.curvature = curvature
        self.prior_scale = _checks.real("prior_scale", prior_scale, positive=True)
        self.val_dataset = val_dataset
        self.num_steps = _checks.integer("num_steps", num_steps, low=1)
        self.directory = _checks.instance("directory", directory, (str, os.PathLike), "a path")
        self.num_data = None if num_data is None else _checks.integer("num_data", num_data, low=1)
        self.task, self.label_token_ids = task, label_token_ids
        #: the fitted posterior, after training
        self.guide: LaplaceGuide | None = None

    def on_train_end(self, args, state, control, model=None, train_dataloader=None, **kwargs):
        lora = LoRAModel.from_peft(
            model, self.task, label_token_ids=self.label_token_ids, prior_scale=self.prior_scale
        )
        num_data = self.num_data or len(train_dataloader.dataset)
        validation = self._validation(args, train_dataloader, kwargs.get("eval_dataloader"))
        training = model.training
        model.eval()
        try:
            guide, _, _ = fit_laplace_lora(
                lora.model,
                train_dataloader,
                num_data,
                validation,
                curvature=self.curvature,
                num_steps=self.num_steps,
                links=LINKS if validation is not None else ("mc",),
                progress=not args.disable_tqdm and state.is_local_process_zero,
            )
        finally:
            model.train(training)
        if state.is_world_process_zero:
            persistence.save(guide, Path(args.output_dir) / self.directory)
        self.guide = guide

    def _validation(self, args, train_dataloader, eval_dataloader):
        """The validation batches: ``val_dataset`` in batches of the Trainer's evaluation
        size, else the Trainer's eval dataloader (None before it has evaluated)."""
        if self.val_dataset is None:
            return eval_dataloader
        return torch.utils.data.DataLoader(
            self.val_dataset,
            batch_size=args.per_device_eval_batch_size,
            collate_fn=train_dataloader.collate_fn,
        )


def _lora_model(name: str, model: Any, layout: dict, prior_std: float | None) -> LoRAModel:
    """The Pyro model of the Trainer's model, lifted as the method needs."""
    if prior_std is not None:
        prior_std = _checks.real("prior_std", prior_std, positive=True)
    if isinstance(model, LoRAModel):
        if prior_std is not None:
            model.net.prior = IIDNormal(prior_std)
        return model
    try:
        return LoRAModel.from_peft(
            model, prior_scale=prior_std or 0.2, **_with_head(model, **layout)
        )
    except (TypeError, ValueError) as error:
        raise ValueError(f"{name}: {error}") from None


def _with_head(model: Any, adapters_random: str, head: str) -> dict:
    """The layout, with the head as asked if peft trains one (modules_to_save), else frozen."""
    names = [name for name, p in getattr(model, "named_parameters", list)() if p.requires_grad]
    trained = any(".modules_to_save." in name for name in names)
    return {"adapters_random": adapters_random, "head": head if trained else "frozen"}


def _check_accumulation(name: str, args, train_dataset) -> None:
    """Gradient accumulation needs more batches per epoch than the microbatches of a step:
    otherwise each step is cut at the epoch's end and never has the batch asked for."""
    steps = args.gradient_accumulation_steps
    if steps == 1 or train_dataset is None or not hasattr(train_dataset, "__len__"):
        return
    per_step = args.per_device_train_batch_size * args.world_size
    batches = len(train_dataset) // per_step
    if not args.dataloader_drop_last and len(train_dataset) % per_step:
        batches += 1
    if batches < steps:
        raise ValueError(
            f"{name}: gradient_accumulation_steps={steps} microbatches per step, but an epoch of "
            f"the {len(train_dataset)} training examples has {batches} batch"
            f"{'es' if batches != 1 else ''} of per_device_train_batch_size="
            f"{args.per_device_train_batch_size} (on {args.world_size} process(es)): every step "
            "would be cut at the epoch's end, a smaller batch than asked. Lower "
            "gradient_accumulation_steps (or the batch size)"
        )


def _nll(probs: torch.Tensor, labels: torch.Tensor, head) -> torch.Tensor:
    """The mean negative log probability of the labels under the averaged probabilities."""
    if isinstance(head, NextToken):  # the logits at t predict token t + 1
        probs, labels = probs[:, :-1], labels[:, 1:]
    labels = labels.to(probs.device)
    kept = labels != IGNORE_INDEX
    picked = probs.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    log_probs = picked.clamp_min(torch.finfo(probs.dtype).tiny).log()
    return -(log_probs * kept).sum() / kept.sum()
