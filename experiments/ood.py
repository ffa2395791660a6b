"""Out-of-distribution detection by epistemic uncertainty: posteriors paper, Table 1 and Fig. 7.

all-MiniLM-L6-v2 with LoRA (rank 8, alpha 16, dropout 0.1, queries and values) and a new
head is fine-tuned as a sentiment classifier on English (an SST-2 subset), then asked
about sentences it was never trained on: FLORES-200 English sentences (in distribution:
the language it knows) and the same sentences in Samoan (out of distribution). Each
method's class probabilities ``(S, B, 2)``, one softmax per weight draw, split into
total uncertainty :math:`\\mathrm{TU} = H[\\bar p]` and epistemic uncertainty
:math:`\\mathrm{EU} = \\mathrm{TU} - \\frac1S \\sum_s H[p_s]` (eq. 2,
:func:`pyro_bdl.metrics.uncertainty_decomposition`); the AUROC of each score for telling
Samoan from English measures how well it flags the unknown language. The methods:

- **MAP**: the training recipe of the calibration experiment (AdamW, linear warm-up then
  decay, :func:`~experiments.lora_finetune.training_recipe`) with weight decay
  1e-5 (the paper's SGD baseline; one draw, so TU only).
- **MAP+TS**: the MAP with temperature scaling fitted on the SST-2 validation subset
  (:func:`~pyro_bdl.inference.baselines.temperature_scaling`): one draw, so TU only; a
  temperature reorders no sentence's confidence in a two-class problem, so its TU AUROC is
  MAP's, and any Bayesian row's EU above it is more than a rescaling.
- **SGHMC (parallel)**: 4 chains at temperature 1 started at the MAP, one epoch each,
  the last draw of each (a Bayesian deep ensemble, the paper's parallel SGHMC).
- **SGHMC (serial)**: one chain from the MAP as long as the four together, 8 draws
  evenly spaced along it (the paper's serial SGHMC).
- **ENS**: a deep ensemble of 4 MAP fine-tunes, each from its own initialisation and
  batch order (the seed's MAP and 3 more): the paper's parallel SGHMC at T = 0.
- **SGHMC-ensemble**: one SGHMC epoch at T = 1 from each member of ENS, the last draw of
  each: parallel SGHMC as the paper runs it, trajectories from independent starts (the
  chains of **SGHMC (parallel)** above all start at the one MAP).
- **BLoB** (the same recipe, 10 draws) and **LA** (the Laplace recipe of
  :func:`~experiments.lora_finetune.laplace`: K-FAC GGN at the MAP, per-tensor
  evidence-tuned prior, 100 draws of the linearised predictive's logits; the link is fixed
  to ``"mc"`` here, since the epistemic split needs draws).

Each method also reports accuracy and NLL on the SST-2 test subset (the check that the
fine-tune worked, the paper's "loss on English statements"). Sizes (``FULL``, ``QUICK``)
are chosen so that a full run of 3 seeds takes about 85 minutes of one CPU core (a third
of it the ensemble's extra fine-tunes); with ``--device cuda`` the fine-tune uses 8,192
SST-2 sentences and all 1,012 FLORES sentences.

Outputs in ``--out``: ``results.json``, ``ood.md`` (the table), ``ood_hist.png`` (TU and
EU of MAP and the SGHMC methods on English and Samoan, the paper's Figures 7 and 10),
``ood_hist_ensembles.png`` (ENS and SGHMC-ensemble), ``ood_hist_laplace_blob.png`` (LA
and BLoB), ``cells/`` and ``checkpoints/``.

Run::

    python -m experiments ood --data-dir ../shared/data --out results/ood
"""

from __future__ import annotations

import pyro
import torch

from experiments.lora_finetune import (
    LORA,
    PRIOR_SCALE,
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
    minilm_tokenizer,
    point_draws,
    predict,
    sghmc_chains,
    single_thread,
    temperature_scaled,
    training_recipe,
)
from experiments.runner import Experiment, markdown_table, mean_sd
from pyro_bdl.data import RecordDataset, load
from pyro_bdl.diagnostics import function_space
from pyro_bdl.inference import BLoBGuide, fit_blob
from pyro_bdl.metrics import auroc, uncertainty_decomposition
from pyro_bdl.plots import plot_uncertainty_histograms

