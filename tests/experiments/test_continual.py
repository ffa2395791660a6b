"""The continual-learning experiment's options: an unknown method is an error.

The experiment's whole --quick run (schema, ranges, figures, resume) is a check of the
validation tier: ``validation/experiments/test_continual.py``.
"""

import pytest

from experiments import run_experiment


def test_unknown_method_is_an_error(tmp_path, shared_data):
    with pytest.raises(ValueError, match="--methods"):
        run_experiment("continual", data_dir=shared_data, out=tmp_path, quick=True, methods=["ewc"])
