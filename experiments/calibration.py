"""Calibration of Bayesian LoRA fine-tuning: BLoB's Table 1 and Laplace-LoRA's figures.

all-MiniLM-L6-v2 with LoRA (rank 8, alpha 16, dropout 0.1, queries and values) and a new
output head is fine-tuned on the papers' tasks, and every method is scored on the test
subset by accuracy, ECE (15 bins) and NLL of its Bayesian model average, as mean +- sd
over seeds. Whatever a method chooses (Laplace's link) it chooses on the validation
subset; the test subset is only scored.

**One training recipe for every method** (BLoB, Table 3; :func:`~experiments.
lora_finetune.training_recipe`): AdamW at peak learning rate 5e-4, linear warm-up over 6%
of the steps then linear decay to zero, the task's batch size (32, Table 3's RoBERTa) and
number of steps, for MLE, MAP, MCD, the ensemble members, BBB, BLoB and IVON alike. The
methods:

- **MLE**: the recipe on the likelihood, LoRA and model dropout on while training; it is
  the first member of the ensemble.
- **MAP**: the recipe with AdamW weight decay 1e-5 (BLoB's MAP); the checkpoint that LA,
  LLLA and SGHMC start from.
- **MAP+TS**: the MAP checkpoint with temperature scaling (Guo et al., 2017): one scalar
  dividing the logits, fitted by the NLL on the validation subset
  (:func:`~pyro_bdl.inference.baselines.temperature_scaling`; the temperatures are in
  ``results.json``). Same accuracy as MAP; the baseline a Bayesian row must beat on NLL and
  ECE to show that its uncertainty is more than a rescaling.
- **MCD**: the MLE checkpoint predicted with LoRA dropout on, 10 passes.
- **ENS**: three MLE fine-tunes from LoRA initialisations of different seeds.
- **BBB**: Bayes by Backprop on the LoRA A matrices (B and the head point estimates, as
  the paper's BBB), :func:`~pyro_bdl.inference.baselines.bbb`, 10 draws.
- **BLoB**: :class:`~pyro_bdl.inference.BLoBGuide` and :func:`~pyro_bdl.inference.fit_blob`
  with the paper's RoBERTa settings
  (Table 4), both its optimisers on the recipe's schedule; the mean weights (N = 0) and
  N = 5 and 10 draws.
- **IVON**: :class:`~pyro_bdl.inference.IVONGuide` and :func:`~pyro_bdl.inference.fit_ivon`
  on every LoRA weight and the
  head, with the recipe's steps, batch size and schedule (its own optimiser and learning
  rate 0.1, :func:`~pyro_bdl.inference.fit_ivon`'s defaults otherwise), 10 draws; its
  prior scale and temperature (``ess = N / T``) are chosen on the validation subset among
  ``METHOD["ivon_choices"]``. At the shared prior N(0, 0.2^2) and T = 1 it does not learn
  SST-2 in 160 steps: there the prior's precision per data point (0.05) outweighs the
  likelihood's curvature of most LoRA weights (about 0.006), so the means stay near zero
  and the posterior's noise (sd 0.19) hides what they learn; a wider prior (sd 1) and a
  cold posterior (T <= 0.01) let it learn.
- **LA**: the Laplace recipe (:func:`~experiments.lora_finetune.laplace`):
  K-FAC GGN on every LoRA weight and the head at the MAP, one prior precision per weight
  tensor maximising the evidence from a fan-in-scaled prior, the predictive's link chosen
  on the validation subset (100 joint logit draws for ``"mc"``). **LLLA**: the same on the
  head only.
- **LA-torch**: laplace-torch's ``KronLaplace`` (curvlinops GGN) on the same MAP
  checkpoint with its own per-layer evidence tuning and the link chosen the same way on
  the validation subset (classification tasks, first seed), the reference implementation
  beside ours.
- **SGHMC**: parallel SGHMC (a Bayesian deep ensemble, posteriors paper section 4.2):
  4 chains started at the MAP at temperature 1, each a tenth of a fine-tune long, the
  last draw of each.

**Sizes.** On a CPU (``--device cpu``, :data:`FULL`) every task trains on 512 examples
(all 640 of WinoGrande-S) for 10 epochs of batch 32 (160-200 steps: 4-5 cycles of BLoB's
KL re-weighting, whose cycle is :math:`L^*/B` = 36-40 steps), with 200 validation and up
to 500 test examples. On a GPU (``--device cuda``, :data:`PAPER`) the six tasks of
BLoB's Table 1 train on their full training sets for 2,000 steps of batch 32 (the papers
train for a number of steps: BLoB 5,000 of batch 4, Laplace-LoRA 10,000 of batch 32).
The regime that matters is the one where fine-tuning overfits and MAP is overconfident;
the MAP's train/test gap is reported. ``--epochs N`` trains every fine-tune for N epochs
instead, in cells and checkpoints of its own: on SST-2 the recipe's 10 epochs leave MAP
underfit and calibrated, while at 40 MAP overfits and LA and BLoB beat it
(``docs/experiments.md``, the ablation).

**A pretrained causal LM** (``--model smollm2``, or a local Llama-architecture model
directory): every method on :data:`CAUSAL`'s tasks, the ones SmolLM2-135M learns on a CPU
(``docs/experiments.md``, section 6), with LoRA on the queries and values of its last 16
decoder layers, the layers below run once per prompt (:mod:`experiments.causal_lm`); the
classes are the answer tokens' next-token logits, as in the papers, or for ARC-Easy
(``arc_easy_text``) the log-probabilities of the choices' texts. The recipe is the same for
every method, at the learning rate the learnability probes chose (1e-3, batch 8). LLLA and
LA-torch are not run (the causal LM has no new head; laplace-torch takes the encoder's
classifier); their cells say so. Cells and checkpoints are the model's own. A model tuned
on ARC-Easy is also scored on OpenBookQA's questions by their texts (:data:`CAUSAL_SHIFT`,
a distribution shift as in BLoB's Table 2), in a column ``arc_easy_text_to_obqa_text`` of
every table, with the AUROC of telling those questions from ARC-Easy's own by predictive
entropy.

Outputs in ``--out``: ``results.json`` (with the device, the sizes, the recipe and every
cell's wall and CPU time), ``calibration.md`` (the tables), ``calibration_<dataset>.png``
(reliability diagrams of the pooled seeds, one panel per method), ``cells/`` (one JSON per
dataset x method x seed, with the per-example probabilities) and ``checkpoints/`` (the
fine-tuned adapters and head).

Run::

    python -m experiments calibration --data-dir ../shared/data --out results/calibration
    python -m experiments calibration --data-dir ../shared/data --out results/paper --device cuda
    python -m experiments calibration --data-dir ../shared/data --out results/calibration-smollm2 \
        --model smollm2
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
from pathlib import Path

import pyro
import torch
from safetensors.torch import load_file

from experiments.causal_lm import CausalNetwork, CausalTask
from experiments.lora_finetune import (
    LEARNING_RATE,
    LINKS,
    LORA,
    PRIOR_SCALE,
    SCHEDULE,
    WARMUP_RATIO,
    WEIGHT_DECAY,
    Network,
    Task,
    TaskSpec,
    checkpoint,
    evaluate,
    fine_tune_map,
    guide_draws,
    laplace,
    laplace_draws,
    lora_dropout,
    minilm_tokenizer,
    point_draws,
    predict,
    sghmc_chains,
    single_thread,
    temperature_scaled,
    training_recipe,
)
from experiments.runner import Experiment, markdown_table, mean_sd
from pyro_bdl.inference import BLoBGuide, IVONGuide, baselines, fit_blob, fit_ivon
from pyro_bdl.inference.vi.blob_svi import warmup_schedule
from pyro_bdl.metrics import auroc, selective_accuracy, uncertainty_decomposition
from pyro_bdl.models import DictLogits
from pyro_bdl.plots import reliability_diagram
from pyro_bdl.priors import IIDNormal

__all__ = ["run", "FULL", "PAPER", "QUICK", "METHODS"]

#: The :class:`~experiments.runner.Experiment` options this experiment takes
#: beyond the common ones.
OPTIONS = ("epochs", "model")

METHODS = (
    "MLE",
    "MAP",
    "MAP+TS",
    "MCD",
    "ENS",
    "BBB",
    "BLoB",
    "IVON",
    "LA",
    "LLLA",
    "LA-torch",
    "SGHMC",
)

_VALIDATION = 200
#: The CPU run: at least 500 training examples per task (all 640 of WinoGrande-S), 10
#: epochs of batch 32, 200 validation examples, up to 500 test examples (OpenBookQA's
#: validation examples come from its own validation file).
FULL = {
    "sst2": TaskSpec("sst2", 512, 500, max_length=64, validation_size=_VALIDATION),
    "winogrande_s": TaskSpec("winogrande_s", None, 500, 48, validation_size=_VALIDATION),
    "arc_easy": TaskSpec("arc_easy", 512, 500, 64, validation_size=_VALIDATION),
    "obqa": TaskSpec(
        "obqa", 512, 500, 48, validation_size=_VALIDATION, validation_split="validation"
    ),
    "boolq": TaskSpec("boolq", 512, None, 96, validation_size=_VALIDATION),
}
#: The GPU run: BLoB's six tasks on their full training sets, 2,000 steps of batch 32.
PAPER = {
    name: TaskSpec(name, None, None, length, steps=2000, validation_size=500, **options)
    for name, length, options in (
        ("winogrande_s", 48, {}),
        ("winogrande_m", 48, {}),
        ("arc_easy", 64, {}),
        ("arc_challenge", 64, {}),
        ("obqa", 48, {"validation_split": "validation"}),
        ("boolq", 128, {}),
    )
}
#: The CI run: two tasks, tiny subsets, a few steps (the numbers mean nothing).
QUICK = {
    "sst2": TaskSpec("sst2", 16, 16, max_length=32, batch_size=8, epochs=2, validation_size=8),
    "winogrande_s": TaskSpec(
        "winogrande_s", 8, 40, max_length=32, batch_size=8, epochs=2, validation_size=8
    ),
}
#: The causal LM's run (``--model smollm2``, on a CPU): the three tasks SmolLM2 learns with
#: LoRA on its last :data:`CAUSAL_TOP_LAYERS` layers (``docs/experiments.md``, section 6),
#: batch 8, two epochs, the learning rate 1e-3 that the learnability probes chose on
#: validation sentences (the recipe's schedule: warm-up, then linear decay).
CAUSAL = {
    name: TaskSpec(
        name, train, 256, length, batch_size=8, steps=steps, validation_size=128, lr=1e-3
    )
    for name, train, length, steps in (
        ("sst2", 512, 64, 128),
        ("imdb", 256, 128, 64),
        ("arc_easy_text", 256, 96, 64),
    )
}
#: The causal LM's CI run: a task of each scoring (the numbers mean nothing).
CAUSAL_QUICK = {
    name: TaskSpec(name, 8, 8, 48, batch_size=4, steps=2, validation_size=8, lr=1e-3)
    for name in ("sst2", "arc_easy_text")
}
#: Distribution shift: task -> (another task, its test questions). Every method of a task
#: is also scored on the other task's questions, which nothing trains or tunes on (BLoB's
#: Table 2 and Laplace-LoRA's out-of-distribution tables: a model tuned on one task of
#: science questions answers another's), in the tables' column ``<task>_to_<other>``; its
#: AUROC table says how well each method's predictive entropy tells them from the task's own.
CAUSAL_SHIFT = {"arc_easy_text": ("obqa_text", 128)}
CAUSAL_SHIFT_QUICK = {"arc_easy_text": ("obqa_text", 8)}
#: The decoder layers whose queries and values LoRA adapts (the last ones), full and quick.
CAUSAL_TOP_LAYERS = {"full": 16, "quick": 1}
#: Method settings; ``QUICK_METHOD`` overrides some for the CI run.
METHOD = {
    "ensemble_members": 3,
    "mc_dropout_passes": 10,
    "laplace_samples": 100,
    "marglik_steps": 1000,
    "blob_samples": (5, 10),
    "blob": {"kl_lr": 0.002, "eps": 0.05, "prior_std": PRIOR_SCALE},
    "bbb_samples": 10,
    # IVON's own hyperparameters (its learning rate is not AdamW's: ivon-opt's default);
    # the recipe gives it the steps, the batch size and the schedule.
    "ivon": {"num_samples": 10, "lr": 0.1},
    # (prior_std, temperature) candidates, the one of lowest validation NLL kept: the
    # shared prior at T = 1 (at which IVON stays at chance on SST-2, see the module's
    # docstring), and a wider prior with a cold posterior.
    "ivon_choices": ((0.2, 1.0), (1.0, 0.01), (1.0, 0.001)),
    "sghmc_chains": 4,
    "sghmc_fraction": 0.1,
    "sghmc": {"step_size": 0.03, "friction": 1.0, "temperature": 1.0},
}
QUICK_METHOD = {
    "ensemble_members": 2,
    "mc_dropout_passes": 3,
    "laplace_samples": 20,
    "blob_samples": (2, 3),
    "bbb_samples": 3,
    "ivon": {"num_samples": 3, "lr": 0.1},
    "ivon_choices": ((1.0, 0.01), (0.2, 1.0)),
    "sghmc_chains": 2,
}
#: Methods drawn in the reliability diagrams (with the BLoB row of most draws).
DIAGRAM = ("MAP", "ENS", "BBB", "IVON", "LA", "SGHMC")
#: laplace-torch runs on the classification tasks, for the first seed only: its GLM
#: predictive takes about 30 times as long as ours (measured 13 s against 0.4 s per batch).
LAPLACE_TORCH_TASKS = ("sst2", "boolq")


def run(experiment: Experiment) -> dict:
    """One thread; see :func:`~experiments.lora_finetune.single_thread`."""
    with single_thread():
        return _run(experiment)


def _run(experiment: Experiment) -> dict:
    """Run the grid of datasets x methods x seeds; write the results, tables and figures."""
    causal = experiment.model is not None
    if causal:
        specs = CAUSAL_QUICK if experiment.quick else CAUSAL
    else:
        specs = QUICK if experiment.quick else PAPER if experiment.on_gpu else FULL
    if experiment.epochs is not None:
        specs = {
            name: dataclasses.replace(spec, epochs=experiment.epochs, steps=None)
            for name, spec in specs.items()
        }
    settings = {**METHOD, **(QUICK_METHOD if experiment.quick else {})}
    datasets = experiment.selected("datasets", specs)
    methods = experiment.selected("methods", METHODS)
    if causal:
        top_layers = CAUSAL_TOP_LAYERS["quick" if experiment.quick else "full"]
        shifts = CAUSAL_SHIFT_QUICK if experiment.quick else CAUSAL_SHIFT
        tasks = {
            name: CausalTask(
                specs[name],
                experiment.data_dir,
                experiment.model,
                top_layers,
                *shifts.get(name, ()),
            )
            for name in datasets
        }
        network, model = (
            CausalNetwork,
            (
                f"{Path(experiment.model).name} + LoRA on q/v of the last {top_layers} layers, "
                "the answer tokens' next-token logits (the choice texts' log-probabilities "
                "for *_text tasks)"
            ),
        )
    else:
        tokenizer = minilm_tokenizer()
        tasks = {name: Task(specs[name], experiment.data_dir, tokenizer) for name in datasets}
        network, model = Network, "all-MiniLM-L6-v2 + LoRA on query/value, new head"
    experiment.settings = {
        "model": model,
        "lora": LORA,
        "prior_scale": PRIOR_SCALE,
        "recipe": _recipe_text([specs[name] for name in datasets]),
        "tasks": {name: specs[name].asdict() for name in datasets},
        "sizes": {name: task.sizes() for name, task in tasks.items()},
        "methods": settings,
        "torch_threads": torch.get_num_threads(),
    }
    cells: dict[str, dict[str, dict[int, dict]]] = {}
    extras: dict[str, dict[str, dict[int, dict]]] = {}
    # another training length or model is another fine-tune: its own checkpoints and cells
    length = () if experiment.epochs is None else (f"epochs={experiment.epochs}",)
    if causal:
        length += (f"model={Path(experiment.model).name}",)
    for dataset, task in tasks.items():
        fits = _Fits(
            experiment.out / "checkpoints" / "__".join((dataset, *length)),
            task,
            settings,
            experiment.device,
            network,
        )
        # scored on another task's questions too: cells of their own
        shift = getattr(task, "shift_name", None)
        scored = length if shift is None else (*length, f"shift={shift}")
        for seed in experiment.seeds:
            for method in methods:
                if method == "LA-torch" and (
                    dataset not in LAPLACE_TORCH_TASKS or seed != experiment.seeds[0]
                ):
                    continue
                compute = _METHODS[method]
                cell = experiment.cell(
                    (dataset, method, seed, *scored),
                    lambda compute=compute, fits=fits, seed=seed: compute(fits, seed),
                )
                for row, result in cell["rows"].items():
                    cells.setdefault(dataset, {}).setdefault(row, {})[seed] = result
                    if "shift" in result:
                        shifted = {**result["shift"], "in_distribution_probs": result["probs"]}
                        column = cells.setdefault(f"{dataset}_to_{shift}", {})
                        column.setdefault(row, {})[seed] = shifted
                extra = {k: v for k, v in cell.items() if k != "rows"}
                extras.setdefault(dataset, {}).setdefault(method, {})[seed] = extra
    results = _summaries(cells, extras)
    tables = _tables(results, list(cells), experiment)
    (experiment.out / "calibration.md").write_text(tables + "\n")
    for dataset in cells:
        _diagram(cells[dataset], experiment.out / f"calibration_{dataset}.png", dataset)
    experiment.write_results(results)
    print(tables)
    return results


def _recipe_text(specs: list[TaskSpec]) -> str:
    rates = {spec.lr for spec in specs} - {None}
    lr = LEARNING_RATE if not rates else ", ".join(f"{rate:g}" for rate in sorted(rates))
    return (
        f"AdamW, peak lr {lr}, {SCHEDULE} decay after a linear warm-up over "
        f"{WARMUP_RATIO:.0%} of the steps, eps 1e-6; MAP weight decay {WEIGHT_DECAY}; "
        "the task's steps and batch size for every method"
    )


class _Fits:
    """The fine-tunes of one task that several methods share, cached on disk."""

    def __init__(
        self,
        directory: Path,
        task: Task,
        settings: dict,
        device: torch.device,
        network: type[Network] = Network,
    ):
        self.directory = directory
        self.task = task
        self.settings = settings
        self.device = device
        self.network_type = network

    def network(self, seed: int) -> Network:
        pyro.clear_param_store()
        return self.network_type(self.task, seed, self.device)

    def map(self, seed: int) -> dict[str, torch.Tensor]:
        return checkpoint(
            self.directory / f"seed{seed}" / "map.safetensors",
            lambda: fine_tune_map(self.network(seed), self.task, seed),
            self.device,
        )

    def ensemble(self, seed: int) -> list[dict[str, torch.Tensor]]:
        """The MLE fine-tunes of the ensemble (member 0 is the MLE row)."""
        count = self.settings["ensemble_members"]
        paths = [self.directory / f"seed{seed}" / f"ens{k}.safetensors" for k in range(count)]
        if not all(path.exists() for path in paths):
            network = self.network(seed).train()
            predictor = baselines.deep_ensemble(
                network.model,
                self.task.train_loader(seed),
                self.task.num_data,
                num_members=count,
                net=network.net,
                seed=100 * seed,
                progress=False,
                **training_recipe(self.task),
            )
            for path, member in zip(paths, predictor.members, strict=True):
                checkpoint(path, lambda member=member: _first(member.samples))
        return [load_file(path, device=str(self.device)) for path in paths]


def _first(samples: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {site: value[0] for site, value in samples.items()}


def _predictions(draws, task: Task) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each draw's probabilities and the labels on the test subset (``"test"``) and on the
    task's shifted questions (``"shift"``, if it has them)."""
    loaders = {"test": task.test_loader(), "shift": task.shift_loader()}
    return {name: predict(draws, loader) for name, loader in loaders.items() if loader}