__all__ = ["run", "FULL", "QUICK", "METHODS"]

METHODS = ("MAP", "MAP+TS", "SGHMC-serial", "SGHMC-parallel", "ENS", "SGHMC-ensemble", "BLoB", "LA")

#: The one-draw rows: total uncertainty only (no epistemic part).
POINT_METHODS = ("MAP", "MAP+TS")

#: The full run: about 85 minutes of one CPU core for 3 seeds.
FULL = {
    "task": TaskSpec("sst2", 1024, 300, max_length=64, batch_size=32, validation_size=200),
    "flores_sentences": 400,
    "chains": 4,
    "serial_draws": 8,
    "sghmc": {"step_size": 0.03, "friction": 1.0, "temperature": 1.0},
    "blob_samples": 10,
    "laplace_samples": 100,
    "marglik_steps": 1000,
}
#: The CI run (the numbers mean nothing).
QUICK = {
    **FULL,
    "task": TaskSpec("sst2", 16, 16, max_length=32, batch_size=8, epochs=1, validation_size=8),
    "flores_sentences": 16,
    "chains": 2,
    "serial_draws": 4,  # the fewest for which R-hat is defined
    "blob_samples": 3,
    "laplace_samples": 20,
    "marglik_steps": 20,
}
#: The GPU run: a larger fine-tune and every FLORES-200 devtest sentence.
PAPER = {
    **FULL,
    "task": TaskSpec("sst2", 8192, None, max_length=64, batch_size=32, validation_size=200),
    "flores_sentences": None,
}
#: Which FLORES-200 split the sentences come from, and the two languages.
FLORES_SPLIT = "devtest"
LANGUAGES = {"english": "eng_Latn", "samoan": "smo_Latn"}


def run(experiment: Experiment) -> dict:
    """One thread; see :func:`~experiments.lora_finetune.single_thread`."""
    with single_thread():
        return _run(experiment)


def _run(experiment: Experiment) -> dict:
    """Fine-tune on SST-2, score English and Samoan sentences; write results and figures."""
    settings = QUICK if experiment.quick else PAPER if experiment.on_gpu else FULL
    experiment.selected("datasets", ["sst2"])
    methods = experiment.selected("methods", METHODS)
    experiment.settings = {
        "model": "all-MiniLM-L6-v2 + LoRA on query/value, new head",
        "lora": LORA,
        "prior_scale": PRIOR_SCALE,
        "flores_split": FLORES_SPLIT,
        **{k: v.asdict() if isinstance(v, TaskSpec) else v for k, v in settings.items()},
    }
    task = Task(settings["task"], experiment.data_dir, minilm_tokenizer())
    experiment.settings["sizes"] = task.sizes()
    experiment.settings["recipe"] = {**training_recipe(task), "map_weight_decay": WEIGHT_DECAY}
    sentences = _flores(experiment.data_dir, settings["flores_sentences"])
    cells: dict[str, dict[int, dict]] = {}
    for seed in experiment.seeds:
        for method in methods:
            cell = experiment.cell(
                ("sst2", method, seed),
                lambda method=method, seed=seed: _score(
                    method, task, sentences, seed, settings, experiment
                ),
            )
            cells.setdefault(method, {})[seed] = cell
    results = _summaries(cells)
    table = markdown_table(
        [{"method": method, **row} for method, row in results["table"].items()],
        ["method", "AUROC TU", "AUROC EU", "SST-2 accuracy", "SST-2 NLL", *_RHAT_COLUMNS],
    )
    table += (
        "\n\nfunction R-hat: the largest split R-hat of the SST-2 test sentences' class "
        "probabilities over the serial chain's draws (its two halves compared; Izmailov et "
        "al. 2021, pyro_bdl.diagnostics.function_space), nan with fewer than 4 draws; "
        "independent: the largest that independent draws as many reach over as many "
        "sentences (pyro_bdl.diagnostics.independent_max_rhat), a function R-hat at or "
        "below which is no evidence against convergence; the other methods keep one draw "
        "per chain or none, for which R-hat is not defined"
    )
    (experiment.out / "ood.md").write_text(table + "\n")
    _histograms(cells, experiment)
    experiment.write_results(results)
    print(table)
    return results


