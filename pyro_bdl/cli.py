"""The ``pyro-bdl`` command."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``pyro-bdl``."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parser = argparse.ArgumentParser(prog="pyro-bdl", description="Bayesian deep learning in Pyro")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="Bayesian MLP on the digits data with SGMCMC and MAP")
    demo.add_argument("--out", default="results/demo", help="output directory")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--quick", action="store_true", help="small, CI-sized run")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from pyro_bdl.demo import run_demo

        run_demo(args.out, seed=args.seed, quick=args.quick)


if __name__ == "__main__":
    main()