def _scored(predictions: dict, count: int | None = None) -> dict:
    """A row from :func:`_predictions` (its first ``count`` draws): the test subset's
    metrics and mean probabilities, and the shifted questions' under ``"shift"``."""

    def score(probs, labels) -> dict:
        probs = probs[:count]
        return {
            "metrics": evaluate(probs, labels),
            "probs": probs.mean(0).round(decimals=6),
            "labels": labels,
        }

    row = score(*predictions["test"])
    if "shift" in predictions:
        row["shift"] = score(*predictions["shift"])
    return row


def _row(draws, task: Task) -> dict:
    return _scored(_predictions(draws, task))


def _map(fits: _Fits, seed: int) -> dict:
    network = fits.network(seed)
    theta = fits.map(seed)
    draws = point_draws(network.model, [theta])
    train_probs, train_labels = predict(draws, fits.task.eval_loader(fits.task.train))
    return {"rows": {"MAP": _row(draws, fits.task)}, "train": evaluate(train_probs, train_labels)}


def _map_ts(fits: _Fits, seed: int) -> dict:
    network = fits.network(seed)
    scaled = temperature_scaled(point_draws(network.model, [fits.map(seed)]), fits.task)
    return {"rows": {"MAP+TS": _row(scaled, fits.task)}, "temperature": scaled.temperature}


