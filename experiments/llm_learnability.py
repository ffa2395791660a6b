"""Which tasks does a short LoRA fine-tune of SmolLM2-135M learn on a CPU? Learning curves,
then MAP, MAP + temperature scaling and Laplace-LoRA on the fine-tune.

Before a calibration comparison means anything, the fine-tune must learn: a table of
Bayesian methods around a model at chance compares ways of being uniform (issue 37: on
OpenBookQA, 40 steps left SmolLM2 at 0.26 accuracy, and temperature scaling won by making
every answer uniform). This experiment measures, for each task, the accuracy and NLL of
``lora_model("smollm2", "multiple_choice", label_token_ids=...)`` on held-out questions
before fine-tuning (zero shot) and every ``eval_every`` steps of AdamW
(:func:`~pyro_bdl.inference.baselines.map_estimate`) against the majority class: the
learning curve (``learning_curves.png``). At the step of lowest validation NLL (early
stopping, chosen on the validation questions) and at the last step (a fine-tune that may
overfit, the regime of the papers' MAP) it scores, on the same test questions, the
reduced comparison of the Laplace-LoRA paper:

- **MAP**: the fine-tune at that step;
- **MAP+TS**: the fine-tune with temperature scaling, one scalar fitted by the NLL on
  the validation questions (:func:`~pyro_bdl.inference.baselines.temperature_scaling`);
- **LA**: Laplace-LoRA post hoc (:func:`~pyro_bdl.inference.fit_laplace_lora`): K-FAC GGN
  at the fine-tune, the prior precision of every weight tensor by the evidence from the
  fan-in prior, the link of the linearised predictive chosen on the validation questions.

Validation and test questions both come from the task's held-out split (SST-2: GLUE's
dev sentences), disjoint: the first ``num_validation`` of a seeded draw validate
(whatever is chosen, the checkpoint's step, the temperature and the link, is chosen
there), the others are only scored.

The tasks (prompts end in the answer's position; the label tokens score the choices):

- ``sst2``: ``Review: {text}\\nSentiment:`` -> `` negative`` / `` positive`` (a template
  of this experiment: SST-2 has none in the papers; these two tokens are the model's
  own top answers after it, zero shot);
- ``imdb``: the same template and tokens on IMDB's film reviews, a second sentiment task
  from another corpus (a long review cut to the prompt length loses its beginning, not
  its end and the answer's position);
- ``boolq``: the passage first, ``{passage}\\nQuestion: {question}? Answer True or
  False.\\nAnswer:`` -> `` False`` / `` True``, so that a long passage cut to the
  prompt length loses its beginning, not the question;
- ``winogrande_s``, ``obqa``, ``arc_easy``: the papers' templates
  (:mod:`pyro_bdl.data.prompts`) -> `` A``, `` B``, ...
- ``arc_easy_text``: ARC-Easy scored by its choices' texts,
  ``Question: {question}\nAnswer:`` followed by each choice, whose tokens'
  log-probability scores it (:class:`~pyro_bdl.models.ChoiceTexts`): how small causal LMs
  answer what they cannot answer with a letter.

**What is scaled down, and why.** On the shared 2-core machine the papers' recipe (LoRA
on every layer's queries and values, thousands of steps) is out of reach. LoRA (rank 8,
alpha 16, dropout 0.1) goes on the queries and values of the **last** ``top_layers``
decoder layers only, so that the frozen layers below them compute the same hidden
states at every step: they are computed once per prompt (:class:`FrozenPrefix`, checked
against the whole model at the start) and the fine-tune runs the top layers alone. LoRA
on the last two of the 30 layers does not learn SST-2 (its training loss does not fall
at lr 1e-3: the adapters move, the answer logits hardly do); on the last 16 it does
(``docs/experiments.md``, section 6). Each chunk of ``eval_every`` steps is one
``map_estimate`` call with a constant learning rate (AdamW's moments restart at each
chunk); the adapters carry over.

Run::

    python -m experiments llm-learnability --data-dir ../shared/data \\
        --out results/llm-learnability --datasets sst2
    python -m experiments llm-learnability --data-dir ../shared/data \\
        --out results/llm-learnability-tasks --datasets arc_easy --seeds 0 \\
        --sizes num_train=256 num_validation=192 num_test=384 num_steps=96 eval_every=32

``--sizes NAME=VALUE ...`` overrides :data:`FULL`'s sizes (the other tasks' prompts are
up to eight times as long as SST-2's, and so is a step); each cell records its own.
"""

