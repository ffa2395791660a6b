"""Every bad input to observe, to_arviz, the diagnostics, the metrics, the priors,
predict_proba and the log-joint helpers is a named error, raised at the call.

Each case is a call and the error it must raise: its type (``TypeError`` for the wrong
kind of object, ``ValueError`` for an impossible value) and a string its message must
hold, the name of the argument.
"""

import math

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
import xarray as xr
from pyro.infer import MCMC

import pyro_bdl as bdl
from pyro_bdl import diagnostics, metrics
from pyro_bdl.inference.log_joint import LogJoint, observed_num_data
from pyro_bdl.likelihoods import ObservationError
from pyro_bdl.predict import predict_proba
from pyro_bdl.priors import IIDNormal, IsotropicNormal, LayerwiseNormal, normal_prior

LOGITS = torch.zeros(4, 3)
NORMAL = dist.Normal(torch.zeros(4), 1.0)


def _observe(**kwargs):
    arguments = {"name": "y", "distribution": dist.Categorical(logits=LOGITS), "obs": None}
    bdl.observe(**{**arguments, **kwargs})


OBSERVE = [
    (lambda: _observe(name=3), TypeError, "name"),
    (lambda: _observe(name=None), TypeError, "name"),
    (lambda: _observe(distribution="Categorical"), TypeError, "distribution"),
    (lambda: _observe(distribution=LOGITS), TypeError, "distribution"),
    (lambda: _observe(distribution=dist.Normal(0.0, 1.0)), ValueError, "distribution"),
    (lambda: _observe(distribution=dist.Normal(torch.zeros(0), 1.0)), ValueError, "batch is empty"),
    (lambda: _observe(obs=[0, 1, 2, 0]), TypeError, "obs"),
    (lambda: _observe(obs=np.zeros(4)), TypeError, "obs"),
    (lambda: _observe(obs=torch.zeros(5, dtype=torch.long)), ValueError, "obs has shape"),
    (lambda: _observe(obs=torch.zeros(4, 1, dtype=torch.long)), ValueError, "obs has shape"),
    (lambda: _observe(obs=torch.tensor([0, 1, 3, 0])), ObservationError, "obs has 1 value(s)"),
    (lambda: _observe(obs=torch.tensor([0, -1, 2, 0])), ObservationError, "outside the support"),
    (lambda: _observe(obs=torch.tensor([0.0, 0.5, 1, 2])), ObservationError, "obs"),
    (
        lambda: _observe(
            distribution=dist.Bernoulli(logits=torch.zeros(4)), obs=torch.tensor([0.0, 2, 1, 0])
        ),
        ObservationError,
        "Bernoulli",
    ),
    (lambda: _observe(num_data=0), ValueError, "num_data"),
    (lambda: _observe(num_data=3), ValueError, "num_data"),
    (lambda: _observe(num_data=2.5), TypeError, "num_data"),
    (lambda: _observe(num_data=True), TypeError, "num_data"),
    (lambda: _observe(num_data="100"), TypeError, "num_data"),
    (lambda: _observe(mask=[True] * 4), TypeError, "mask"),
    (lambda: _observe(mask=torch.ones(4)), TypeError, "mask"),
    (lambda: _observe(mask=torch.ones(3, dtype=torch.bool)), ValueError, "mask has shape"),
    (lambda: _observe(mask=torch.ones(4, 1, dtype=torch.bool)), ValueError, "mask has shape"),
    (lambda: _observe(mask=True), TypeError, "mask"),
]


def _draws():
    return {"w": torch.randn(10, 3), "b": torch.randn(10)}


def _model(x, num_data=10):
    w = pyro.sample("w", dist.Normal(torch.zeros(3), 1.0).to_event(1))
    bdl.observe("y", dist.Normal(x @ w, 1.0), None, num_data)


