r"""The cold posterior effect: tempered Laplace, VI and SGHMC on the CNN-LSTM on IMDB.

The posteriors paper (section 5.1, Figure 4; Appendix D, Figures 8 and 9) compares, across
temperatures :math:`T`, the test loss and accuracy of approximations to the tempered
posterior

.. math:: p_T(\theta \mid y_{1:N}) \propto p(\theta \mid y_{1:N})^{1/T}
    = \big(p(\theta) \textstyle\prod_i p(y_i \mid \theta)\big)^{1/T},

for the CNN-LSTM of Wenzel et al. (2020) with the prior :math:`\mathcal{N}(0, 1/40)` on
every weight, against MAP and maximum likelihood. Each method takes :math:`T` its own way:

- **Laplace** (diagonal, empirical Fisher ``"diag_ef"`` or GGN ``"diag_ggn"``, at the MAP
  as AdamW leaves it, not refined to the mode):
  the covariance is :math:`T P^{-1}`; predictions average the softmax over weight draws
  ("sampled weights") or over logit draws of the linearised network ("linearised GGN",
  the GLM predictive);
- **VI** (mean-field Gaussian, log standard deviations starting at -3, sticking the
  landing, one draw per step): the objective is
  :math:`-\mathbb{E}_q \log p(y \mid \theta) + T\,\mathrm{KL}(q \,\|\, p^{1/T})`;
- **SGHMC** (step size 0.1, friction 1): the injected noise has variance proportional to
  :math:`T` (posteriors paper, eq. 3); *serial* keeps thinned draws of one long chain after
  burn-in, *parallel* keeps the last draw of independently initialised chains (a Bayesian
  deep ensemble, section 4.2).

The paper's expectations: a strong cold posterior effect (much better at :math:`T < 1`)
for the Gaussian approximations, a mild one for SGHMC, and parallel SGHMC at least as
good as serial.

**Laptop-scale settings.** The paper trains on all 25,000 reviews for 30 epochs (serial
SGHMC 60) with five seeds on a GPU in about a day. Here (2 CPU cores, 90 minutes) the
full run uses a random subset of 4,000 training reviews and 1,500 test reviews, a
vocabulary of the 20,000 most frequent words of the training subset (reviews cut to
their last 100 words), batch size 32, and

- MAP, MLE and VI: 4 epochs of AdamW (learning rate 1e-3, weight decay 0.01: TorchOpt's
  defaults, as in the paper); MAP reaches 95% training accuracy (70% test) by then;
- *burn-in by optimisation*: from a random initialisation the paper's SGHMC chains and
  VI use most of their 23,000 steps to learn at all; with 500-1,000 steps here SGHMC
  (step size 0.1) stays at chance accuracy and VI (its means started at the
  initialisation, standard deviations at :math:`e^{-3}`) at 52-57%. So VI's means and
  the serial SGHMC chain start at the seed's MAP, and each parallel chain at its own
  AdamW fit (4 epochs from its own initialisation: a deep ensemble member);
- VI: 16 epochs from the MAP (2,000 steps), one draw per step, sticking the landing,
  AdamW at learning rate 1e-3 on the means and 1e-2 on the log standard deviations: with
  one rate of 1e-3 for both, 4 epochs moved the log standard deviations by at most 0.5
  from their start at -3, so every temperature gave the same answer. Each cell reports
  the mean learned standard deviation beside its starting value (``vi_scale``), the check
  that the temperature acted;
- SGHMC (the paper's step size 0.1 and friction 1): the serial chain runs 4 epochs, the
  first 40% discarded, then 10 draws evenly thinned (the paper: 60 epochs, 20,000 steps
  burn-in, 27 draws); each parallel chain runs 2 epochs and keeps its last draw;
- parallel SGHMC: a pool of 4 chains per temperature; the ensemble of seed ``s`` is a
  random subset of 3 of them drawn with seed ``s``, as the paper bootstraps 5 ensembles
  of 15 from a pool of 35 chains;
- 16 weight draws for the sampled predictives (the paper: 50) and 10,000 logit draws for
  the linearised one.

Seeds change the initialisation, the minibatch order and the sampling noise, not the data
subset. With ``--device cuda`` the run uses all 25,000 training reviews, 5,000 test
reviews and longer runs (``SETTINGS["gpu"]``). Torch runs on one thread: on two cores
shared with other jobs, two threads spin-wait for each other. ``--quick`` (CI) uses 128
training and 128 test reviews, a 1,000-word vocabulary, one epoch for everything, pools
of 2 chains and 3 weight draws.

**References**

[1] S. Duffield et al. Scalable Bayesian learning with posteriors. ICLR 2025, section 5.1
and Appendix D.
[2] F. Wenzel et al. How good is the Bayes posterior in deep neural networks really?
ICML 2020.
[3] P. Izmailov et al. What are Bayesian neural network posteriors really like? ICML 2021.

Example::

    python -m experiments cold-posterior --data-dir ../shared/data --out results/cold --quick

:func:`run` writes ``results.json`` and ``cold_posterior.png`` into the output directory
and prints the tables of test NLL and accuracy against temperature.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyro
import torch
from matplotlib.figure import Figure
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide.initialization import init_to_value
from torch.utils.data import DataLoader
from tqdm.auto import trange

from experiments.lora_finetune import checkpoint, single_thread
from experiments.runner import Experiment, markdown_table, mean_sd
from pyro_bdl.data import WordCollator, WordVocabulary, load, make_loader
from pyro_bdl.diagnostics import function_space
from pyro_bdl.inference import SGHMC, Chains, LaplaceGuide, MeanFieldGuide, Minibatches, fit_map
from pyro_bdl.metrics import summarize
from pyro_bdl.models import CNNLSTM, cnn_lstm_model
from pyro_bdl.predict import predict_proba

__all__ = ["run", "TEMPERATURES", "METHODS", "SETTINGS"]

TEMPERATURES = (0.01, 0.1, 0.3, 1.0)

#: ``--methods`` name -> label in tables and figures.
METHODS = {
    "map": "MAP",
    "mle": "MLE",
    "laplace_ef": "Laplace EF",
    "laplace_ggn": "Laplace GGN",
    "laplace_ggn_linearised": "Laplace GGN (linearised)",
    "vi": "VI",
    "sghmc_serial": "SGHMC (serial)",
    "sghmc_parallel": "SGHMC (parallel)",
}

# The parallel chains' initialisations and noise are seeded from here on, apart from the seeds'.
_POOL_SEED = 1000

# Laplace curvature and predictive of each Laplace method.
_LAPLACE = {
    "laplace_ef": ("diag_ef", False),
    "laplace_ggn": ("diag_ggn", False),
    "laplace_ggn_linearised": ("diag_ggn", True),
}

SETTINGS = {
    "full": {
        "train_size": 4000,
        "test_size": 1500,
        "vocab_size": 20_000,
        "review_length": 100,
        "prior_variance": 1 / 40,
        "batch_size": 32,
        "eval_batch_size": 500,
        "epochs": 4,
        "learning_rate": 1e-3,
        "step_size": 0.1,
        "friction": 1.0,
        "serial_epochs": 4,
        "serial_burn_in_fraction": 0.4,
        "serial_draws": 10,
        "sghmc_epochs": 2,
        "parallel_pool": 4,
        "parallel_ensemble": 3,
        "weight_draws": 16,
        "logit_draws": 10_000,
        "vi_init_log_scale": -3.0,
        "vi_epochs": 16,
        "vi_scale_learning_rate": 1e-2,
    },
    "quick": {
        "train_size": 128,
        "test_size": 128,
        "vocab_size": 1_000,
        "review_length": 100,
        "prior_variance": 1 / 40,
        "batch_size": 32,
        "eval_batch_size": 128,
        "epochs": 1,
        "learning_rate": 1e-3,
        "step_size": 0.1,
        "friction": 1.0,
        "serial_epochs": 1,
        "serial_burn_in_fraction": 0.5,
        "serial_draws": 4,  # the fewest for which R-hat is defined
        "sghmc_epochs": 1,
        "parallel_pool": 2,
        "parallel_ensemble": 2,
        "weight_draws": 3,
        "logit_draws": 1_000,
        "vi_init_log_scale": -3.0,
        "vi_epochs": 1,
        "vi_scale_learning_rate": 1e-2,
    },
}
#: The GPU run: the full IMDB training set and longer runs (the paper: 30 epochs, serial
#: SGHMC 60, pools of 35 chains).
SETTINGS["gpu"] = {
    **SETTINGS["full"],
    "train_size": 25_000,
    "test_size": 5_000,
    "epochs": 10,
    "serial_epochs": 20,
    "sghmc_epochs": 5,
    "parallel_pool": 8,
    "parallel_ensemble": 5,
    "vi_epochs": 30,
}


@dataclass
class _Data:
    """The IMDB subsets, encoded for the CNN-LSTM."""

    train: object
    collate: WordCollator
    vocab_size: int
    test_batches: list[dict[str, torch.Tensor]]
    test_labels: torch.Tensor

    @property
    def num_data(self) -> int:
        return len(self.train)

    def train_loader(self, seed: int, batch_size: int) -> DataLoader:
        return make_loader(self.train, self.collate, batch_size, shuffle=True, seed=seed)

    def test_loader(self) -> DataLoader:
        # batch_size=None hands out the collated batches as they are.
        return DataLoader(self.test_batches, batch_size=None)


def run(experiment: Experiment) -> dict:
    """Run the cold-posterior experiment; write ``results.json`` and ``cold_posterior.png``.

    :param Experiment experiment: where to read the data and write the results; its
        ``datasets`` may only name ``imdb``, its ``methods`` any keys of :data:`METHODS`.
    :return: the results: one row per method, temperature and seed (``rows``) and their
        mean and standard deviation over seeds (``summary``).
    """
    settings = SETTINGS["quick" if experiment.quick else "gpu" if experiment.on_gpu else "full"]
    experiment.settings = {
        **settings,
        "temperatures": list(TEMPERATURES),
        "sizes": {"train": settings["train_size"], "test": settings["test_size"]},
    }
    experiment.selected("datasets", ["imdb"])
    methods = experiment.selected("methods", list(METHODS))
    data = _load_data(experiment.data_dir, settings)
    runner = _Runner(experiment, settings, data)
    rows = []
    with single_thread():
        for seed in experiment.seeds:
            for method in methods:
                if method != "sghmc_parallel":
                    rows += runner.method_rows(method, seed)
        if "sghmc_parallel" in methods:
            rows += runner.parallel_rows(experiment.seeds)
    summary = _summary(rows)
    results = {"rows": rows, "summary": summary}
    _plot(summary, experiment.out / "cold_posterior.png")
    print(_tables(summary))
    experiment.write_results(results)
    return results


def _load_data(data_dir: Path, settings: Mapping) -> _Data:
    # One fixed subset for every seed: seeds vary the initialisation and the noise.
    train = load("imdb", data_dir, "train", limit=settings["train_size"], seed=0)
    test = load("imdb", data_dir, "test", limit=settings["test_size"], seed=0)
    vocabulary = WordVocabulary.build((r["text"] for r in train), settings["vocab_size"])
    collate = WordCollator(vocabulary, settings["review_length"])
    test_loader = make_loader(test, collate, settings["eval_batch_size"])
    test_batches = list(test_loader)
    labels = torch.cat([batch["labels"] for batch in test_batches])
    return _Data(train, collate, len(vocabulary), test_batches, labels)


class _Runner:
    """Fits and scores each method; every result is a cached cell of the experiment."""

    def __init__(self, experiment: Experiment, settings: Mapping, data: _Data):
        self.experiment = experiment
        self.settings = settings
        self.data = data
        self.progress = sys.stderr.isatty()
        self.steps_per_epoch = math.ceil(data.num_data / settings["batch_size"])
        self.checkpoints = experiment.out / "checkpoints"
        self.checkpoints.mkdir(exist_ok=True)

    # -- the model -----------------------------------------------------------------

    def model(self, init_seed: int):
        """The Bayesian CNN-LSTM, its weights initialised from ``init_seed``."""
        with torch.random.fork_rng():
            torch.manual_seed(init_seed)
            net = CNNLSTM(self.data.vocab_size)
        return cnn_lstm_model(net.to(self.experiment.device), self.settings["prior_variance"])

    def train_args(self, seed: int) -> tuple[DataLoader, int]:
        return self.data.train_loader(seed, self.settings["batch_size"]), self.data.num_data

    def score(self, model: Callable, samples: Mapping[str, torch.Tensor]) -> dict[str, float]:
        """Test metrics of the predictive averaged over weight draws."""
        return summarize(self.predict(model, samples).mean(0), self.data.test_labels)

    def predict(
        self,
        model: Callable,
        samples: Mapping[str, torch.Tensor],
        batches: Sequence[Mapping[str, torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        """Class probabilities ``(draws, reviews, classes)`` of ``batches`` (default: test)."""
        batches = self.data.test_batches if batches is None else batches
        return torch.cat(
            [
                predict_proba(model, batch, self.data.num_data, samples=samples).cpu()
                for batch in batches
            ],
            dim=1,
        )

    # -- methods -------------------------------------------------------------------

    def method_rows(self, method: str, seed: int) -> list[dict]:
        """The rows of one method and seed (one per temperature, or one for MAP and MLE)."""
        label = METHODS[method]
        if method in ("map", "mle"):
            result = self.cell((method, seed), lambda: self.point_estimate(method, seed))
            return [{"method": label, "temperature": None, "seed": seed, **result}]
        if method in _LAPLACE:
            by_temperature = self.cell((method, seed), lambda: self.laplace(method, seed))
            return [
                {"method": label, "temperature": t, "seed": seed, **by_temperature[str(t)]}
                for t in TEMPERATURES
            ]
        fit = {"vi": self.variational, "sghmc_serial": self.serial_sghmc}[method]
        return [
            {
                "method": label,
                "temperature": t,
                "seed": seed,
                **self.cell((method, f"T={t}", seed), lambda t=t: fit(t, seed)),
            }
            for t in TEMPERATURES
        ]

    def cell(self, key: Sequence, compute: Callable[[], dict]) -> dict:
        return self.experiment.cell(("imdb", *key), compute)

    def map_values(self, seed: int, mle: bool = False) -> dict[str, torch.Tensor]:
        """The MAP (or MLE) from the initialisation of ``seed``, kept on disk.

        It is where Laplace, VI and the serial SGHMC chain of the seed start, and each
        parallel chain's starting point (seeds 1000, 1001, ...).
        """
        path = self.checkpoints / f"{'mle' if mle else 'map'}_seed{seed}.safetensors"

        def fit() -> dict[str, torch.Tensor]:
            pyro.clear_param_store()
            return fit_map(
                self.model(seed),
                *self.train_args(seed),
                num_steps=self.settings["epochs"] * self.steps_per_epoch,
                optimizer=pyro.optim.AdamW({"lr": self.settings["learning_rate"]}),
                mle=mle,
                progress=self.progress,
            )

        return checkpoint(path, fit, self.experiment.device)

    def point_estimate(self, method: str, seed: int) -> dict:
        model = self.model(seed)
        values = self.map_values(seed, mle=method == "mle")
        samples = {name: value.unsqueeze(0) for name, value in values.items()}
        # The train/test gap shows the overfitting regime the Bayesian methods start from.
        train_batches = list(make_loader(self.data.train, self.data.collate, 500))
        train_probs = self.predict(model, samples, train_batches)
        train_labels = torch.cat([b["labels"] for b in train_batches])
        train = summarize(train_probs.mean(0), train_labels)
        return {
            **self.score(model, samples),
            "train_accuracy": train["accuracy"],
            "train_nll": train["nll"],
        }

    def laplace(self, method: str, seed: int) -> dict:
        curvature, linearised = _LAPLACE[method]
        model = self.model(seed)
        guide = LaplaceGuide(model, curvature=curvature)
        loader, num_data = self.train_args(seed)
        # At the AdamW endpoint that VI and the serial SGHMC chain start from too, as the
        # posteriors paper takes its Laplace at its optimiser's endpoint. That point is not
        # the mode of this prior's posterior (AdamW's decoupled decay, a few epochs; the
        # fit's mode check puts it thousands of standard deviations away), and refining it
        # by full-batch L-BFGS costs up to 100 passes of the training set, hours on a CPU.
        guide.fit(
            loader,
            num_data,
            map=self.map_values(seed),
            mode_tolerance=None,
            progress=self.progress,
        )
        results = {}
        for temperature in TEMPERATURES:
            # The fitted curvature serves every temperature: T only scales the covariance
            # T P^{-1}, which the guide reads from .temperature when it draws.
            guide.temperature = temperature
            if linearised:
                probs = guide.predictive(
                    self.data.test_loader(),
                    num_data,
                    link="mc",
                    num_samples=self.settings["logit_draws"],
                    generator=torch.Generator(self.experiment.device).manual_seed(seed),
                )
                metrics = summarize(probs.cpu(), self.data.test_labels)
            else:
                samples = guide.sample_posterior(
                    self.settings["weight_draws"],
                    torch.Generator(self.experiment.device).manual_seed(seed),
                )
                metrics = self.score(model, samples)
            results[str(temperature)] = metrics
        return results

    def variational(self, temperature: float, seed: int) -> dict:
        pyro.clear_param_store()
        pyro.set_rng_seed(seed)
        model = self.model(seed)
        init_scale = math.exp(self.settings["vi_init_log_scale"])
        guide = MeanFieldGuide(
            model,
            init_loc_fn=init_to_value(values=self.map_values(seed)),
            init_scale=init_scale,
            temperature=temperature,
            stick_the_landing=True,
        )
        rates = {"lr": self.settings["learning_rate"]}
        scale_rates = {"lr": self.settings["vi_scale_learning_rate"]}

        def learning_rate(param_name: str) -> dict:
            return scale_rates if "scale_params" in param_name else rates

        svi = SVI(model, guide, pyro.optim.AdamW(learning_rate), Trace_ELBO())
        batches = Minibatches(self.train_args(seed), {})
        num_steps = self.settings["vi_epochs"] * self.steps_per_epoch
        bar = trange(num_steps, desc=f"VI T={temperature}", disable=not self.progress)
        for _ in bar:
            args, kwargs = batches.next()
            loss = svi.step(*args, **kwargs)
            bar.set_postfix(loss=f"{loss:.4g}", refresh=False)
        with torch.no_grad():
            args, kwargs = batches.peek()
            draws = [guide(*args, **kwargs) for _ in range(self.settings["weight_draws"])]
            scales = guide.stddevs()
        samples = {name: torch.stack([d[name] for d in draws]) for name in draws[0]}
        # The check that the temperature acted: the learned standard deviations moved.
        scale = {
            "initial": init_scale,
            "mean": float(scales.mean()),
            "median": float(scales.median()),
        }
        return {**self.score(model, samples), "vi_scale": scale}

    def sghmc(self, temperature: float, seed: int, num_samples: int, steps: int, **chains):
        """SGHMC chains of ``steps`` steps each; minibatch order and noise from ``seed``.

        :return: the model and the draws grouped by chain.
        """
        model = self.model(seed)
        thin = max(1, (steps - chains.get("warmup_steps", 0)) // num_samples)
        kernel = SGHMC(
            model,
            step_size=self.settings["step_size"],
            friction=self.settings["friction"],
            temperature=temperature,
            thin=thin,
            # the paper's recipe: the step size chosen on validation, fixed in warm-up
            adapt_step_size=False,
            adapt_mass_matrix=False,
        )
        runner = Chains(kernel, num_samples, disable_progbar=not self.progress, seed=seed, **chains)
        runner.run(*self.train_args(seed))
        return model, runner.get_samples(group_by_chain=True)

    def serial_sghmc(self, temperature: float, seed: int) -> dict:
        steps = self.settings["serial_epochs"] * self.steps_per_epoch
        burn_in = round(self.settings["serial_burn_in_fraction"] * steps)
        model, samples = self.sghmc(
            temperature,
            seed,
            self.settings["serial_draws"],
            steps,
            warmup_steps=burn_in,
            init_params=lambda chain: self.map_values(seed),
        )
        probs = self.predict(model, {name: value[0] for name, value in samples.items()})
        # One chain: split R-hat of the test reviews' class probabilities compares its halves.
        fs = function_space(probs.double()[None])
        return {
            **summarize(probs.mean(0), self.data.test_labels),
            "function_rhat": fs.max_rhat,
            "function_rhat_independent": fs.independent_max_rhat,
        }

    def parallel_chains(self, temperature: float) -> dict:
        """The pool of parallel chains at one temperature: each chain's test probabilities."""
        pool = self.settings["parallel_pool"]
        steps = self.settings["sghmc_epochs"] * self.steps_per_epoch
        model, samples = self.sghmc(
            temperature,
            _POOL_SEED,
            1,
            steps,
            warmup_steps=steps - 1,
            num_chains=pool,
            # Chain c starts from its own AdamW fit from its own initialisation (seed
            # 1000 + c, apart from the seeds'): a deep ensemble member, shared across T.
            init_params=lambda chain: self.map_values(_POOL_SEED + chain),
        )
        probs = [
            self.predict(model, {name: value[c] for name, value in samples.items()})[0]
            for c in range(pool)
        ]
        return {"probs": torch.stack(probs)}

    def parallel_rows(self, seeds: Sequence[int]) -> list[dict]:
        label = METHODS["sghmc_parallel"]
        size = self.settings["parallel_ensemble"]
        rows = []
        for temperature in TEMPERATURES:
            pool = self.cell(
                ("sghmc_parallel", f"T={temperature}", "pool"),
                lambda t=temperature: self.parallel_chains(t),
            )
            probs = torch.as_tensor(pool["probs"])
            for seed in seeds:
                chosen = np.random.default_rng(seed).choice(len(probs), size, replace=False)
                metrics = summarize(probs[chosen].mean(0), self.data.test_labels)
                rows.append({"method": label, "temperature": temperature, "seed": seed, **metrics})
        return rows


