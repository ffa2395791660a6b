"""Every public entry point of pyro_bdl.inference.vi answers bad input with a named error.

Each case: the call, the error type, and the argument name the message must contain. The
errors are raised at the call, before any work (no model run, no training step).
"""

import math

import numpy as np
import pytest
import torch

from pyro_bdl.inference import (
    BLoBGuide,
    BLoBSVI,
    LoRAFlipout,
    MeanFieldGuide,
    VariationalNormal,
    blob_kl_cycle,
    exponential_kl_weight,
    fit_blob,
    flipout_linear,
    uniform_kl_weight,
)


@pytest.fixture
def lora(make_lora_net, make_classifier):
    net = make_lora_net()
    return net, make_classifier(net)


def model(*args, **kwargs):
    return None


def _guide(lora):
    net, lora_model = lora
    return BLoBGuide(lora_model, net)


def _normal(*args):
    return lambda lora: VariationalNormal(torch.zeros(2), torch.ones(2), *args)


def _linear(h=(4, 5), mean=(2, 5), delta=(2, 5)):
    return lambda: flipout_linear(torch.zeros(h), torch.zeros(mean), torch.zeros(delta))


CASES = {
    "MeanFieldGuide": [
        (lambda lora: MeanFieldGuide(3), TypeError, "model"),
        (lambda lora: MeanFieldGuide(model, init_loc_fn="module"), TypeError, "init_loc_fn"),
        (lambda lora: MeanFieldGuide(model, init_scale=0.0), ValueError, "init_scale"),
        (lambda lora: MeanFieldGuide(model, init_scale=math.nan), ValueError, "init_scale"),
        (lambda lora: MeanFieldGuide(model, init_scale=True), TypeError, "init_scale"),
        (lambda lora: MeanFieldGuide(model, init_scale="0.1"), TypeError, "init_scale"),
        (
            lambda lora: MeanFieldGuide(model, scale_parametrization="log"),
            ValueError,
            "scale_parametrization",
        ),
        (lambda lora: MeanFieldGuide(model, temperature=-1.0), ValueError, "temperature"),
        (lambda lora: MeanFieldGuide(model, temperature=math.inf), ValueError, "temperature"),
        (
            lambda lora: MeanFieldGuide(model, stick_the_landing="yes"),
            TypeError,
            "stick_the_landing",
        ),
    ],
    "BLoBGuide": [
        (lambda lora: BLoBGuide(None), TypeError, "model"),
        (lambda lora: BLoBGuide(lora[1], "net"), TypeError, "net"),
        (lambda lora: BLoBGuide(lora[1], lora[0], eps=0.0), ValueError, "eps"),
        (lambda lora: BLoBGuide(lora[1], lora[0], eps=-0.05), ValueError, "eps"),
        (lambda lora: BLoBGuide(lora[1], lora[0], eps=True), TypeError, "eps"),
        (lambda lora: BLoBGuide(lora[1], lora[0], prior_std=0), ValueError, "prior_std"),
        (lambda lora: BLoBGuide(lora[1], lora[0], prior_std="0.2"), TypeError, "prior_std"),
        (lambda lora: BLoBGuide(lora[1], lora[0], flipout=1), TypeError, "flipout"),
        (lambda lora: BLoBGuide(lora[1], lora[0], init_loc_fn=0), TypeError, "init_loc_fn"),
        (lambda lora: setattr(_guide(lora), "flipout", "off"), TypeError, "flipout"),
    ],
    "BLoBSVI": [
        (lambda lora: BLoBSVI(1, _guide(lora), num_steps=5), TypeError, "model"),
        (lambda lora: BLoBSVI(lora[1], object(), num_steps=5), TypeError, "guide"),
        (lambda lora: BLoBSVI(lora[1], _guide(lora), num_steps=0), ValueError, "num_steps"),
        (lambda lora: BLoBSVI(lora[1], _guide(lora), num_steps=2.5), TypeError, "num_steps"),
        (lambda lora: BLoBSVI(lora[1], _guide(lora), num_steps=5, lr=-1), ValueError, "lr"),
        (
            lambda lora: BLoBSVI(lora[1], _guide(lora), num_steps=5, kl_lr=math.nan),
            ValueError,
            "kl_lr",
        ),
        (
            lambda lora: BLoBSVI(lora[1], _guide(lora), num_steps=5, weight_decay=-0.1),
            ValueError,
            "weight_decay",
        ),
        (
            lambda lora: BLoBSVI(lora[1], _guide(lora), num_steps=5, warmup_ratio=1.0),
            ValueError,
            "warmup_ratio",
        ),
        (
            lambda lora: BLoBSVI(lora[1], _guide(lora), num_steps=5, kl_weighting="linear"),
            ValueError,
            "kl_weighting",
        ),
        (lambda lora: BLoBSVI(lora[1], _guide(lora), num_steps=5, gamma=0), ValueError, "gamma"),
    ],
    "fit_blob": [
        (lambda lora: fit_blob(lora[1], _guide(lora), num_steps=0), ValueError, "num_steps"),
        (lambda lora: fit_blob(lora[1], _guide(lora), num_steps=None), TypeError, "num_steps"),
        (lambda lora: fit_blob(lora[1], None, num_steps=3), TypeError, "guide"),
        (lambda lora: fit_blob(lora[1], _guide(lora), num_steps=3, lr="big"), TypeError, "lr"),
        (
            lambda lora: fit_blob(lora[1], _guide(lora), num_steps=3, progress="yes"),
            TypeError,
            "progress",
        ),
        (
            lambda lora: fit_blob(lora[1], _guide(lora), num_steps=3, gamma=-8),
            ValueError,
            "gamma",
        ),
    ],
    "blob_kl_cycle": [
        (lambda lora: blob_kl_cycle(0, 8), ValueError, "num_data"),
        (lambda lora: blob_kl_cycle(1.5, 8), TypeError, "num_data"),
        (lambda lora: blob_kl_cycle(100, 0), ValueError, "batch_size"),
        (lambda lora: blob_kl_cycle(100, True), TypeError, "batch_size"),
        (lambda lora: blob_kl_cycle(100, 8, gamma=0), ValueError, "gamma"),
        (lambda lora: blob_kl_cycle(100, 8, gamma=math.inf), ValueError, "gamma"),
    ],
    "exponential_kl_weight": [
        (lambda lora: exponential_kl_weight(-1, 8), ValueError, "step"),
        (lambda lora: exponential_kl_weight(0.5, 8), TypeError, "step"),
        (lambda lora: exponential_kl_weight(0, 0), ValueError, "cycle"),
        (lambda lora: exponential_kl_weight(0, True), TypeError, "cycle"),
        (lambda lora: exponential_kl_weight(0, "8"), TypeError, "cycle"),
    ],
    "uniform_kl_weight": [
        (lambda lora: uniform_kl_weight(-2, 8), ValueError, "step"),
        (lambda lora: uniform_kl_weight(None, 8), TypeError, "step"),
        (lambda lora: uniform_kl_weight(0, -4), ValueError, "cycle"),
        (lambda lora: uniform_kl_weight(0, 8.0), TypeError, "cycle"),
        (lambda lora: uniform_kl_weight(0, np.float64(8)), TypeError, "cycle"),
    ],
    "flipout_linear": [
        (lambda lora: flipout_linear("h", torch.zeros(2, 5), torch.zeros(2, 5)), TypeError, "h"),
        (lambda lora: _linear(mean=(2, 4))(), ValueError, "mean"),
        (lambda lora: _linear(delta=(3, 5))(), ValueError, "delta"),
        (lambda lora: _linear(mean=(5,), delta=(5,))(), ValueError, "mean"),
        (lambda lora: _linear(h=(4, 6))(), ValueError, "h"),
    ],
    "LoRAFlipout": [
        (lambda lora: LoRAFlipout(torch.nn.Linear(2, 2), []), TypeError, "net"),
        (lambda lora: LoRAFlipout(lora[0], "lora_A"), TypeError, "sites"),
        (lambda lora: LoRAFlipout(lora[0], 5), TypeError, "sites"),
        (lambda lora: LoRAFlipout(lora[0], ["no_such_site"]), ValueError, "sites"),
        (lambda lora: LoRAFlipout(lora[0], list(lora[0].point_sites)), ValueError, "sites"),
    ],
    "VariationalNormal": [
        (_normal(-0.5), ValueError, "temperature"),
        (_normal(math.nan), ValueError, "temperature"),
        (_normal("1"), TypeError, "temperature"),
        (_normal(True), TypeError, "temperature"),
        (_normal(1.0, "no"), TypeError, "stick_the_landing"),
    ],
}  # fmt: skip


@pytest.mark.parametrize(
    "entry, call, error, argument",
    [(entry, *case) for entry, cases in CASES.items() for case in cases],
    ids=[f"{entry}-{k}" for entry, cases in CASES.items() for k in range(len(cases))],
)
def test_bad_input_is_a_named_error(lora, entry, call, error, argument):
    with pytest.raises(error) as raised:
        call(lora)
    assert argument in str(raised.value), f"{entry}: {raised.value}"


def test_every_entry_point_has_at_least_five_bad_inputs():
    assert all(len(cases) >= 5 for cases in CASES.values())