def _mle(fits: _Fits, seed: int) -> dict:
    network = fits.network(seed)
    return {"rows": {"MLE": _row(point_draws(network.model, fits.ensemble(seed)[:1]), fits.task)}}


def _ens(fits: _Fits, seed: int) -> dict:
    network = fits.network(seed)
    return {"rows": {"ENS": _row(point_draws(network.model, fits.ensemble(seed)), fits.task)}}


def _mcd(fits: _Fits, seed: int) -> dict:
    network = fits.network(seed)
    passes = fits.settings["mc_dropout_passes"]
    draws = point_draws(network.model, fits.ensemble(seed)[:1] * passes)
    pyro.set_rng_seed(seed)
    with lora_dropout(network.module):
        return {"rows": {"MCD": _row(draws, fits.task)}}


def _la(fits: _Fits, seed: int) -> dict:
    network = fits.network(seed)
    guide, info = laplace(network.model, fits.task, fits.map(seed), fits.settings["marglik_steps"])
    return {"rows": {"LA": _laplace_row(guide, info, fits, seed)}, "laplace": info}


def _llla(fits: _Fits, seed: int) -> dict:
    network = fits.network(seed)
    if not network.has_head:
        return {
            "rows": {},
            "skipped": "no new head: the causal LM scores the classes with its own output layer",
        }
    theta = fits.map(seed)
    model = network.last_layer_model()
    head = {site: theta[site] for site in model.net.random_sites}
    # the adapters at the MAP in the module, the head random
    with network.net.fixed(theta):
        guide, info = laplace(model, fits.task, head, fits.settings["marglik_steps"])
        return {"rows": {"LLLA": _laplace_row(guide, info, fits, seed)}, "laplace": info}


