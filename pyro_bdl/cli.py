"""The ``pyro-bdl`` command: ``pyro-bdl demo`` and, from a checkout, ``pyro-bdl experiment``.

Every bad argument ends the command with one line on stderr, ``pyro-bdl: error: ...``,
and exit status 2, before any work: unknown commands, a ``--data-dir`` that is not a
directory, an ``--out`` that is a file, a negative seed, and a demo that lacks what it needs
(SST-2 nowhere to be found and the Hub unreachable, a missing package: the demo's
:class:`~pyro_bdl.demo.DemoSetupError`, which says what to pass). A malformed data file
found later ends with one line and status 1.

The experiments are not part of the installed package: ``pyro-bdl experiment ...`` hands
its arguments to the command registered under that name in the ``pyro_bdl.commands``
entry-point group (the repository registers its top-level ``experiments`` package, ``python
-m experiments ...``, which checks them the same way) when it can be loaded, and otherwise
says how to run them. The command never imports a package it does not ship. The argument
types and the one-line errors (:class:`Parser`, :func:`seed`, :func:`data_directory`,
:func:`output_directory`, :func:`report_to_stderr`) are public, for such commands to
refuse bad arguments alike.

What the library reports goes through the ``pyro_bdl`` logger, which the command writes to
stderr at INFO (``-q``: warnings and errors only; ``-v``: DEBUG too).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points
from pathlib import Path

__all__ = [
    "main",
    "COMMANDS",
    "Parser",
    "seed",
    "data_directory",
    "output_directory",
    "report_to_stderr",
]

#: The entry-point group of the commands ``pyro-bdl NAME`` hands its arguments to.
COMMANDS = "pyro_bdl.commands"


class Parser(argparse.ArgumentParser):
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


def seed(text: str) -> int:
    """An argparse type: a seed, an int >= 0."""
    try:
        seed = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a seed must be an int >= 0, got {text!r}") from None
    if seed < 0:
        raise argparse.ArgumentTypeError(f"a seed must be an int >= 0, got {seed}")
    return seed


def data_directory(text: str) -> Path:
    """An argparse type: an existing directory (of datasets)."""
    path = Path(text)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(
            f"{text} is not a directory; pass the folder that holds the datasets "
            "(e.g. ../shared/data)"
        )
    return path


def output_directory(text: str) -> Path:
    """An argparse type: an output directory (it may not exist yet; it is not a file)."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file; --out must be a directory")
    return path


def _parser() -> Parser:
    from pyro_bdl import __version__

    parser = Parser(prog="pyro-bdl", description="Bayesian deep learning in Pyro")
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
    demo.add_argument(
        "--out", type=output_directory, default="results/demo", help="output directory"
    )
    demo.add_argument("--seed", type=seed, default=0)
    demo.add_argument("--quick", action="store_true", help="small, CI-sized run")
    demo.add_argument(
        "--data-dir",
        type=data_directory,
        help="folder with sst2/ for the LoRA language-model part (default: the copy in "
        "~/.cache/pyro_bdl, fetched there once if the Hugging Face Hub answers)",
    )
    demo.add_argument(
        "--skip-lora",
        action="store_true",
        help="run the MCMC tour alone (results.json records the LoRA part as skipped)",
    )
    # The experiments are a package of the repository, not of the library: the command
    # hands its arguments to them, and says how to get them where they are missing.
    commands.add_parser(
        "experiment",
        help="run one of the papers' experiments (from a checkout of the repository; "
        "pyro-bdl experiment --help lists them)",
        add_help=False,
    )
    return parser


def report_to_stderr(args: argparse.Namespace, names: Sequence[str] = ("pyro_bdl",)) -> None:
    """The records of the loggers ``names`` at the level ``args.quiet`` / ``args.verbose``
    ask for (INFO by default) and above, one line each on stderr, and only there (a
    handler that an imported library put on the root logger would repeat them)."""
    level = logging.WARNING if args.quiet else logging.DEBUG if args.verbose else logging.INFO
    for name in names:
        logger = logging.getLogger(name)
        logger.setLevel(level)
        logger.propagate = False
        if not any(getattr(handler, "name", None) == "pyro-bdl" for handler in logger.handlers):
            handler = logging.StreamHandler(sys.stderr)
            handler.set_name("pyro-bdl")
            handler.setFormatter(logging.Formatter("%(message)s"))
            logger.addHandler(handler)


def _command(name: str) -> Callable | None:
    """The ``main(argv, prog=...)`` registered as ``pyro-bdl NAME`` (the entry point ``NAME``
    of the group :data:`COMMANDS`), or None when none is installed or it does not load
    (the repository's experiments from outside a checkout's root)."""
    for point in entry_points(group=COMMANDS, name=name):
        try:
            return point.load()
        except ImportError:
            return None
    return None


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``pyro-bdl``."""
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "experiment":
        command = _command("experiment")
        if command is None:
            parser.error(
                "the experiments are not part of the installed package: run them from the "
                "root of a checkout of the repository (python -m experiments NAME ..., or "
                "make experiment NAME=...; docs/experiments.md)"
            )
        flags = ["-q"] * args.quiet + ["-v"] * args.verbose
        command([*flags, *rest], prog="pyro-bdl experiment")
        return
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    report_to_stderr(args)
    try:
        from pyro_bdl.demo import run_demo
    except ModuleNotFoundError as error:
        if (error.name or "pyro_bdl").partition(".")[0] == "pyro_bdl":
            raise
        # a package of the demo extra (scikit-learn's digits, ...): say which extra
        sys.exit(f"pyro-bdl: error: the demo needs {error.name}: pip install 'pyro-bdl[demo]'")
    try:
        from pyro_bdl.demo import DemoSetupError

        run_demo(
            args.out,
            seed=args.seed,
            quick=args.quick,
            data_dir=args.data_dir,
            skip_lora=args.skip_lora,
        )
    except DemoSetupError as error:  # found before any work: what to pass, status 2
        print(f"pyro-bdl demo: error: {error}", file=sys.stderr)
        sys.exit(2)
    except (ValueError, FileNotFoundError) as error:  # malformed data: one line
        sys.exit(f"pyro-bdl: error: {error}")


if __name__ == "__main__":
    main()
