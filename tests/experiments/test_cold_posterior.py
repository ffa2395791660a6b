"""The cold-posterior experiment's options: methods and datasets restrict the run.

The experiment's whole --quick run (schema, ranges, figures, resume) is a check of the
validation tier: ``validation/experiments/test_cold_posterior.py``.
"""

import pytest

from experiments import run_experiment


def test_methods_restrict_the_run_and_unknown_names_are_errors(tmp_path, shared_data):
    with pytest.raises(ValueError, match="--methods"):
        run_experiment(
            "cold-posterior", data_dir=shared_data, out=tmp_path, quick=True, methods=["hmc"]
        )
    with pytest.raises(ValueError, match="--datasets"):
        run_experiment(
            "cold-posterior", data_dir=shared_data, out=tmp_path, quick=True, datasets=["sst2"]
        )
    results = run_experiment(
        "cold-posterior",
        data_dir=shared_data,
        out=tmp_path,
        quick=True,
        seeds=[0],
        methods=["map"],
    )
    assert [row["method"] for row in results["rows"]] == ["MAP"]