def _laplace_row(guide, info: dict, fits: _Fits, seed: int) -> dict:
    samples = fits.settings["laplace_samples"]
    return _row(laplace_draws(guide, samples, seed, info["link"]), fits.task)


def _la_torch(fits: _Fits, seed: int) -> dict:
    """laplace-torch's K-FAC GGN Laplace on the same MAP checkpoint, as the reference."""
    try:
        laplace_torch = importlib.import_module("laplace")
        curvatures = importlib.import_module("laplace.curvature")
    except ImportError:
        return {"rows": {}, "skipped": "laplace-torch is not installed"}
    if fits.task.multiple_choice or isinstance(fits.task, CausalTask):
        return {"rows": {}, "skipped": "laplace-torch runs on the encoder's classification tasks"}
    network = fits.network(seed)
    with network.net.fixed(fits.map(seed)):
        module = copy.deepcopy(network.module)
    # torch.func's vmap has no batching rule for the fused attention's backward, which
    # laplace-torch's Jacobians hit; the plain attention computes the same function.
    module.get_base_model().set_attn_implementation("eager")
    module = DictLogits(module).eval()
    la = laplace_torch.KronLaplace(
        module,
        "classification",
        prior_precision=1 / PRIOR_SCALE**2,
        backend=curvatures.CurvlinopsGGN,
    )
    la.fit(_on(fits.task.train_loader(0), fits.device), progress_bar=False)
    la.optimize_prior_precision(
        pred_type="glm",
        method="marglik",
        n_steps=fits.settings["marglik_steps"],
        lr=0.1,
        init_prior_prec=1 / PRIOR_SCALE**2,
        link_approx="mc",
        prior_structure="layerwise",
    )
    generator = torch.Generator(device=fits.device).manual_seed(seed)

    def predictor(link: str):
        def draws(batch):
            probs = la(
                _to(batch, fits.device),
                pred_type="glm",
                link_approx=link,
                n_samples=fits.settings["laplace_samples"],
                generator=generator,
            )
            return probs.unsqueeze(0)

        return draws

    # the same choice as our recipe's: the link with the lowest validation NLL
    scores = {}
    for link in LINKS:
        probs, labels = predict(predictor(link), fits.task.validation_loader())
        scores[link] = evaluate(probs, labels)["nll"]
    link = min(scores, key=scores.get)
    precision = la.prior_precision.reshape(-1).tolist()
    evidence = float(la.log_marginal_likelihood().detach())
    return {
        "rows": {"LA-torch": _row(predictor(link), fits.task)},
        "laplace": {
            "prior_precision": precision,
            "log_marginal_likelihood": evidence,
            "link": link,
            "validation_nll": scores,
        },
    }