from __future__ import annotations

import logging
import math

import torch

from experiments.causal_lm import (
    PROMPTS,
    FrozenPrefix,
    causal_lora,
    causal_tokenizer,
    check_cut,
    hidden_items,
    hidden_loader,
    load_causal_lm,
    whole_model_logits,
)
from experiments.runner import Experiment, markdown_table
from pyro_bdl import metrics
from pyro_bdl.data import RecordDataset, load
from pyro_bdl.inference import fit_laplace_lora
from pyro_bdl.inference.baselines import map_estimate, temperature_scaling
from pyro_bdl.priors import LayerwiseNormal

_logger = logging.getLogger(__name__)

__all__ = ["METHODS", "OPTIONS", "run"]

METHODS = ("MAP", "MAP+TS", "LA")
#: ``--sizes`` overrides :data:`FULL` (or :data:`QUICK`): the tasks' prompts differ in
#: length by a factor of eight, so one set of sizes does not fit every task's time.
OPTIONS = ("sizes",)

#: The CPU run. ``top_layers`` and ``lr`` were chosen by probes of 30-48 steps scored on
#: the first 256 of SST-2's held-out draw, the validation questions here (2 layers: no
#: learning at lr 1e-3 or 1e-2; 8 and 16 layers learn, lr 3e-3 overfits 384 sentences).
FULL = {
    "num_train": 512,
    "num_validation": 256,
    "num_test": 616,
    "top_layers": 16,
    "batch_size": 8,
    "num_steps": 192,
    "eval_every": 48,
    "lr": 1e-3,
    "max_length": 160,
    "marglik_steps": 1000,
}
QUICK = {
    "num_train": 16,
    "num_validation": 8,
    "num_test": 16,
    "top_layers": 1,
    "batch_size": 4,
    "num_steps": 4,
    "eval_every": 2,
    "lr": 1e-3,
    "max_length": 48,
    "marglik_steps": 20,
}
#: Laplace-LoRA's prior, from which the evidence tunes one precision per weight tensor.
LAPLACE_PRIOR = LayerwiseNormal.fan_in(gain=1.0)


def _score(probabilities, items: list[dict]) -> dict[str, float]:
    """Accuracy, NLL, ECE and Brier of ``probabilities(batch) -> (B, C)`` over ``items``."""
    probs, labels = [], []
    for batch in hidden_loader(items, 16):
        probs.append(probabilities(batch).detach())
        labels.append(batch["labels"])
    return metrics.summarize(torch.cat(probs), torch.cat(labels))


def _map_probabilities(lora, values, num_data: int):
    def probabilities(batch):
        with torch.no_grad(), lora.net.fixed(values):
            return torch.softmax(lora.model(batch, num_data), -1)

    return probabilities


def _split(experiment: Experiment, dataset: str, sizes: dict, seed: int):
    """Training records, and disjoint validation and test records from the held-out split.

    The validation records are ``load(..., limit=num_validation, seed=seed)``, the held-out
    records on which :data:`FULL`'s settings were chosen; the test records are a seeded
    draw of ``num_test`` of the others.
    """
    prompting = PROMPTS[dataset]

    def draw(split: str, limit: int | None):
        return load(
            prompting.dataset,
            experiment.data_dir,
            split,
            limit=limit,
            seed=seed,
            **prompting.options,
        )

    validation = list(draw("test", sizes["num_validation"]))
    others = RecordDataset([record for record in draw("test", None) if record not in validation])
    test = list(others.subset(sizes["num_test"], seed))
    return list(draw("train", sizes["num_train"])), validation, test


