"""The ``pyro-bdl`` command.

Every bad argument ends the command with one line on stderr, ``pyro-bdl: error: ...``,
and exit status 2, before any work: unknown commands and experiments, a ``--data-dir``
that is not a directory, an ``--out`` that is a file, negative or repeated seeds.
Dataset and method names are checked by the experiment before it loads anything; those
errors, and a malformed data file found later, end with one line and status 1.

What the library reports goes through the ``pyro_bdl`` logger, which the command writes to
stderr at INFO (``-q``: warnings and errors only; ``-v``: DEBUG too). Results are printed.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (argparse prints the whole usage first), and help
    that ends with ``more_help()``, computed only when help is asked for."""

    def __init__(self, *args, more_help: Callable[[], str] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.more_help = more_help

    def format_help(self) -> str:
        text = super().format_help()
        return text if self.more_help is None else f"{text}\n{self.more_help()}\n"

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _seed(text: str) -> int:
    try:
        seed = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a seed must be an int >= 0, got {text!r}") from None
    if seed < 0:
        raise argparse.ArgumentTypeError(f"a seed must be an int >= 0, got {seed}")
    return seed


def _directory(text: str) -> Path:
    path = Path(text)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(
            f"{text} is not a directory; pass the folder that holds the datasets "
            "(e.g. ../shared/data)"
        )
    return path


def _model_directory(text: str) -> str:
    if not Path(text).is_dir():
        raise argparse.ArgumentTypeError(
            f"{text} is not a directory; pass a local Hugging Face model directory"
        )
    return text


def _output(text: str) -> Path:
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file; --out must be a directory")
    return path


def _methods_help() -> str:
    # The methods are named in the experiment modules, which import the models (seconds):
    # read only for --help.
    from experiments import EXPERIMENTS

    lines = ["methods of each experiment (--methods):"]
    for name, module in sorted(EXPERIMENTS.items()):
        lines.append(f"  {name}: {', '.join(importlib.import_module(module).METHODS)}")
    return "\n".join(lines)


def _parser() -> _Parser:
    from experiments import EXPERIMENTS
    from pyro_bdl import __version__
    from pyro_bdl.data import DATASETS

    parser = _Parser(prog="pyro-bdl", description="Bayesian deep learning in Pyro")
    parser.add_argument("--version", action="version", version=f"pyro-bdl {__version__}")
    verbosity = parser.add_mutually_exclusive_group()
    verbosity.add_argument(
        "-q", "--quiet", action="store_true", help="report warnings and errors only"
    )
    verbosity.add_argument("-v", "--verbose", action="store_true", help="report debug messages")
    commands = parser.add_subparsers(
        dest="command", required=True, metavar="command", help="demo or experiment"
    )
    demo = commands.add_parser("demo", help="Bayesian MLP on the digits data with SGMCMC and MAP")
    demo.add_argument("--out", type=_output, default="results/demo", help="output directory")
    demo.add_argument("--seed", type=_seed, default=0)
    demo.add_argument("--quick", action="store_true", help="small, CI-sized run")
    demo.add_argument(
        "--data-dir",
        type=_directory,
        help="folder with sst2/ for the LoRA language-model part (skipped without)",
    )
    experiment = commands.add_parser(
        "experiment", help="run one of the papers' experiments", more_help=_methods_help
    )
    experiment.add_argument("name", choices=sorted(EXPERIMENTS), help="the experiment")
    experiment.add_argument(
        "--data-dir", type=_directory, required=True, help="folder holding the datasets"
    )
    experiment.add_argument("--out", type=_output, required=True, help="output directory")
    experiment.add_argument("--quick", action="store_true", help="CI-sized run (< 2 minutes)")
    experiment.add_argument("--seeds", type=_seed, nargs="+", default=[0, 1, 2])
    experiment.add_argument(
        "--datasets",
        nargs="+",
        metavar="DATASET",
        help=f"restrict to these of the experiment's datasets ({', '.join(DATASETS)})",
    )
    experiment.add_argument(
        "--methods", nargs="+", metavar="METHOD", help="restrict to these methods (below)"
    )
    experiment.add_argument(
        "--device",
        default="cpu",
        help="where the networks run: cpu (laptop-scale sizes) or cuda (the papers' sizes)",
    )
    experiment.add_argument(
        "--epochs",
        type=int,
        help="train every fine-tune this many epochs (calibration: an ablation of the length)",
    )
    experiment.add_argument(
        "--model",
        type=_model_directory,
        help="a local Hugging Face causal LM to use as the base (lm-ood)",
    )
    return parser


def _report(level: int) -> None:
    """The pyro_bdl logger's records at ``level`` and above, one line each on stderr."""
    logger = logging.getLogger("pyro_bdl")
    logger.setLevel(level)
    if not any(getattr(handler, "name", None) == "pyro-bdl" for handler in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.set_name("pyro-bdl")
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``pyro-bdl``."""
    parser = _parser()
    args = parser.parse_args(argv)
    _report(logging.WARNING if args.quiet else logging.DEBUG if args.verbose else logging.INFO)
    if args.command == "experiment" and len(set(args.seeds)) != len(args.seeds):
        parser.error(f"argument --seeds: each seed once, got {args.seeds}")
    try:
        if args.command == "demo":
            from pyro_bdl.demo import run_demo

            run_demo(args.out, seed=args.seed, quick=args.quick, data_dir=args.data_dir)
        else:
            from experiments import run_experiment

            run_experiment(
                args.name,
                data_dir=args.data_dir,
                out=args.out,
                quick=args.quick,
                seeds=args.seeds,
                datasets=args.datasets,
                methods=args.methods,
                device=args.device,
                epochs=args.epochs,
                model=args.model,
            )
    except (ValueError, FileNotFoundError) as error:  # bad names, malformed data: one line
        sys.exit(f"pyro-bdl: error: {error}")


if __name__ == "__main__":
    main()