def _to(batch: dict, device: torch.device) -> dict:
    return {key: value.to(device) for key, value in batch.items()}


def _on(loader, device: torch.device):
    return [_to(batch, device) for batch in loader] if device.type != "cpu" else loader


def _bbb(fits: _Fits, seed: int) -> dict:
    """BBB on the A matrices, B and the head point estimates (BLoB's BBB)."""
    network = fits.network(seed)
    model = network.blob_model()
    pyro.set_rng_seed(seed)
    network.train()
    predictor = baselines.bbb(
        model,
        fits.task.train_loader(seed),
        fits.task.num_data,
        net=model.net,
        num_samples=fits.settings["bbb_samples"],
        progress=False,
        **training_recipe(fits.task),
    )
    network.eval()
    pyro.set_rng_seed(seed)
    return {"rows": {"BBB": _row(predictor, fits.task)}}


def _blob(fits: _Fits, seed: int) -> dict:
    network = fits.network(seed)
    model = network.blob_model()
    pyro.set_rng_seed(seed)
    network.train()
    settings = dict(fits.settings["blob"])
    guide = BLoBGuide(
        model, model.net, eps=settings.pop("eps"), prior_std=settings.pop("prior_std")
    )
    fit_blob(
        model,
        guide,
        fits.task.train_loader(seed),
        fits.task.num_data,
        progress=False,
        **settings,
        **training_recipe(fits.task),
    )
    network.eval()
    rows = {"BLoB (N=0)": _row(point_draws(model, [guide.median()]), fits.task)}
    few, many = fits.settings["blob_samples"]
    pyro.set_rng_seed(seed)
    predictions = _predictions(guide_draws(model, guide, many), fits.task)
    for count in (few, many):
        rows[f"BLoB (N={count})"] = _scored(predictions, count)
    omega = guide.stddevs()  # BLoB's Omega = G^2 after training
    return {
        "rows": rows,
        "blob": {"scales": {"mean": float(omega.mean()), "max": float(omega.max())}},
    }