TO_ARVIZ = [
    (lambda: bdl.to_arviz(3), TypeError, "source"),
    (lambda: bdl.to_arviz([torch.zeros(3)]), TypeError, "source"),
    (lambda: bdl.to_arviz({}), ValueError, "source"),
    (lambda: bdl.to_arviz({"w": [1, 2]}), TypeError, "source['w']"),
    (lambda: bdl.to_arviz({"w": torch.tensor(1.0)}), ValueError, "source['w']"),
    (lambda: bdl.to_arviz({"w": torch.zeros(5), "b": torch.zeros(4)}), ValueError, "source"),
    (
        lambda: bdl.to_arviz({"w": torch.zeros(5)}, grouped_by_chain=True),
        ValueError,
        "source['w']",
    ),
    (lambda: bdl.to_arviz({1: torch.zeros(5)}), TypeError, "keys of source"),
    (lambda: bdl.to_arviz(MCMC(pyro.infer.NUTS(_model), num_samples=2)), ValueError, "source"),
    (lambda: bdl.to_arviz(_draws(), num_samples=0), ValueError, "num_samples"),
    (lambda: bdl.to_arviz(_draws(), num_samples=True), TypeError, "num_samples"),
    (lambda: bdl.to_arviz(_draws(), model=3), TypeError, "model"),
    (lambda: bdl.to_arviz(_draws(), model_args="x"), TypeError, "model_args"),
    (lambda: bdl.to_arviz(_draws(), model_args=3), TypeError, "model_args"),
    (lambda: bdl.to_arviz(_draws(), model_kwargs=[1]), TypeError, "model_kwargs"),
    (lambda: bdl.to_arviz(_draws(), log_likelihood="yes"), TypeError, "log_likelihood"),
    (lambda: bdl.to_arviz(_draws(), log_likelihood=True), ValueError, "model"),
    (lambda: bdl.to_arviz(_draws(), posterior_predictive=1), TypeError, "posterior_predictive"),
    (lambda: bdl.to_arviz(_draws(), var_names=[1]), TypeError, "var_names"),
    (lambda: bdl.to_arviz(_draws(), var_names=[]), ValueError, "var_names"),
    (lambda: bdl.to_arviz(_draws(), var_names=["nope"]), ValueError, "var_names"),
    (lambda: bdl.to_arviz(_draws(), max_coords_per_var=0), ValueError, "max_coords_per_var"),
    (lambda: bdl.to_arviz(_draws(), max_coords_per_var=2.5), TypeError, "max_coords_per_var"),
    (lambda: bdl.to_arviz(_draws(), seed=-1), ValueError, "seed"),
    (lambda: bdl.to_arviz(_draws(), seed="0"), TypeError, "seed"),
    (lambda: bdl.to_arviz(_draws(), dims="w_dim"), TypeError, "dims"),
    (lambda: bdl.to_arviz(_draws(), dims={"w": "feature"}), TypeError, "dims['w']"),
    (lambda: bdl.to_arviz(_draws(), coords=[1, 2]), TypeError, "coords"),
    (lambda: bdl.to_arviz(_draws(), grouped_by_chain="no"), TypeError, "grouped_by_chain"),
    (lambda: bdl.to_arviz(_draws(), grouped_by_chain=None), TypeError, "grouped_by_chain"),
]

SAMPLES = np.random.default_rng(0).normal(size=(2, 20, 3))
DIAGNOSTIC_FUNCTIONS = [
    diagnostics.rhat,
    diagnostics.ess_bulk,
    diagnostics.ess_tail,
    diagnostics.diagnose,
]
DIAGNOSTIC_ARGUMENTS = [
    ({"samples": [[1.0, 2.0], [3.0, 4.0]]}, TypeError, "samples"),
    ({"samples": "draws"}, TypeError, "samples"),
    ({"samples": np.zeros(10)}, ValueError, "samples"),
    ({"samples": np.zeros((2, 0, 3))}, ValueError, "samples"),
    ({"samples": np.array([["a", "b"]])}, TypeError, "samples"),
    ({"samples": np.zeros((2, 5), dtype=complex)}, TypeError, "samples"),
    ({"chunk_size": 0}, ValueError, "chunk_size"),
    ({"chunk_size": True}, TypeError, "chunk_size"),
    ({"chunk_size": 1.5}, TypeError, "chunk_size"),
    ({"num_threads": 0}, ValueError, "num_threads"),
    ({"num_threads": "2"}, TypeError, "num_threads"),
]
TAIL_ARGUMENTS = [
    ({"prob": 1.5}, ValueError, "prob"),
    ({"prob": 0.0}, ValueError, "prob"),
    ({"prob": math.nan}, ValueError, "prob"),
    ({"prob": True}, TypeError, "prob"),
    ({"prob": (0.1,)}, TypeError, "prob"),
    ({"prob": (0.1, 1.2)}, ValueError, "prob[1]"),
    ({"prob": "0.9"}, TypeError, "prob"),
]


def _diagnostic_cases():
    for function in DIAGNOSTIC_FUNCTIONS:
        arguments = DIAGNOSTIC_ARGUMENTS
        if function in (diagnostics.ess_tail, diagnostics.diagnose):
            arguments = arguments + TAIL_ARGUMENTS
        for kwargs, error, name in arguments:
            call = lambda f=function, k=kwargs: f(**{"samples": SAMPLES, **k})  # noqa: E731
            yield pytest.param(call, error, name, id=f"{function.__name__}-{kwargs}")


