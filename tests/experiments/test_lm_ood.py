"""The causal-LM out-of-distribution experiment's options and helpers.

The experiment's whole --quick run (schema, ranges, figures, resume) is a check of the
validation tier: ``validation/experiments/test_lm_ood.py``.
"""

import pytest
import torch
from tiny_models import tiny_llama

from experiments import run_experiment
from experiments.lm_ood import SentencePrefix, last_word, sghmc_parameters


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


def test_the_last_layer_fed_each_sentences_prefix_once_computes_the_whole_model():
    pad = 0
    copies = [tiny_llama(0, torch.float64, vocab_size=23).eval() for _ in range(3)]
    whole = copies[0]
    sentences = [[1, 5, 9, 4, 7], [1, 8, 3], [1, 6, 6, 2]]
    prefix = SentencePrefix(copies[1], pad)
    cut = prefix.attach(copies[2])
    assert len(cut.model.layers) == 1

    def batch(rows, width):  # right-padded to width
        ids = torch.full((len(rows), width), pad)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row)
        return ids, (ids != pad).long()

    for rows, width in ((sentences, 5), (sentences[1:], 6)):  # the second: other padding
        ids, mask = batch(rows, width)
        with torch.no_grad():
            expected = whole(input_ids=ids, attention_mask=mask).logits
            got = cut(input_ids=ids, attention_mask=mask, use_cache=False).logits
        for i, row in enumerate(rows):
            torch.testing.assert_close(got[i, : len(row)], expected[i, : len(row)])
    assert len(prefix.states) == len(sentences)  # each sentence's states computed once
    left = torch.tensor([[pad, 1, 5]])
    with pytest.raises(ValueError, match="right-padded"):
        cut(input_ids=left, attention_mask=(left != pad).long(), use_cache=False)