def _ivon(fits: _Fits, seed: int) -> dict:
    """IVON on every LoRA weight and the head: the recipe's steps, batch and schedule, and
    the prior scale and temperature of ``METHOD["ivon_choices"]`` with the lowest
    validation NLL."""
    scores, best = {}, None
    for prior_std, temperature in fits.settings["ivon_choices"]:
        draws = _ivon_fit(fits, seed, prior_std, temperature)
        pyro.set_rng_seed(seed)
        nll = evaluate(*predict(draws, fits.task.validation_loader()))["nll"]
        scores[f"prior_std={prior_std:g}, T={temperature:g}"] = nll
        if best is None or nll < best[0]:
            # scored now: the next fit's guide takes over the param store's IVONGuide names
            pyro.set_rng_seed(seed)
            best = (nll, _row(draws, fits.task), prior_std, temperature)
    _, row, prior_std, temperature = best
    choice = {"prior_std": prior_std, "temperature": temperature, "validation_nll": scores}
    return {"rows": {"IVON": row}, "ivon": choice}


def _ivon_fit(fits: _Fits, seed: int, prior_std: float, temperature: float):
    """One IVON fit: the prior N(0, prior_std^2) and ess = N / temperature; its draws."""
    network = fits.network(seed)
    pyro.set_rng_seed(seed)
    network.train()
    network.net.prior = IIDNormal(prior_std)  # a fresh network for every fit
    recipe = training_recipe(fits.task)
    num_steps, warmup_ratio, schedule = (
        recipe[key] for key in ("num_steps", "warmup_ratio", "schedule")
    )
    settings = dict(fits.settings["ivon"])
    num_samples = settings.pop("num_samples")
    guide = IVONGuide(network.model, ess=fits.task.num_data / temperature)
    fit_ivon(
        network.model,
        guide,
        fits.task.train_loader(seed),
        fits.task.num_data,
        num_steps=num_steps,
        schedule=lambda t: warmup_schedule(t, num_steps, warmup_ratio, schedule),
        progress=False,
        **settings,  # IVON's learning rate is its own
    )
    network.eval()
    return guide_draws(network.model, guide, num_samples)


def _sghmc(fits: _Fits, seed: int) -> dict:
    network = fits.network(seed)
    draws = sghmc_chains(
        network.model,
        fits.task,
        fits.map(seed),
        num_chains=fits.settings["sghmc_chains"],
        steps=max(1, round(fits.settings["sghmc_fraction"] * fits.task.num_steps)),
        seed=1000 * seed,
        **fits.settings["sghmc"],
    )
    return {"rows": {"SGHMC": _row(point_draws(network.model, draws), fits.task)}}


_METHODS = {
    "MLE": _mle,
    "MAP": _map,
    "MAP+TS": _map_ts,
    "MCD": _mcd,
    "ENS": _ens,
    "BBB": _bbb,
    "BLoB": _blob,
    "IVON": _ivon,
    "LA": _la,
    "LLLA": _llla,
    "LA-torch": _la_torch,
    "SGHMC": _sghmc,
}


# -- results, tables and figures ---------------------------------------------------------

_METRICS = ("accuracy", "ece", "nll", "brier")
#: Selective prediction: the accuracy on the most confident 80 % of the test examples.
SELECTIVE_COVERAGE = 0.8
_TEST_METRICS = (*_METRICS, "selective_accuracy", "shift_auroc")


def _test_scores(result: dict) -> dict[str, float]:
    """A row's test metrics, with its selective accuracy from its stored probabilities;
    on shifted questions also the AUROC of telling them from the test subset's by the
    predictive entropy."""
    scores = dict(result["metrics"])
    if "probs" in result:
        probs, labels = torch.as_tensor(result["probs"]), torch.as_tensor(result["labels"])
        scores["selective_accuracy"] = selective_accuracy(probs, labels, SELECTIVE_COVERAGE)
    if "in_distribution_probs" in result:
        own = torch.as_tensor(result["in_distribution_probs"])
        entropy = uncertainty_decomposition(torch.cat([own, probs])[None]).total
        shifted = torch.cat([torch.zeros(len(own)), torch.ones(len(probs))])
        scores["shift_auroc"] = auroc(entropy, shifted)
    return scores


