"""Bad inputs to the Laplace guide and to fit_map: each a named error, raised at the call.

Every case asserts the exception type and that the message names the argument.
"""

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import pyro_bdl as bdl
from pyro_bdl.data import TensorLoader
from pyro_bdl.inference import LaplaceGuide, fit_map


@pytest.fixture
def problem(helpers):
    return helpers.LinearGaussian()


@pytest.fixture
def fitted(problem):
    guide = LaplaceGuide(problem.model, curvature="diag_ggn")
    return guide.fit(problem.loader(), problem.num_data, map={"w": problem.mean}, progress=False)


CONSTRUCTOR = [
    ({"model": None}, TypeError, "model must be a Pyro model"),
    ({"curvature": "kfac"}, ValueError, "curvature must be one of"),
    ({"curvature": 3}, TypeError, "curvature must be a name"),
    ({"curvature": None}, TypeError, "curvature must be a name"),
    ({"temperature": 0.0}, ValueError, "temperature must be a positive finite number"),
    ({"temperature": float("nan")}, ValueError, "temperature must be"),
    ({"temperature": True}, TypeError, "temperature must be"),
    ({"temperature": "1"}, TypeError, "temperature must be"),
    ({"prior_precision": -1.0}, ValueError, "prior_precision must be a positive"),
    ({"prior_precision": float("inf")}, ValueError, "prior_precision must be a positive finite"),
    ({"prior_precision": "high"}, TypeError, "prior_precision must be"),
    ({"prior_precision": torch.ones(3)}, TypeError, "prior_precision must be"),
    ({"prior_precision": {"w": 0.0}}, ValueError, r"prior_precision\['w'\] must be"),
    ({"prior_precision": {"w": -torch.ones(3)}}, ValueError, r"prior_precision\['w'\] must be"),
    ({"prior_precision": {1: 1.0}}, TypeError, "prior_precision's keys"),
    ({"init_loc_fn": "module"}, TypeError, "init_loc_fn must be"),
]


@pytest.mark.parametrize("options, error, message", CONSTRUCTOR, ids=str)
def test_constructor(problem, options, error, message):
    arguments = {"model": problem.model, **options}
    with pytest.raises(error, match=message):
        LaplaceGuide(arguments.pop("model"), **arguments)


def test_numpy_and_tensor_scalars_are_numbers(problem):
    guide = LaplaceGuide(problem.model, temperature=np.float32(0.5), prior_precision=np.int64(2))
    guide.fit(problem.loader(), problem.num_data, map={"w": problem.mean}, progress=False)
    assert guide.temperature == 0.5
    LaplaceGuide(problem.model, prior_precision=torch.tensor(2.0))


def _fit_cases(problem):
    good = {"w": problem.mean}
    loader = problem.loader()
    empty = DataLoader(TensorDataset(problem.x[:0], problem.y[:0]), batch_size=4)
    return [
        ((loader, problem.num_data), {"map": 1}, TypeError, "map must be True, False or a dict"),
        ((loader, problem.num_data), {"map": {}}, ValueError, r"map=.*no value for .*'w'"),
        (
            (loader, problem.num_data),
            {"map": {**good, "v": good["w"]}},
            ValueError,
            r"fit\(map=...\): unknown site 'v'; the model's latent sites are",
        ),
        (
            (loader, problem.num_data),
            {"map": {"w": good["w"][:2]}},
            ValueError,
            r"map=.*'w' has shape",
        ),
        (
            (loader, problem.num_data),
            {"map": {"w": good["w"] * np.nan}},
            ValueError,
            r"'w' is not finite",
        ),
        (
            (loader, problem.num_data),
            {"map": {"w": [1.0, 2.0, 3.0]}},
            TypeError,
            r"'w' must be a tensor",
        ),
        (
            (loader, problem.num_data),
            {"num_steps": -1},
            ValueError,
            "num_steps must be an int >= 0",
        ),
        ((loader, problem.num_data), {"num_steps": 10.0}, TypeError, "num_steps must be an int"),
        ((loader, problem.num_data), {"max_passes": True}, TypeError, "max_passes must be"),
        ((loader, problem.num_data), {"mode_tolerance": 0}, ValueError, "mode_tolerance must be"),
        ((loader, problem.num_data), {"mode_tolerance": "tight"}, TypeError, "mode_tolerance"),
        (
            (loader, problem.num_data),
            {"optimizer": torch.optim.Adam},
            TypeError,
            "optimizer must be",
        ),
        ((loader, problem.num_data), {"progress": "no"}, TypeError, "progress must be"),
        (
            (empty, problem.num_data),
            {"map": good},
            ValueError,
            "DataLoader passed as argument 0 yields no batches",
        ),
        (
            (loader, 10),
            {"map": good},
            ValueError,
            "num_data must be the size of the whole training set",
        ),
        ((loader, 40.0), {"map": good}, TypeError, "num_data must be an int"),
    ]


def test_fit(problem):
    for args, options, error, message in _fit_cases(problem):
        guide = LaplaceGuide(problem.model, curvature="diag_ggn")
        with pytest.raises(error, match=message):
            guide.fit(*args, progress=options.pop("progress", False), **options)