def _flores(data_dir, count: int | None) -> dict[str, RecordDataset]:
    """The same ``count`` FLORES sentences in English and in Samoan (line-aligned; None: all)."""
    sentences = {}
    for name, language in LANGUAGES.items():
        records = load("flores", data_dir, FLORES_SPLIT, language=language, limit=count)
        # a placeholder label: the collator wants one, the predictions ignore it
        sentences[name] = RecordDataset([{"text": r["text"], "label": 0} for r in records])
    return sentences


class _Fits:
    """A seed's MAP fine-tunes, from disk when already made: the seed's own and the members'.

    Member ``i > 0`` of seed ``s`` starts from its own initialisation and batch order
    (seed ``s + 1000 i``); member 0 is the seed's MAP, which every other method starts from.
    """

    def __init__(self, task: Task, seed: int, experiment: Experiment):
        self.task, self.seed, self.experiment = task, seed, experiment
        self.map = self.member(0)

    def member(self, index: int) -> dict[str, torch.Tensor]:
        name = "map.safetensors" if index == 0 else f"map_member{index}.safetensors"
        path = self.experiment.out / "checkpoints" / f"seed{self.seed}" / name
        seed, device = self.seed + 1000 * index, self.experiment.device
        return checkpoint(
            path, lambda: fine_tune_map(Network(self.task, seed, device), self.task, seed), device
        )

    def members(self, count: int) -> list[dict[str, torch.Tensor]]:
        return [self.map] + [self.member(index) for index in range(1, count)]


def _score(method, task, sentences, seed, settings, experiment) -> dict:
    """One method and seed: its draws' probabilities on both languages and on SST-2."""
    pyro.clear_param_store()
    # the MAP first: the network below is then seeded alike for every method
    fits = _Fits(task, seed, experiment)
    network = Network(task, seed, experiment.device)
    pyro.set_rng_seed(seed)
    draws = _DRAWS[method](network, task, fits, seed, settings)
    result = {}
    probs, labels = predict(draws, task.test_loader())
    result["sst2"] = evaluate(probs, labels)
    if method == "SGHMC-serial":  # one chain of draws: its halves' function-space R-hat
        fs = function_space(probs.double()[None])
        result["function_rhat"] = fs.max_rhat
        result["function_rhat_independent"] = fs.independent_max_rhat
    for name, records in sentences.items():
        probs, _ = predict(draws, task.eval_loader(records))
        split = uncertainty_decomposition(probs.double())
        result[name] = {"total": split.total, "epistemic": split.epistemic}
    return result


def _map(network, task, fits, seed, settings):
    return point_draws(network.model, [fits.map])


def _map_ts(network, task, fits, seed, settings):
    return temperature_scaled(_map(network, task, fits, seed, settings), task)


def _serial(network, task, fits, seed, settings):
    """One chain from the MAP, draws evenly spaced along it."""
    steps = settings["chains"] * task.steps_per_epoch
    chain = _sghmc(
        network, task, fits.map, 1000 * seed, settings, 1, steps, settings["serial_draws"]
    )
    return point_draws(network.model, chain)


def _parallel(network, task, fits, seed, settings):
    """Chains from the MAP, one epoch each, the last draw of each."""
    steps = task.steps_per_epoch
    chains = _sghmc(network, task, fits.map, 1000 * seed, settings, settings["chains"], steps, 1)
    return point_draws(network.model, chains)


def _ensemble(network, task, fits, seed, settings):
    """The MAP fine-tunes of independent initialisations and batch orders (T = 0)."""
    return point_draws(network.model, fits.members(settings["chains"]))


def _sghmc_ensemble(network, task, fits, seed, settings):
    """One chain from each member of the ensemble, one epoch, the last draw of each."""
    draws = []
    for index, start in enumerate(fits.members(settings["chains"])):
        draws += _sghmc(
            network, task, start, 1000 * seed + index, settings, 1, task.steps_per_epoch, 1
        )
    return point_draws(network.model, draws)


def _sghmc(network, task, start, chain_seed, settings, num_chains, steps, num_samples):
    return sghmc_chains(
        network.model,
        task,
        start,
        num_chains=num_chains,
        steps=steps,
        num_samples=num_samples,
        seed=chain_seed,
        **settings["sghmc"],
    )