def _task(experiment: Experiment, dataset: str, sizes: dict, seed: int) -> dict:
    from pyro_bdl.models.smollm2 import smollm2_directory

    prompting = PROMPTS[dataset]
    train, validation, test = _split(experiment, dataset, sizes, seed)
    tokenizer = causal_tokenizer(smollm2_directory())
    ids = prompting.label_token_ids(tokenizer, train[0])
    torch.manual_seed(seed)
    full = load_causal_lm(smollm2_directory())
    collate = prompting.collator(tokenizer, sizes["max_length"])
    # Check the cut on the whole model first (a reference before it is cut).
    reference = whole_model_logits(full, collate, train[:2], ids)
    prefix = FrozenPrefix(full, sizes["top_layers"])
    train_items, validation_items, test_items = (
        hidden_items(prefix, collate, records, sizes["batch_size"])
        for records in (train, validation, test)
    )
    lora = causal_lora(full, prompting, tokenizer, ids)
    num_data = len(train_items)
    cut_error = check_cut(reference, train_items, lora.model)
    num_classes = reference.shape[-1]
    counts = torch.bincount(torch.stack([i["label"] for i in test_items]), minlength=num_classes)
    loader = hidden_loader(train_items, sizes["batch_size"], seed)
    scored = (lora, num_data, validation_items, test_items)
    curve = [_point(0, lora.net.init_values(), *scored)]
    _logger.info("%s step 0: %s", dataset, curve[-1])
    best = None  # (validation NLL, step, predictor): the checkpoint the methods start from
    for step in range(sizes["eval_every"], sizes["num_steps"] + 1, sizes["eval_every"]):
        lora.train()  # the LoRA dropout, as in the papers
        # map_estimate starts from the module's adapters: where the last chunk stopped.
        predictor = map_estimate(
            lora.model,
            loader,
            num_data,
            num_steps=sizes["eval_every"],
            lr=sizes["lr"],
            schedule="constant",
            warmup_ratio=0.0,
            progress=False,
        )
        lora.eval()
        _set_module(lora, predictor.point())
        curve.append(_point(step, predictor.point(), *scored))
        _logger.info("%s step %d: %s", dataset, step, curve[-1])
        if best is None or curve[-1]["validation_nll"] < best[0]:
            best = (curve[-1]["validation_nll"], step, predictor)
    # The methods at the early-stopped fine-tune and at the last (maybe overfitted) one.
    checkpoints = {best[1]: best[2], sizes["num_steps"]: predictor}
    items = (train_items, validation_items, test_items)
    return {
        "curve": curve,
        "checkpoint_step": best[1],
        "methods": {
            str(step): _compare(lora, fitted, *items, sizes)
            for step, fitted in sorted(checkpoints.items())
        },
        "majority": float(counts.max()) / float(counts.sum()),
        "chance_nll": math.log(num_classes),
        "num_train": num_data,
        "num_validation": len(validation_items),
        "num_test": len(test_items),
        # per example: the prompt's tokens, or the sum over its choices' sequences
        "mean_prompt_tokens": sum(map(_tokens, train_items)) / num_data,
        "cut_error": cut_error,
        "settings": dict(sizes),  # each cell its own: a resumed run may use other sizes
    }


def _tokens(item: dict) -> int:
    states = item["h"]
    return sum(len(h) for h in states) if isinstance(states, list) else len(states)


def _point(step: int, values, lora, num_data: int, validation_items, test_items) -> dict:
    """A point of the learning curve: the test scores and the validation NLL at ``values``."""
    probabilities = _map_probabilities(lora, values, num_data)
    return {
        "step": step,
        **_score(probabilities, test_items),
        "validation_nll": _score(probabilities, validation_items)["nll"],
    }


def _compare(lora, predictor, train_items, validation_items, test_items, sizes) -> dict:
    """MAP, MAP + temperature scaling and Laplace-LoRA at the fine-tune ``predictor``
    (:func:`~pyro_bdl.inference.baselines.map_estimate`'s), on the test items."""
    num_data = len(train_items)
    values = predictor.point()
    _set_module(lora, values)
    validation = hidden_loader(validation_items, 16)
    scaled = temperature_scaling(predictor, validation, num_data)
    # Laplace-LoRA's evidence tuning starts from the fan-in prior, not the model's IID one.
    previous, lora.net.prior = lora.net.prior, LAPLACE_PRIOR
    try:
        guide, link, scores = fit_laplace_lora(
            lora.model,
            hidden_loader(train_items, sizes["batch_size"]),
            num_data,
            validation,
            map=dict(values),
            num_steps=sizes["marglik_steps"],
            progress=False,
        )
    finally:
        lora.net.prior = previous
    generator = torch.Generator().manual_seed(0)
    methods = {
        "MAP": _score(_map_probabilities(lora, values, num_data), test_items),
        "MAP+TS": {
            **_score(lambda batch: scaled(batch, num_data).mean(0), test_items),
            "temperature": scaled.temperature,
        },
        "LA": {
            **_score(
                lambda batch: guide.predictive(batch, num_data, generator=generator), test_items
            ),
            "link": link,
            "validation_nll": scores,
            "log_marginal_likelihood": guide.hyperparameters()["log_marginal_likelihood"],
        },
    }
    _logger.info("methods: %s", methods)
    return methods