# -- tables and figure ---------------------------------------------------------------

_METRICS = ("nll", "accuracy", "ece", "brier")


def _summary(rows: Sequence[dict]) -> list[dict]:
    """Mean and standard deviation over seeds of every metric, per method and temperature."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["method"], row["temperature"]), []).append(row)
    summary = []
    for (method, temperature), group in groups.items():
        entry = {"method": method, "temperature": temperature, "seeds": len(group)}
        for metric in (*_METRICS, "train_accuracy", "train_nll", *_RHAT_ROWS):
            if metric in group[0]:
                entry[metric] = mean_sd([row[metric] for row in group])
        if "vi_scale" in group[0]:
            entry["vi_scale"] = mean_sd([row["vi_scale"]["mean"] for row in group])
            entry["vi_initial_scale"] = group[0]["vi_scale"]["initial"]
        summary.append(entry)
    return summary


#: The function-space rows: the serial chain's R-hat, and independent draws' (the label of
#: each row, from the method's).
_RHAT_ROWS = {
    "function_rhat": "{method}",
    "function_rhat_independent": "independent draws",
}


def _tables(summary: Sequence[dict]) -> str:
    """Markdown tables of test NLL and accuracy: one row per method, one column per T."""
    columns = ["method", "no T", *(f"T={t}" for t in TEMPERATURES)]
    text = []
    for metric in ("nll", "accuracy"):
        rows: dict[str, dict] = {}
        for entry in summary:
            row = rows.setdefault(entry["method"], {"method": entry["method"]})
            temperature = entry["temperature"]
            row["no T" if temperature is None else f"T={temperature}"] = entry[metric]
        table = markdown_table(list(rows.values()), columns)
        text.append(f"Test {metric} (mean ± sd over seeds)\n\n{table}")
    rhats = [entry for entry in summary if "function_rhat" in entry]
    if rhats:
        rows = []
        for key, label in _RHAT_ROWS.items():
            row = {"method": label.format(method=rhats[0]["method"])}
            row.update({f"T={e['temperature']}": e[key] for e in rhats if key in e})
            rows.append(row)
        text.append(
            "Function-space split R-hat of the serial SGHMC chain: the largest over the test "
            "reviews' class probabilities, the chain's two halves compared (Izmailov et al. "
            "2021; pyro_bdl.diagnostics.function_space); nan where the chain keeps fewer "
            "than 4 draws. Beside it, the largest that independent draws as many reach "
            "over as many reviews (pyro_bdl.diagnostics.independent_max_rhat): a function "
            "R-hat at or below it is no evidence against convergence. Parallel chains keep "
            "one draw each, for which R-hat is not defined\n\n" + markdown_table(rows, columns)
        )
    scales = [entry for entry in summary if "vi_scale" in entry]
    if scales:
        row = {"method": "VI", **{f"T={e['temperature']}": e["vi_scale"] for e in scales}}
        text.append(
            "VI: mean learned standard deviation over all weights (it started at "
            f"{scales[0]['vi_initial_scale']:.3f})\n\n" + markdown_table([row], columns)
        )
    return "\n\n".join(text)


def _plot(summary: Sequence[dict], path: Path) -> None:
    """Test NLL and accuracy against temperature (Figures 4, 8 and 9 of the paper)."""
    figure = Figure(figsize=(11, 4.2), dpi=110, layout="constrained")
    axes = figure.subplots(1, 2)
    tempered = [e for e in summary if e["temperature"] is not None]
    baselines = [e for e in summary if e["temperature"] is None]
    span = (min(TEMPERATURES) / 1.5, max(TEMPERATURES) * 1.5)
    for ax, metric, title in zip(axes, ("nll", "accuracy"), ("test NLL", "test accuracy")):
        for method in dict.fromkeys(e["method"] for e in tempered):
            entries = sorted(
                (e for e in tempered if e["method"] == method), key=lambda e: e["temperature"]
            )
            ax.errorbar(
                [e["temperature"] for e in entries],
                [e[metric]["mean"] for e in entries],
                yerr=[e[metric]["sd"] for e in entries],
                marker="o",
                capsize=3,
                label=method,
            )
        for entry, style in zip(baselines, ("--", ":")):
            mean, sd = entry[metric]["mean"], entry[metric]["sd"]
            line = ax.plot(span, [mean, mean], "k", linestyle=style, label=entry["method"])[0]
            ax.fill_between(span, mean - sd, mean + sd, color=line.get_color(), alpha=0.1)
        ax.set(xscale="log", xlim=span, xlabel="temperature T", title=title)
    axes[0].legend(fontsize="small")
    figure.suptitle("CNN-LSTM on IMDB: the cold posterior effect")
    figure.savefig(path, format="png")


if __name__ == "__main__":  # python -m experiments.cold_posterior [options]
    from experiments import main

    main(name="cold-posterior")