def _tree():
    return xr.DataTree.from_dict(
        {"posterior": xr.Dataset({"w": (("chain", "draw", "i"), SAMPLES)})}
    )


SUMMARY = [
    (lambda: diagnostics.summary(3), TypeError, "idata"),
    (lambda: diagnostics.summary(SAMPLES), TypeError, "idata"),
    (lambda: diagnostics.summary(_tree(), group="prior"), ValueError, "group"),
    (lambda: diagnostics.summary(_tree(), group=3), TypeError, "group"),
    (lambda: diagnostics.summary(_tree(), fmt="csv"), ValueError, "fmt"),
    (lambda: diagnostics.summary(_tree(), var_names=["v"]), ValueError, "var_names"),
    (lambda: diagnostics.summary(_tree(), var_names=[3]), TypeError, "var_names"),
    (lambda: diagnostics.summary(_tree(), var_names=[]), ValueError, "var_names"),
    (lambda: diagnostics.summary(_tree(), prob=2.0), ValueError, "prob"),
    (lambda: diagnostics.summary(_tree(), chunk_size=-1), ValueError, "chunk_size"),
]

PROBS = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.8, 0.1]])
LABELS = torch.tensor([0, 1])
METRIC_FUNCTIONS = [
    metrics.accuracy,
    metrics.nll,
    metrics.brier,
    metrics.ece,
    metrics.reliability_curve,
    metrics.summarize,
]
METRIC_ARGUMENTS = [
    ((PROBS.tolist(), LABELS), TypeError, "probs"),
    ((PROBS, LABELS.tolist()), TypeError, "labels"),
    ((PROBS[0], LABELS), ValueError, "probs"),
    ((PROBS * 2, LABELS), ValueError, "probs"),
    ((torch.tensor([[math.nan, 0.5, 0.5], [0.1, 0.8, 0.1]]), LABELS), ValueError, "probs"),
    ((torch.tensor([[1.5, -0.5, 0.0], [0.1, 0.8, 0.1]]), LABELS), ValueError, "probs"),
    ((torch.tensor([[1, 0, 0], [0, 1, 0]]), LABELS), ValueError, "probs"),
    ((PROBS, torch.tensor([0.0, 1.0])), ValueError, "labels"),
    ((PROBS, torch.tensor([0, 3])), ValueError, "labels"),
    ((PROBS, torch.tensor([-1, 0])), ValueError, "labels"),
    ((PROBS, torch.tensor([0, 1, 1])), ValueError, "labels"),
    ((PROBS[:0], LABELS[:0]), ValueError, "probs"),
]
NUM_BINS = [
    (0, ValueError),
    (-3, ValueError),
    (2.5, TypeError),
    (True, TypeError),
    ("15", TypeError),
]


def _metric_cases():
    for function in METRIC_FUNCTIONS:
        for args, error, name in METRIC_ARGUMENTS:
            yield pytest.param(
                lambda f=function, a=args: f(*a), error, name, id=f"{function.__name__}"
            )
    for function in (metrics.ece, metrics.reliability_curve, metrics.summarize):
        for value, error in NUM_BINS:
            call = lambda f=function, v=value: f(PROBS, LABELS, num_bins=v)  # noqa: E731
            yield pytest.param(call, error, "num_bins", id=f"{function.__name__}-bins-{value!r}")


SCORES = torch.tensor([0.1, 0.9, 0.4, 0.6])
OTHER_METRICS = [
    (lambda: metrics.auroc(SCORES.tolist(), torch.tensor([0, 1, 0, 1])), TypeError, "scores"),
    (lambda: metrics.auroc(SCORES[None], torch.tensor([[0, 1, 0, 1]])), ValueError, "scores"),
    (
        lambda: metrics.auroc(torch.tensor([0.1, math.nan, 0.4, 0.6]), torch.tensor([0, 1, 0, 1])),
        ValueError,
        "scores",
    ),
    (lambda: metrics.auroc(SCORES, torch.tensor([0, 2, 0, 1])), ValueError, "labels"),
    (lambda: metrics.auroc(SCORES, torch.tensor([0, 1, 0])), ValueError, "labels"),
    (lambda: metrics.auroc(SCORES, torch.tensor([1, 1, 1, 1])), ValueError, "labels"),
    (lambda: metrics.uncertainty_decomposition(PROBS), ValueError, "probs"),
    (lambda: metrics.uncertainty_decomposition(PROBS[None].tolist()), TypeError, "probs"),
    (lambda: metrics.uncertainty_decomposition(-PROBS[None]), ValueError, "probs"),
    (lambda: metrics.uncertainty_decomposition(PROBS[None] * math.nan), ValueError, "probs"),
    (lambda: metrics.uncertainty_decomposition(PROBS[None].long()), ValueError, "probs"),
]