_EXTRAS = ("laplace", "blob", "ivon", "skipped", "temperature")


def _summaries(cells: dict, extras: dict) -> dict:
    """Mean +- sd over seeds of every metric; per-seed numbers, MAP's gap, method details."""
    metrics, gap, details, times = {}, {}, {}, {}
    for dataset, rows in cells.items():
        metrics[dataset] = {}
        for row, per_seed in rows.items():
            scores = {s: _test_scores(per_seed[s]) for s in sorted(per_seed)}
            names = [name for name in _TEST_METRICS if all(name in v for v in scores.values())]
            metrics[dataset][row] = {
                name: mean_sd([value[name] for value in scores.values()]) for name in names
            }
            metrics[dataset][row]["per_seed"] = scores
    for dataset, methods in extras.items():
        for method, per_seed in methods.items():
            times.setdefault(dataset, {})[method] = {
                s: {"wall": e["wall_time_s"], "cpu": e.get("cpu_time_s")}
                for s, e in per_seed.items()
            }
            for key in _EXTRAS:
                found = {s: e[key] for s, e in per_seed.items() if key in e}
                if found:
                    details.setdefault(key, {}).setdefault(dataset, {})[method] = found
            if method == "MAP" and dataset in metrics:
                seeds = sorted(per_seed)
                gap[dataset] = {
                    "train": {
                        n: mean_sd([per_seed[s]["train"][n] for s in seeds]) for n in _METRICS
                    },
                    "test": {n: metrics[dataset]["MAP"][n] for n in _METRICS},
                }
    return {
        "metrics": metrics,
        "map_train_test": gap,
        "laplace": details.get("laplace", {}),
        "blob": details.get("blob", {}),
        "ivon": details.get("ivon", {}),
        "skipped": details.get("skipped", {}),
        "temperature": details.get("temperature", {}),
        "cell_time_s": times,
    }


def _tables(results: dict, datasets: list[str], experiment: Experiment) -> str:
    """Markdown: the settings, one table per metric, MAP's gap, Laplace's choices, verdicts."""
    metrics = results["metrics"]
    rows = list(dict.fromkeys(row for dataset in datasets for row in metrics[dataset]))
    columns = datasets
    # the tasks themselves (the shifted columns have no sizes, fine-tunes or choices)
    datasets = [d for d in datasets if d in experiment.settings["sizes"]]
    parts = [_caption(datasets, experiment)]
    titles = (
        ("accuracy", "Accuracy ↑"),
        ("ece", "ECE ↓"),
        ("nll", "NLL ↓"),
        ("selective_accuracy", f"Accuracy at {SELECTIVE_COVERAGE:.0%} coverage ↑"),
        (
            "shift_auroc",
            "Telling the shifted questions from the task's own by predictive entropy (AUROC) ↑",
        ),
    )
    for name, title in titles:
        table = [
            {
                "method": row,
                **{d: metrics[d][row][name] for d in columns if name in metrics[d].get(row, {})},
            }
            for row in rows
        ]
        shown = [d for d in columns if any(d in row for row in table)]
        if shown:
            parts.append(f"### {title}\n\n" + markdown_table(table, ["method", *shown]))
    verdicts = _verdicts(metrics, columns)
    if verdicts:
        parts.append(
            "### Against MAP and MAP + temperature scaling (test NLL and ECE, means over "
            "seeds)\n\n" + verdicts
        )
    parts.append(
        "### Cost: fine-tuning epochs (wall time of the method's own cells, mean over seeds)\n\n"
        "A fine-tune shared by several rows is timed in the cell that made it: MLE's makes "
        "the ensemble's members, MAP's the checkpoint that MAP+TS, LA and SGHMC start from; "
        "Laplace adds a pass over the training data (one backward pass per class).\n\n"
        + _costs(results, datasets, experiment)
    )
    gap = [
        {"dataset": d, "split": split, **results["map_train_test"][d][split]}
        for d in datasets
        if d in results["map_train_test"]
        for split in ("train", "test")
    ]
    if gap:
        columns = ["dataset", "split", "accuracy", "ece", "nll"]
        parts.append(
            "### MAP on its training subset and on the test subset\n\n"
            + markdown_table(gap, columns)
        )
    chosen = [
        {
            "dataset": d,
            "method": method,
            "seed": seed,
            "link": info.get("link", "mc"),
            "validation NLL": _show_scores(info.get("validation_nll")),
            "prior precision": _show_precision(info["prior_precision"]),
        }
        for d in datasets
        for method, per_seed in results["laplace"].get(d, {}).items()
        for seed, info in per_seed.items()
    ]
    if chosen:
        columns = ["dataset", "method", "seed", "link", "validation NLL", "prior precision"]
        parts.append(
            "### Laplace: what the recipe chose (link on validation data; prior precision "
            "per weight tensor by the evidence: range over tensors)\n\n"
            + markdown_table(chosen, columns)
        )
    ivon = [
        {
            "dataset": d,
            "seed": seed,
            "prior_std": info["prior_std"],
            "temperature": info["temperature"],
            "validation NLL": ", ".join(f"{k}: {v:.3f}" for k, v in info["validation_nll"].items()),
        }
        for d in datasets
        for seed, info in results["ivon"].get(d, {}).get("IVON", {}).items()
    ]
    if ivon:
        columns = ["dataset", "seed", "prior_std", "temperature", "validation NLL"]
        parts.append(
            "### IVON: what the recipe chose (prior scale and temperature, on validation "
            "data)\n\n" + markdown_table(ivon, columns)
        )
    compared = [
        {"dataset": d, "seed": seed, "method": row, **metrics[d][row]["per_seed"][seed]}
        for d in datasets
        if "LA-torch" in metrics[d]
        for seed in metrics[d]["LA-torch"]["per_seed"]
        for row in ("LA", "LA-torch")
        if seed in metrics[d].get(row, {}).get("per_seed", {})
    ]
    if compared:
        parts.append(
            "### Our LA and laplace-torch's on the same MAP checkpoint\n\n"
            + markdown_table(compared, ["dataset", "seed", "method", "accuracy", "ece", "nll"])
        )
    skipped = {m for per in results["skipped"].values() for m in per}
    if skipped:
        reasons = {
            m: next(iter(per[m].values())) for per in results["skipped"].values() for m in per
        }
        parts.append("Not run: " + "; ".join(f"{m} ({reasons[m]})" for m in sorted(skipped)))
    return "\n\n".join(parts)