def _set_module(lora, values) -> None:
    with torch.no_grad():
        for site, value in values.items():
            lora.net.parameter(site).copy_(value)


def run(experiment: Experiment) -> dict:
    """Learning curves of SmolLM2 + LoRA on each task, ``learning_curves.png``, and the
    methods at the last step (``learnability.md``)."""
    sizes = _sizes(QUICK if experiment.quick else FULL, experiment.sizes or {})
    experiment.settings.update(sizes)
    datasets = experiment.selected("datasets", PROMPTS)
    experiment.selected("methods", METHODS)  # refuses a name it does not have, before any work
    results = {}
    for dataset in datasets:
        for seed in experiment.seeds[:1]:
            results[dataset] = experiment.cell(
                (dataset, "MAP", seed), lambda d=dataset, s=seed: _task(experiment, d, sizes, s)
            )
    curves, methods = [], []
    for dataset, result in results.items():
        first, last = result["curve"][0], result["curve"][-1]
        best = max(result["curve"], key=lambda point: point["accuracy"])
        curves.append(
            {
                "dataset": dataset,
                "majority": result["majority"],
                "zero-shot acc": first["accuracy"],
                "final acc": last["accuracy"],
                "best acc (step)": f"{best['accuracy']:.3f} ({best['step']})",
                "zero-shot NLL": first["nll"],
                "final NLL": last["nll"],
                "chance NLL": result["chance_nll"],
            }
        )
        for step, scores_of in result["methods"].items():
            for method, scores in scores_of.items():
                row = {"dataset": dataset, "step": step, "method": method}
                methods.append({**row, **_numbers(scores)})
    columns = ["dataset", "step", "method", "accuracy", "nll", "ece", "brier"]
    tables = [markdown_table(curves, list(curves[0]) if curves else ["dataset"])]
    tables.append(markdown_table(methods, columns))
    print("\n\n".join(tables))
    (experiment.out / "learnability.md").write_text("\n\n".join(tables) + "\n")
    _plot(results, experiment.out / "learning_curves.png")
    experiment.write_results(results)
    return results


def _sizes(defaults: dict, overrides: dict) -> dict:
    """``defaults`` with ``overrides`` (``--sizes``), checked: known names, numbers of
    the default's kind (an int where the default is one), counts >= 1, a lr > 0."""
    unknown = sorted(set(overrides) - set(defaults))
    if unknown:
        raise ValueError(f"--sizes: {unknown} are not among {sorted(defaults)}")
    sizes = dict(defaults)
    for name, value in overrides.items():
        if isinstance(defaults[name], int) and not isinstance(value, int):
            raise ValueError(f"--sizes: {name} must be an int, got {value!r}")
        if not value > 0:
            raise ValueError(f"--sizes: {name} must be > 0, got {value!r}")
        sizes[name] = type(defaults[name])(value)
    if sizes["num_steps"] % sizes["eval_every"]:
        raise ValueError(
            f"--sizes: num_steps ({sizes['num_steps']}) must be a multiple of eval_every "
            f"({sizes['eval_every']}), the steps between two points of the learning curve"
        )
    return sizes


def _numbers(scores: dict) -> dict:
    return {key: value for key, value in scores.items() if isinstance(value, float)}


def _plot(results: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for dataset, result in results.items():
        steps = [point["step"] for point in result["curve"]]
        line = left.plot(steps, [p["accuracy"] for p in result["curve"]], marker="o", label=dataset)
        left.axhline(result["majority"], color=line[0].get_color(), linestyle=":", linewidth=1)
        right.plot(steps, [p["nll"] - result["chance_nll"] for p in result["curve"]], marker="o")
    left.set(xlabel="fine-tuning steps", ylabel="test accuracy (dotted: majority class)")
    right.set(xlabel="fine-tuning steps", ylabel="test NLL - ln(choices)")
    right.axhline(0.0, color="grey", linewidth=1)
    left.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


if __name__ == "__main__":  # python -m experiments.llm_learnability [options]
    from experiments import main

    main(name="llm-learnability")