def _blob(network, task, fits, seed, settings):
    model = network.blob_model()
    network.train()
    guide = BLoBGuide(model, model.net, prior_std=PRIOR_SCALE)
    fit_blob(
        model,
        guide,
        task.train_loader(seed),
        task.num_data,
        progress=False,
        **training_recipe(task),
    )
    network.eval()
    return guide_draws(model, guide, settings["blob_samples"])


def _la(network, task, fits, seed, settings):
    # the epistemic split needs logit draws: the link is "mc", not chosen
    guide, _ = laplace(network.model, task, fits.map, settings["marglik_steps"], links=("mc",))
    return laplace_draws(guide, settings["laplace_samples"], seed)


_DRAWS = {
    "MAP": _map,
    "MAP+TS": _map_ts,
    "SGHMC-serial": _serial,
    "SGHMC-parallel": _parallel,
    "ENS": _ensemble,
    "SGHMC-ensemble": _sghmc_ensemble,
    "BLoB": _blob,
    "LA": _la,
}


def _auroc(cell: dict, score: str) -> float:
    english = torch.as_tensor(cell["english"][score], dtype=torch.float64)
    samoan = torch.as_tensor(cell["samoan"][score], dtype=torch.float64)
    is_samoan = torch.cat([torch.zeros(len(english)), torch.ones(len(samoan))])
    return auroc(torch.cat([english, samoan]), is_samoan)


def _summaries(cells: dict) -> dict:
    """AUROC of TU and EU and the SST-2 metrics, per seed and as mean +- sd."""
    per_seed, table = {}, {}
    for method, seeds in cells.items():
        rows = {}
        for seed, cell in seeds.items():
            rows[seed] = {
                "auroc_total": _auroc(cell, "total"),
                "auroc_epistemic": (
                    _auroc(cell, "epistemic") if method not in POINT_METHODS else None
                ),
                "sst2": cell["sst2"],
                "mean_uncertainty": {
                    language: {
                        s: float(torch.as_tensor(cell[language][s]).mean())
                        for s in ("total", "epistemic")
                    }
                    for language in LANGUAGES
                },
            }
        per_seed[method] = rows
        values = list(rows.values())
        table[method] = {
            "AUROC TU": mean_sd([r["auroc_total"] for r in values]),
            "AUROC EU": (
                mean_sd([r["auroc_epistemic"] for r in values])
                if method not in POINT_METHODS
                else "-"
            ),
            "SST-2 accuracy": mean_sd([r["sst2"]["accuracy"] for r in values]),
            "SST-2 NLL": mean_sd([r["sst2"]["nll"] for r in values]),
            **{
                column: (
                    mean_sd([seeds[s][key] for s in seeds])
                    if all(key in cell for cell in seeds.values())
                    else "-"
                )
                for column, key in _RHAT_COLUMNS.items()
            },
        }
    return {"table": table, "per_seed": per_seed}


#: The function-space columns of the table: the serial chain's and independent draws'.
_RHAT_COLUMNS = {
    "function R-hat": "function_rhat",
    "independent": "function_rhat_independent",
}


def _histograms(cells: dict, experiment: Experiment) -> None:
    """TU and EU on English and Samoan, seeds pooled, one panel per method and score."""

    def pooled(method: str, score: str) -> tuple[torch.Tensor, torch.Tensor]:
        seeds = cells[method].values()
        return tuple(
            torch.cat([torch.as_tensor(cell[language][score]) for cell in seeds])
            for language in LANGUAGES
        )

    figures = {
        "ood_hist.png": ("MAP", "SGHMC-serial", "SGHMC-parallel"),
        "ood_hist_ensembles.png": ("ENS", "SGHMC-ensemble"),
        "ood_hist_laplace_blob.png": ("LA", "BLoB"),
    }
    for name, methods in figures.items():
        panels = {}
        for method in methods:
            if method not in cells:
                continue
            panels[f"{method} TU"] = pooled(method, "total")
            if method not in POINT_METHODS:
                panels[f"{method} EU"] = pooled(method, "epistemic")
        if panels:
            plot_uncertainty_histograms(panels, experiment.out / name, labels=("English", "Samoan"))


if __name__ == "__main__":  # python -m experiments.ood [options]
    from experiments import main

    main(name="ood")