def _caption(datasets: list[str], experiment: Experiment) -> str:
    sizes = experiment.settings["sizes"]
    lines = [
        f"Seeds {', '.join(map(str, experiment.seeds))}; device {experiment.device}; "
        f"recipe for every method: {experiment.settings['recipe']}.",
        "",
        markdown_table(
            [{"dataset": d, **sizes[d]} for d in datasets],
            ["dataset", "train", "validation", "test", "batch_size", "steps"]
            + ["shift"] * any("shift" in sizes[d] for d in datasets),
        ),
    ]
    return "\n".join(lines)


def _fine_tunes(settings: dict) -> dict[str, float]:
    """How many of the recipe's fine-tunes each method's row rests on, shared ones included:
    the ensemble's members, IVON's one per candidate (prior, temperature), SGHMC's chains
    (each ``sghmc_fraction`` of a fine-tune) after the MAP."""
    single = ("MLE", "MAP", "MAP+TS", "MCD", "BBB", "BLoB", "LA", "LLLA", "LA-torch")
    return {
        **dict.fromkeys(single, 1.0),
        "ENS": float(settings["ensemble_members"]),
        "IVON": float(len(settings["ivon_choices"])),
        "SGHMC": 1.0 + settings["sghmc_chains"] * settings["sghmc_fraction"],
    }


def _costs(results: dict, datasets: list[str], experiment: Experiment) -> str:
    """Each method's cost: fine-tuning epochs, and the measured wall time of its cells."""
    fine_tunes = _fine_tunes(experiment.settings["methods"])
    sizes = experiment.settings["sizes"]
    rows = []
    for method in METHODS:
        row = {"method": method}
        for d in datasets:
            times = results["cell_time_s"].get(d, {}).get(method)
            if times is None or method in results["skipped"].get(d, {}):
                continue
            epochs = sizes[d]["steps"] * sizes[d]["batch_size"] / sizes[d]["train"]
            minutes = sum(t["wall"] for t in times.values()) / len(times) / 60
            row[d] = f"{fine_tunes[method] * epochs:.3g} ({minutes:.1f} min)"
        if len(row) > 1:
            rows.append(row)
    return markdown_table(rows, ["method", *datasets])


def _verdicts(metrics: dict, datasets: list[str]) -> str:
    """Per dataset, the rows that beat MAP, and temperature-scaled MAP, on both NLL and ECE
    (and those that do not)."""
    lines = []
    for d in datasets:
        for baseline in ("MAP", "MAP+TS"):
            if baseline not in metrics[d]:
                continue
            best = metrics[d][baseline]
            better, not_better = [], []
            for row, summary in metrics[d].items():
                if row in ("MAP", "MLE", baseline):
                    continue
                wins = [summary[name]["mean"] < best[name]["mean"] for name in ("nll", "ece")]
                (better if all(wins) else not_better).append(row)
            lines.append(
                f"- {d}: below {baseline} in NLL and ECE: {', '.join(better) or 'none'}; "
                f"not: {', '.join(not_better) or 'none'}"
            )
    return "\n".join(lines)


def _show_scores(scores) -> str:
    if not scores:
        return ""
    return ", ".join(f"{link} {value:.3f}" for link, value in scores.items())


def _show_precision(precision) -> str:
    if isinstance(precision, dict):
        values = [v for v in precision.values() if isinstance(v, float)]
        return f"{min(values):.3g}-{max(values):.3g}" if values else "per entry"
    if isinstance(precision, list):
        return f"{min(precision):.3g}-{max(precision):.3g}"
    return f"{precision:.3g}"


def _diagram(rows: dict, path: Path, dataset: str) -> None:
    """Reliability diagram of the pooled seeds, one panel per method of ``DIAGRAM``."""
    blob = [row for row in rows if row.startswith("BLoB (")]
    chosen = [row for row in DIAGRAM if row in rows] + blob[-1:]
    if not chosen:
        return
    pooled = {}
    for row in chosen:
        per_seed = rows[row].values()
        probs = torch.cat([torch.as_tensor(result["probs"]) for result in per_seed])
        labels = torch.cat([torch.as_tensor(result["labels"]) for result in per_seed])
        pooled[row] = (probs, labels)
    reliability_diagram(pooled, path, title=f"{dataset} (test, seeds pooled)")


if __name__ == "__main__":  # python -m experiments.calibration [options]
    from experiments import main

    main(name="calibration")
