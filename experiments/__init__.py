"""The papers' experiments at laptop scale: a package of the repository, not of the library.

Run from a checkout of the repository (its root on ``sys.path``)::

    python -m experiments calibration --data-dir ../shared/data --out results/calibration
    python -m experiments.calibration --data-dir ../shared/data --out results/calibration
    make experiment NAME=calibration ARGS="--quick"

Each experiment is a module with ``run(experiment: Experiment) -> dict`` that writes
``results.json`` and its PNG figures into ``experiment.out`` and returns the results, and
``METHODS``, the names ``--methods`` takes. Progress goes to the ``experiments`` and
``pyro_bdl`` loggers (stderr; ``-q`` / ``-v``); each experiment prints its tables.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from pathlib import Path

from experiments.runner import Experiment, markdown_table, mean_sd

# The pyro-bdl command's argument types and one-line errors, so that both commands
# refuse bad arguments alike.
from pyro_bdl.cli import Parser, data_directory, output_directory, report_to_stderr, seed

__all__ = ["EXPERIMENTS", "Experiment", "run_experiment", "main", "markdown_table", "mean_sd"]

#: Experiment name -> module; modules are imported on use, since each pulls in models and data.
EXPERIMENTS = {
    "calibration": "experiments.calibration",
    "cold-posterior": "experiments.cold_posterior",
    "continual": "experiments.continual",
    "llm-learnability": "experiments.llm_learnability",
    "lm-ood": "experiments.lm_ood",
    "ood": "experiments.ood",
}


#: The options only some experiments take (those listing them in their ``OPTIONS``):
#: option -> (why another experiment refuses it, the experiment that takes it).
_OWN_OPTIONS = {
    "epochs": ("sets a training length per method (see its module docstring)", "calibration"),
    "model": ("builds its own network", "lm-ood and calibration"),
    "sizes": ("has fixed sizes", "llm-learnability"),
}


def run_experiment(name: str, **options) -> dict:
    """Run experiment ``name`` with the options of :class:`Experiment`.

    Example::

        run_experiment("calibration", data_dir="../shared/data", out="results/cal", quick=True)
    """
    if name not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {name!r}; choose one of {sorted(EXPERIMENTS)}")
    module = importlib.import_module(EXPERIMENTS[name])
    for option, (why, taker) in _OWN_OPTIONS.items():
        if options.get(option) not in (None, {}) and option not in getattr(module, "OPTIONS", ()):
            raise ValueError(
                f"--{option}: the {name} experiment {why}; only {taker} takes --{option}"
            )
    return module.run(Experiment(name=name, **options))


def main(
    argv: Sequence[str] | None = None, name: str | None = None, prog: str | None = None
) -> None:
    """The command line of the experiments: ``python -m experiments NAME [options]``.

    Bad arguments end with one line on stderr and status 2 before any work; dataset and
    method names, checked by the experiment before it loads anything, with one line and
    status 1.

    :param argv: the arguments (default: ``sys.argv[1:]``).
    :param str name: the experiment, when the command is one experiment's module
        (``python -m experiments.ood``); otherwise the first positional argument.
    :param str prog: the command's name in messages.
    """
    if prog is None:
        prog = "python -m " + (EXPERIMENTS[name] if name else "experiments")
    parser = _parser(prog, name)
    args = parser.parse_args(argv)
    report_to_stderr(args, ("pyro_bdl", "experiments"))
    if len(set(args.seeds)) != len(args.seeds):
        parser.error(f"argument --seeds: each seed once, got {args.seeds}")
    options = vars(args)
    for flag in ("quiet", "verbose"):
        del options[flag]
    if options["sizes"] is not None:
        options["sizes"] = dict(options["sizes"])
    try:
        run_experiment(options.pop("name", name), **options)
    except (ValueError, FileNotFoundError) as error:  # bad names, malformed data: one line
        sys.exit(f"{prog}: error: {error}")


def _parser(prog: str, name: str | None) -> Parser:
    from pyro_bdl.data import DATASETS

    parser = Parser(
        prog=prog,
        description="Run one of the papers' experiments at laptop scale (or the papers' on a GPU)",
        more_help=lambda: _methods_help(name),
    )
    verbosity = parser.add_mutually_exclusive_group()
    verbosity.add_argument(
        "-q", "--quiet", action="store_true", help="report warnings and errors only"
    )
    verbosity.add_argument("-v", "--verbose", action="store_true", help="report debug messages")
    if name is None:
        parser.add_argument("name", choices=sorted(EXPERIMENTS), help="the experiment")
    parser.add_argument(
        "--data-dir", type=data_directory, required=True, help="folder holding the datasets"
    )
    parser.add_argument("--out", type=output_directory, required=True, help="output directory")
    parser.add_argument("--quick", action="store_true", help="CI-sized run (< 2 minutes)")
    parser.add_argument("--seeds", type=seed, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--datasets",
        nargs="+",
        metavar="DATASET",
        help=f"restrict to these of the experiment's datasets ({', '.join(DATASETS)})",
    )
    parser.add_argument(
        "--methods", nargs="+", metavar="METHOD", help="restrict to these methods (below)"
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="where the networks run: cpu (laptop-scale sizes) or cuda (the papers' sizes)",
    )
    parser.add_argument(
        "--epochs",
        type=int,
        help="train every fine-tune this many epochs (calibration: an ablation of the length)",
    )
    parser.add_argument(
        "--model",
        type=_model_directory,
        help="a local Hugging Face causal LM to use as the base, or smollm2 (SmolLM2-135M, "
        "converted once into the Hugging Face cache) (lm-ood, calibration)",
    )
    parser.add_argument(
        "--sizes",
        type=_size,
        nargs="+",
        metavar="NAME=VALUE",
        help="override these of the experiment's sizes, e.g. num_train=256 lr=3e-3 "
        "(llm-learnability)",
    )
    return parser


def _size(text: str) -> tuple[str, int | float]:
    """``NAME=VALUE`` -> ``(NAME, VALUE)``, the value an int when it is written as one."""
    name, equals, value = text.partition("=")
    if not (name and equals):
        raise argparse.ArgumentTypeError(f"a size is NAME=VALUE, got {text!r}")
    for kind in (int, float):
        try:
            return name, kind(value)
        except ValueError:
            pass
    raise argparse.ArgumentTypeError(f"a size must be a number, got {text!r}")


def _model_directory(text: str) -> str:
    if text != "smollm2" and not Path(text).is_dir():
        raise argparse.ArgumentTypeError(
            f"{text} is not a directory; pass a local Hugging Face model directory or smollm2"
        )
    return text


def _methods_help(name: str | None) -> str:
    # The methods are named in the experiment modules, which import the models (seconds):
    # read only for --help.
    names = sorted(EXPERIMENTS) if name is None else [name]
    lines = ["methods of each experiment (--methods):"]
    for each in names:
        methods = importlib.import_module(EXPERIMENTS[each]).METHODS
        lines.append(f"  {each}: {', '.join(methods)}")
    return "\n".join(lines)
