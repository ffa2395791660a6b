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
    demo.add_argument(
        "--data-dir", help="folder with sst2/ for the LoRA language-model part (skipped without)"
    )
    experiment = commands.add_parser("experiment", help="run one of the papers' experiments")
    experiment.add_argument("name", help="calibration, cold-posterior, continual or ood")
    experiment.add_argument("--data-dir", required=True, help="folder holding the datasets")
    experiment.add_argument("--out", required=True, help="output directory")
    experiment.add_argument("--quick", action="store_true", help="CI-sized run (< 2 minutes)")
    experiment.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    experiment.add_argument("--datasets", nargs="+", help="restrict to these datasets")
    experiment.add_argument("--methods", nargs="+", help="restrict to these methods")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from pyro_bdl.demo import run_demo

        run_demo(args.out, seed=args.seed, quick=args.quick, data_dir=args.data_dir)
    elif args.command == "experiment":
        from pyro_bdl.experiments import run_experiment

        run_experiment(
            args.name,
            data_dir=args.data_dir,
            out=args.out,
            quick=args.quick,
            seeds=args.seeds,
            datasets=args.datasets,
            methods=args.methods,
        )


if __name__ == "__main__":
    main()
