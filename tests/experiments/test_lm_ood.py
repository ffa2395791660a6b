"""The causal-LM out-of-distribution experiment's options and helpers.

The experiment's whole --quick run (schema, ranges, figures, resume) is a check of the
validation tier: ``validation/experiments/test_lm_ood.py``.
"""

import pytest

from experiments import run_experiment
from experiments.lm_ood import last_word, sghmc_parameters


def test_only_flores_known_methods_and_a_model_directory(tmp_path, shared_data):
    with pytest.raises(ValueError, match="--datasets"):
        run_experiment("lm-ood", data_dir=shared_data, out=tmp_path, quick=True, datasets=["imdb"])
    with pytest.raises(ValueError, match="--methods"):
        run_experiment("lm-ood", data_dir=shared_data, out=tmp_path, quick=True, methods=["MAP"])
    with pytest.raises(FileNotFoundError, match="--model"):
        run_experiment("lm-ood", data_dir=shared_data, out=tmp_path, model=tmp_path / "none")
    with pytest.raises(ValueError, match="--model: the ood experiment builds its own"):
        run_experiment("ood", data_dir=shared_data, out=tmp_path, model=str(tmp_path))


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The cat sat on the mat.", ("The cat sat on the", "mat")),
        ('He said "it works."', ('He said "it', "works")),
        ("Ua maua e le tamaitiiti le ta’avale.", ("Ua maua e le tamaitiiti le", "ta’avale")),
        ("It cost 45.", None),  # the last word is a number
        ("Hello!", None),  # one word
    ],
)
def test_last_word(text, expected):
    assert last_word(text) == expected


@pytest.mark.parametrize("learning_rate, momentum", [(0.01, 0.9), (0.3, 0.5)])
def test_sghmc_parameters_give_sgd_at_the_learning_rate_and_momentum(learning_rate, momentum):
    # SGHMC at T = 0 is SGD with momentum 1 - eps alpha and steady steps eps / alpha
    step_size, friction = sghmc_parameters(learning_rate, momentum)
    assert step_size * friction == pytest.approx(1 - momentum)
    assert step_size / friction == pytest.approx(learning_rate)