PREDICTIVE = [
    ({"link": "softmax"}, ValueError, "link must be one of"),
    ({"link": 1}, ValueError, "link must be one of"),
    ({"num_samples": 0}, ValueError, "num_samples must be an int >= 1"),
    ({"num_samples": 2.5}, TypeError, "num_samples must be an int"),
    ({"num_samples": True}, TypeError, "num_samples must be"),
    ({"return_samples": 1}, TypeError, "return_samples must be"),
    ({"return_samples": True, "link": "probit"}, ValueError, "return_samples=True needs link='mc'"),
    ({"generator": 0}, TypeError, "generator must be"),
    ({"prior_precision": -2.0}, ValueError, "prior_precision must be"),
    (
        {"prior_precision": {"v": 1.0}},
        ValueError,
        r"prior_precision: unknown site 'v'; the model's latent sites are",
    ),
    ({"prior_precision": {"2.bias": torch.ones(2)}}, ValueError, "of '2.bias' has shape"),
]


@pytest.fixture
def classifier(helpers):
    net = bdl.lift(helpers.mlp(), prior=bdl.priors.IIDNormal(1.0))
    x, y = helpers.classification_data()
    guide = LaplaceGuide(helpers.classifier(net), curvature="diag_ggn")
    loader = TensorLoader((x, y), batch_size=20)
    guide.fit(loader, len(x), map=False, mode_tolerance=None, progress=False)
    return guide, x


@pytest.mark.parametrize("options, error, message", PREDICTIVE, ids=str)
def test_predictive(classifier, options, error, message):
    guide, x = classifier
    with pytest.raises(error, match=message):
        guide.predictive((x[:4], None), 60, **options)


def test_predictive_needs_a_fit_and_logits(problem, fitted):
    with pytest.raises(RuntimeError, match=r"call guide.fit"):
        LaplaceGuide(problem.model).predictive((problem.x, None), problem.num_data)
    with pytest.raises(ValueError, match=r"logits shaped \(batch, classes\)"):
        fitted.predictive((problem.x[:4], None), problem.num_data)  # returns (B,), not (B, C)


EVIDENCE = [
    (-1.0, ValueError, "prior_precision must be a positive"),
    (float("nan"), ValueError, "prior_precision must be a positive"),
    ("one", TypeError, "prior_precision must be"),
    ({"v": 1.0}, ValueError, r"prior_precision: unknown site 'v'; the model's latent sites are"),
    ({"w": torch.ones(4)}, ValueError, "prior_precision of 'w' has shape"),
    ({"w": torch.zeros(3)}, ValueError, r"prior_precision\['w'\] must be positive"),
    ({"w": torch.ones(3, dtype=torch.long)}, TypeError, r"prior_precision\['w'\] must be a float"),
]


@pytest.mark.parametrize("value, error, message", EVIDENCE, ids=str)
def test_log_marginal_likelihood(fitted, value, error, message):
    with pytest.raises(error, match=message):
        fitted.log_marginal_likelihood(prior_precision=value)


def test_log_marginal_likelihood_needs_a_fit(problem):
    with pytest.raises(RuntimeError, match=r"call guide.fit"):
        LaplaceGuide(problem.model).log_marginal_likelihood()


@pytest.mark.parametrize("prefix", [3, None, b"net.", ["net."]], ids=str)
def test_as_prior(fitted, prefix):
    with pytest.raises(TypeError, match="prefix must be a string"):
        fitted.as_prior(prefix)


def test_as_prior_needs_a_fit_and_the_fitted_sites(problem, fitted):
    with pytest.raises(RuntimeError, match=r"call guide.fit"):
        LaplaceGuide(problem.model).as_prior()
    prior = fitted.as_prior(prefix="other.")
    with pytest.raises(KeyError, match="LaplacePrior has no posterior for 'w'"):
        prior.distribution("w", torch.zeros(3))


@pytest.mark.parametrize(
    "value, error, message",
    [
        (0, ValueError, "num_samples must be"),
        (1.5, TypeError, "num_samples must be"),
        (None, TypeError, "num_samples must be"),
    ],
    ids=str,
)
def test_sample_posterior(fitted, value, error, message):
    with pytest.raises(error, match=message):
        fitted.sample_posterior(value)


FIT_MAP = [
    ({"num_steps": -1}, ValueError, "num_steps must be an int >= 0"),
    ({"num_steps": 5.0}, TypeError, "num_steps must be an int"),
    ({"num_steps": True}, TypeError, "num_steps must be"),
    ({"optimizer": torch.optim.Adam}, TypeError, "optimizer must be a pyro.optim"),
    ({"optimizer": "adam"}, TypeError, "optimizer must be a pyro.optim"),
    ({"mle": "yes"}, TypeError, "mle must be True or False"),
    ({"init_loc_fn": 0.0}, TypeError, "init_loc_fn must be"),
]


@pytest.mark.parametrize("options, error, message", FIT_MAP, ids=str)
def test_fit_map(problem, options, error, message):
    arguments = {"num_steps": 10, "progress": False, **options}
    with pytest.raises(error, match=message):
        fit_map(problem.model, problem.loader(), problem.num_data, **arguments)


def test_fit_map_stops_at_a_non_finite_loss(problem):
    x = problem.x.clone()
    x[3, 1] = float("nan")
    loader = TensorLoader((x, problem.y), batch_size=problem.num_data)
    with pytest.raises(ValueError, match=r"loss is not finite at step 0.*NaN or inf"):
        fit_map(problem.model, loader, problem.num_data, num_steps=5, progress=False)


def test_fit_map_needs_a_model():
    with pytest.raises(TypeError, match="model must be a Pyro model"):
        fit_map("model", torch.zeros(3), num_steps=1, progress=False)