PARAM = torch.zeros(3, 2)
PRIORS = [
    (lambda: IIDNormal(scale=0.0), ValueError, "scale"),
    (lambda: IIDNormal(scale=-1.0), ValueError, "scale"),
    (lambda: IIDNormal(scale=math.inf), ValueError, "scale"),
    (lambda: IIDNormal(scale=math.nan), ValueError, "scale"),
    (lambda: IIDNormal(scale=True), TypeError, "scale"),
    (lambda: IIDNormal(scale="0.1"), TypeError, "scale"),
    (lambda: IIDNormal(loc=math.nan), ValueError, "loc"),
    (lambda: IIDNormal(loc=math.inf), ValueError, "loc"),
    (lambda: IIDNormal(loc=None), TypeError, "loc"),
    (lambda: LayerwiseNormal(3.0), TypeError, "scale"),
    (lambda: LayerwiseNormal({"w": -1.0}), ValueError, "scale['w']"),
    (lambda: LayerwiseNormal({"w": math.inf}), ValueError, "scale['w']"),
    (lambda: LayerwiseNormal({"w": True}), TypeError, "scale['w']"),
    (lambda: LayerwiseNormal({3: 1.0}), TypeError, "scale key"),
    (lambda: LayerwiseNormal({"w": 1.0}, default=0.0), ValueError, "default"),
    (lambda: LayerwiseNormal({"w": 1.0}, default=True), TypeError, "default"),
    (lambda: LayerwiseNormal(lambda n, p: -1.0).scale_of("w", PARAM), ValueError, "scale of 'w'"),
    (lambda: LayerwiseNormal(lambda n, p: "big").scale_of("w", PARAM), TypeError, "scale of 'w'"),
    (lambda: LayerwiseNormal({"w": 1.0}).scale_of("v", PARAM), KeyError, "no scale for 'v'"),
    (
        lambda: LayerwiseNormal(lambda n, p: math.nan).scale_of("w", PARAM),
        ValueError,
        "scale of 'w'",
    ),
    (
        lambda: LayerwiseNormal(lambda n, p: math.inf).scale_of("w", PARAM),
        ValueError,
        "scale of 'w'",
    ),
    (lambda: LayerwiseNormal.fan_in(gain=0.0), ValueError, "gain"),
    (lambda: LayerwiseNormal.fan_in(gain=math.nan), ValueError, "gain"),
    (lambda: LayerwiseNormal.fan_in(gain=True), TypeError, "gain"),
    (lambda: LayerwiseNormal.fan_in(bias_scale=-1.0), ValueError, "bias_scale"),
    (lambda: LayerwiseNormal.fan_in(bias_scale="1"), TypeError, "bias_scale"),
    (lambda: normal_prior([0.0, 1.0], 0.0, 1.0), TypeError, "param"),
    (lambda: normal_prior(torch.zeros(3, dtype=torch.long), 0.0, 1.0), TypeError, "param"),
    (lambda: normal_prior(PARAM, math.nan, 1.0), ValueError, "loc"),
    (lambda: normal_prior(PARAM, 0.0, 0.0), ValueError, "scale"),
    (lambda: normal_prior(PARAM, 0.0, torch.tensor([1.0, 0.0])), ValueError, "scale"),
    (lambda: normal_prior(PARAM, 0.0, torch.tensor([1.0, math.inf])), ValueError, "scale"),
    (lambda: normal_prior(PARAM, torch.zeros(4), 1.0), ValueError, "loc"),
    (lambda: normal_prior(PARAM, "0", 1.0), TypeError, "loc"),
    (lambda: IsotropicNormal(0.0, -1.0, PARAM), ValueError, "scale"),
    (lambda: IsotropicNormal(math.inf, 1.0, PARAM), ValueError, "loc"),
    (lambda: IsotropicNormal(0.0, 1.0, [0.0]), TypeError, "like"),
    (lambda: IsotropicNormal(0.0, True, PARAM), TypeError, "scale"),
    (lambda: IsotropicNormal("0", 1.0, PARAM), TypeError, "loc"),
]


def _classifier(x, num_data=10):
    w = pyro.sample("w", dist.Normal(torch.zeros(3, 2), 1.0).to_event(2))
    logits = x @ w
    bdl.observe("y", dist.Categorical(logits=logits), None, num_data)
    return logits


