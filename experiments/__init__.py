"""The papers' experiments at laptop scale, run by ``pyro-bdl experiment NAME``.

Each experiment is a module with ``run(experiment: Experiment) -> dict`` that writes
``results.json`` and its PNG figures into ``experiment.out`` and returns the results.
"""

from __future__ import annotations

import importlib

from experiments.runner import Experiment, markdown_table, mean_sd

__all__ = ["EXPERIMENTS", "Experiment", "run_experiment", "markdown_table", "mean_sd"]

#: Experiment name -> module; modules are imported on use, since each pulls in models and data.
EXPERIMENTS = {
    "calibration": "experiments.calibration",
    "cold-posterior": "experiments.cold_posterior",
    "continual": "experiments.continual",
    "lm-ood": "experiments.lm_ood",
    "ood": "experiments.ood",
}


def run_experiment(name: str, **options) -> dict:
    """Run experiment ``name`` with the options of :class:`Experiment`.

    Example::

        run_experiment("calibration", data_dir="../shared/data", out="results/cal", quick=True)
    """
    if name not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {name!r}; choose one of {sorted(EXPERIMENTS)}")
    module = importlib.import_module(EXPERIMENTS[name])
    if options.get("epochs") is not None and "epochs" not in getattr(module, "OPTIONS", ()):
        raise ValueError(
            f"--epochs: the {name} experiment sets a training length per method (see its "
            "module docstring); only calibration takes --epochs"
        )
    if options.get("model") is not None and "model" not in getattr(module, "OPTIONS", ()):
        raise ValueError(
            f"--model: the {name} experiment builds its own network; only lm-ood takes --model"
        )
    return module.run(Experiment(name=name, **options))