X = torch.randn(4, 3)
PREDICT = [
    (lambda: predict_proba(3, X), TypeError, "model"),
    (lambda: predict_proba(_classifier, X, samples=[torch.zeros(2, 3, 2)]), TypeError, "samples"),
    (lambda: predict_proba(_classifier, X, samples={}), ValueError, "samples"),
    (lambda: predict_proba(_classifier, X, samples={"w": [[0.0]]}), TypeError, "samples['w']"),
    (
        lambda: predict_proba(_classifier, X, samples={"w": torch.tensor(0.0)}),
        ValueError,
        "samples['w']",
    ),
    (
        lambda: predict_proba(
            _classifier, X, samples={"w": torch.zeros(2, 3, 2), "v": torch.zeros(3)}
        ),
        ValueError,
        "samples",
    ),
    (lambda: predict_proba(_classifier, X, guide=3, num_samples=2), TypeError, "guide"),
    (lambda: predict_proba(_classifier, X, guide=_classifier), ValueError, "num_samples"),
    (
        lambda: predict_proba(_classifier, X, guide=_classifier, num_samples=0),
        ValueError,
        "num_samples",
    ),
    (
        lambda: predict_proba(_classifier, X, guide=_classifier, num_samples=True),
        TypeError,
        "num_samples",
    ),
    (
        lambda: predict_proba(
            _classifier, X, samples={"w": torch.zeros(2, 3, 2)}, guide=_classifier
        ),
        ValueError,
        "samples or guide",
    ),
    (lambda: predict_proba(_model, X), ValueError, "logits"),
]


def _trace():
    def observed(x):
        bdl.observe("y", dist.Normal(x.sum(-1), 1.0), torch.zeros(len(x)), 10)

    return pyro.poutine.trace(observed).get_trace(X)


LOG_JOINT = [
    (lambda: LogJoint(3), TypeError, "values"),
    (lambda: LogJoint([torch.zeros(3)]), TypeError, "values"),
    (lambda: LogJoint({}, analytic_priors="yes"), TypeError, "analytic_priors"),
    (lambda: LogJoint({}, analytic_priors=1), TypeError, "analytic_priors"),
    (lambda: LogJoint(None), TypeError, "values"),
    (lambda: observed_num_data(3), TypeError, "trace"),
    (lambda: observed_num_data(_trace(), 0), ValueError, "num_data"),
    (lambda: observed_num_data(_trace(), 2.5), TypeError, "num_data"),
    (lambda: observed_num_data(_trace(), True), TypeError, "num_data"),
    (lambda: observed_num_data(_trace(), 5), ValueError, "num_data=5"),
    (lambda: observed_num_data(_trace(), full_batch="no"), TypeError, "full_batch"),
]

CASES = {
    "observe": OBSERVE,
    "to_arviz": TO_ARVIZ,
    "diagnostics.summary": SUMMARY,
    "metrics.auroc, uncertainty_decomposition": OTHER_METRICS,
    "priors": PRIORS,
    "predict_proba": PREDICT,
    "log_joint": LOG_JOINT,
}


def _all_cases():
    for group, cases in CASES.items():
        for i, (call, error, name) in enumerate(cases):
            yield pytest.param(call, error, name, id=f"{group}-{i}-{name}")
    yield from _diagnostic_cases()
    yield from _metric_cases()


@pytest.mark.parametrize("call, error, name", _all_cases())
def test_bad_input_is_a_named_error(call, error, name):
    with pytest.raises(error) as raised:
        call()
    assert name in str(raised.value)


def test_numpy_and_tensor_scalars_are_numbers():
    assert IIDNormal(scale=np.float32(0.5), loc=torch.tensor(1.0)).scale == 0.5
    assert metrics.ece(PROBS, LABELS, num_bins=np.int64(5)) >= 0
    assert diagnostics.ess_tail(SAMPLES, prob=np.float64(0.9)).shape == (3,)
    trace = pyro.poutine.trace(_model).get_trace(X, np.int64(10))
    assert observed_num_data(trace, torch.tensor(10)) == 10


def test_draws_grouped_by_chain_given_as_draws_name_the_site_and_the_shape():
    samples = {"w": torch.zeros(2, 5, 3, 2)}  # get_samples(group_by_chain=True)
    with pytest.raises(ValueError, match=r"site 'w' has shape \(5, 3, 2\), but the site has"):
        predict_proba(_classifier, X, samples=samples)


def test_log_likelihood_of_a_model_that_observes_nothing_is_an_error():
    draws = {"w": torch.zeros(4, 3)}
    with pytest.raises(ValueError, match="the model observes nothing"):
        bdl.to_arviz(draws, model=_model, model_args=(X,), log_likelihood=True)
