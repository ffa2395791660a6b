"""Models ported from Pyro's own examples and tutorials, shared by the tests of every method.

Each model is written here from the Pyro original named in its docstring, with the
original's idioms kept (``PyroModule`` / ``PyroSample``, ``pyro.condition`` with the
data in a closure, ``pyro.plate(..., subsample_size=...)`` indexing the data,
``pyro.deterministic``, ``poutine.scale``, a Python loop of observed sites, latents in
a plate), so that a test runs a Pyro user's model unchanged. Where the original reads a
data set from the network (the rugged data of the regression tutorial) or from scikit-
learn, the data are synthetic, of the same shapes, generated here with a fixed seed.

:data:`MODELS` maps a name to a :class:`PortedModel`; ``PortedModel.make()`` builds the
model and its arguments in the current default dtype (tests set float64). Tests import
this module as ``pyro_models`` (the root ``conftest.py`` puts this folder on ``sys.path``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.nn import PyroModule, PyroSample
from torch import nn

from pyro_bdl.data import TensorLoader

__all__ = ["PortedModel", "MODELS", "LAPLACE_MODELS"]


@dataclass
class PortedModel:
    """A model from Pyro's examples, with what the tests need to know about it.

    :ivar str name: a short name (the test id).
    :ivar callable build: ``build(full_batch: bool) -> (model, args, kwargs)``; with
        ``full_batch`` the same model without subsampling, for references (Pyro's
        autoguides and NUTS see every example at every step).
    :ivar str source: where in Pyro the original lives.
    :ivar tuple idioms: the Pyro idioms it exercises.
    :ivar bool has_mode: whether its log joint in the unconstrained space has a mode (the
        centred eight schools is a funnel with none, so no Laplace approximation).
    :ivar callable exact: ``() -> (mean, covariance)`` of the exact posterior of the
        unconstrained latent vector where it is Gaussian, or of the Laplace
        approximation where that has a closed form; None otherwise.
    """

    name: str
    build: Callable[[bool], tuple[Callable, tuple, dict]]
    source: str
    idioms: tuple[str, ...]
    has_mode: bool = True
    exact: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = field(default=None)

    def make(self, full_batch: bool = False) -> tuple[Callable, tuple, dict]:
        """The model and its arguments, in the default dtype, data from a fixed seed."""
        return self.build(full_batch)


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(0)


# -- the Bayesian regression tutorial ------------------------------------------------------


class BayesianRegression(PyroModule):
    """Pyro tutorial "Bayesian Regression - Introduction (Part 1)"
    (``tutorial/source/bayesian_regression.ipynb``): ``PyroModule[nn.Linear]`` whose weight
    and bias are ``PyroSample`` priors, and a noise ``sigma ~ Uniform(0, 10)``."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.linear = PyroModule[nn.Linear](in_features, out_features)
        self.linear.weight = PyroSample(
            dist.Normal(0.0, 1.0).expand([out_features, in_features]).to_event(2)
        )
        self.linear.bias = PyroSample(dist.Normal(0.0, 10.0).expand([out_features]).to_event(1))

    def forward(self, x, y=None):
        sigma = pyro.sample("sigma", dist.Uniform(0.0, 10.0))
        mean = self.linear(x).squeeze(-1)
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Normal(mean, sigma), obs=y)
        return mean


def _rugged_like(num_data: int = 170) -> tuple[torch.Tensor, torch.Tensor]:
    """Data shaped as the tutorial's: [cont_africa, ruggedness, their product] -> log GDP."""
    generator = _generator()
    africa = (torch.rand(num_data, generator=generator) < 0.3).to(torch.get_default_dtype())
    rugged = 2 * torch.rand(num_data, generator=generator)
    x = torch.stack([africa, rugged, africa * rugged], -1)
    noise = 0.9 * torch.randn(num_data, generator=generator)
    y = 9.2 - 1.9 * africa - 0.2 * rugged + 0.4 * africa * rugged + noise
    return x, y


def _regression(full_batch: bool):
    x, y = _rugged_like()
    return BayesianRegression(3, 1), (x, y), {}


# -- eight schools ------------------------------------------------------------------------

_SCHOOLS_Y = [28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0]
_SCHOOLS_SIGMA = [15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0]


def _schools_data():
    return torch.tensor(_SCHOOLS_Y), torch.tensor(_SCHOOLS_SIGMA)


def eight_schools(sigma):
    """Pyro's ``examples/eight_schools/mcmc.py`` (non-centred): ``eta`` a batch of 8
    standard normals outside any plate, ``tau ~ HalfCauchy(25)``, ``theta = mu + tau * eta``
    and ``obs`` unobserved in the model itself."""
    num_schools = len(sigma)
    eta = pyro.sample("eta", dist.Normal(sigma.new_zeros(num_schools), sigma.new_ones(num_schools)))
    mu = pyro.sample("mu", dist.Normal(sigma.new_zeros(1), 10 * sigma.new_ones(1)))
    tau = pyro.sample("tau", dist.HalfCauchy(scale=25 * sigma.new_ones(1)))
    theta = mu + tau * eta
    return pyro.sample("obs", dist.Normal(theta, sigma))


def _eight_schools(full_batch: bool):
    y, sigma = _schools_data()

    def conditioned_model():
        # as mcmc.py's conditioned_model: poutine.condition, the data in a closure
        return poutine.condition(eight_schools, data={"obs": y})(sigma)

    return conditioned_model, (), {}


def eight_schools_centred(sigma, y=None):
    """The centred eight schools (Gelman et al., BDA3 section 5.5), the parametrisation
    beside Pyro's ``examples/eight_schools``: ``theta ~ Normal(mu, tau)`` in a plate."""
    mu = pyro.sample("mu", dist.Normal(sigma.new_zeros(()), 5.0))
    tau = pyro.sample("tau", dist.HalfCauchy(sigma.new_tensor(5.0)))
    with pyro.plate("schools", len(sigma)):
        theta = pyro.sample("theta", dist.Normal(mu, tau))
        pyro.sample("obs", dist.Normal(theta, sigma), obs=y)


def _eight_schools_centred(full_batch: bool):
    y, sigma = _schools_data()
    return eight_schools_centred, (sigma, y), {}


# -- subsampling ------------------------------------------------------------------------


def logistic_regression(x, y, subsample_size=50):
    """Logistic regression subsampled with ``pyro.plate("data", N, subsample_size=50)``
    whose indices select the minibatch, as in Pyro's "SVI Part II" tutorial
    (``tutorial/source/svi_part_ii.ipynb``, "Automatic subsampling with plate")."""
    w = pyro.sample("w", dist.Normal(x.new_zeros(x.shape[1]), 1.0).to_event(1))
    b = pyro.sample("b", dist.Normal(x.new_zeros(()), 1.0))
    with pyro.plate("data", len(x), subsample_size=subsample_size) as ind:
        logits = x[ind] @ w + b
        pyro.sample("obs", dist.Bernoulli(logits=logits), obs=y[ind])


def _logistic(full_batch: bool):
    generator = _generator()
    num_data, dim = 230, 3  # 230 = 4 * 50 + 30: the last chunk of 50 repeats 20
    x = torch.randn(num_data, dim, generator=generator)
    logits = x @ torch.tensor([1.0, -1.5, 0.5]) + 0.3
    y = (torch.rand(num_data, generator=generator) < torch.sigmoid(logits)).to(x.dtype)
    return logistic_regression, (x, y), {"subsample_size": None if full_batch else 50}


def _coin_data():
    # "SVI Part I": six heads and four tails
    return torch.tensor([1.0] * 6 + [0.0] * 4)


def coin(data):
    """Pyro's "SVI Part I" tutorial (``svi_part_i.ipynb``): a Beta(10, 10) fairness and one
    observed site per toss, in a Python loop (a sum of ten likelihood terms)."""
    alpha0, beta0 = data.new_tensor(10.0), data.new_tensor(10.0)
    f = pyro.sample("latent_fairness", dist.Beta(alpha0, beta0))
    for i in range(len(data)):
        pyro.sample(f"obs_{i}", dist.Bernoulli(f), obs=data[i])


def coin_subsampled(data, subsample_size=5):
    """Pyro's "SVI Part II" tutorial (``svi_part_ii.ipynb``): the same coin observed in a
    vectorised plate that draws 5 of the 10 tosses at each step."""
    alpha0, beta0 = data.new_tensor(10.0), data.new_tensor(10.0)
    f = pyro.sample("latent_fairness", dist.Beta(alpha0, beta0))
    with pyro.plate("observe_data", size=len(data), subsample_size=subsample_size) as ind:
        pyro.sample("obs", dist.Bernoulli(f), obs=data.index_select(0, ind))


def _coin_laplace() -> tuple[torch.Tensor, torch.Tensor]:
    # The posterior is Beta(16, 14); in z = logit(f), with the Jacobian f (1 - f), its
    # density is proportional to f^16 (1 - f)^14: mode f* = 16 / 30, and the negative
    # second derivative in z is (16 + 14) f* (1 - f*).
    f = torch.tensor(16.0 / 30.0)
    return torch.logit(f).reshape(1), (1 / (30.0 * f * (1 - f))).reshape(1, 1)


def _coin(full_batch: bool):
    return coin, (_coin_data(),), {}


def _coin_subsampled(full_batch: bool):
    return coin_subsampled, (_coin_data(),), {"subsample_size": None if full_batch else 5}


# -- pyro.condition, poutine.scale -------------------------------------------------------

_GUESS, _MEASUREMENT, _NOISE = 8.5, 9.5, 0.75


def scale(guess):
    """Pyro's "Introduction to Pyro" tutorial (``intro_part_ii.ipynb``): a scalar weight
    measured once with noise 0.75."""
    weight = pyro.sample("weight", dist.Normal(guess, 1.0))
    return pyro.sample("measurement", dist.Normal(weight, _NOISE))


def _scale(full_batch: bool):
    conditioned_scale = pyro.condition(scale, data={"measurement": torch.tensor(_MEASUREMENT)})
    return conditioned_scale, (torch.tensor(_GUESS),), {}


def _scale_posterior(prior_weight: float = 1.0):
    # A Normal prior N(guess, 1) tempered by prior_weight and one Normal measurement.
    precision = prior_weight + 1 / _NOISE**2
    mean = (prior_weight * _GUESS + _MEASUREMENT / _NOISE**2) / precision
    return torch.tensor([mean]), torch.tensor([[1 / precision]])


ANNEALING = 0.25


def annealed_scale(guess, annealing_factor=ANNEALING):
    """The tutorial's scale model with its prior term annealed by ``poutine.scale``, the
    KL-annealing idiom of Pyro's ``examples/dmm.py``."""
    with poutine.scale(scale=annealing_factor):
        weight = pyro.sample("weight", dist.Normal(guess, 1.0))
    return pyro.sample("measurement", dist.Normal(weight, _NOISE), obs=guess.new_tensor(9.5))


def _annealed(full_batch: bool):
    return annealed_scale, (torch.tensor(_GUESS),), {}


# -- pyro.deterministic -----------------------------------------------------------------


def counts_model(features, counts):
    """Pyro's "Utilizing Predictive and Deterministic with MCMC and SVI" tutorial
    (``predictive_deterministic.ipynb``): a hierarchical ``coef``, the ``rate`` recorded
    with ``pyro.deterministic``, and a GammaPoisson likelihood."""
    num_data, num_features = features.shape
    scale = pyro.sample("scale", dist.LogNormal(features.new_tensor(0.0), 1.0))
    coef = pyro.sample("coef", dist.Normal(0, scale).expand([num_features]).to_event(1))
    rate = pyro.deterministic("rate", torch.nn.functional.softplus(coef @ features.T))
    concentration = pyro.sample("concentration", dist.LogNormal(features.new_tensor(0.0), 1.0))
    with pyro.plate("bins", num_data):
        return pyro.sample("counts", dist.GammaPoisson(concentration, rate), obs=counts)


def _counts(full_batch: bool):
    # As the tutorial's sklearn make_regression(n_features=1, bias=150, noise=5), cubed.
    generator = _generator()
    x = torch.randn(100, 1, generator=generator)
    y = 60.0 * x[:, 0] + 150.0 + 5.0 * torch.randn(100, generator=generator)
    counts = (y**3 / 100000.0 + 10.0).round().clamp(min=0)
    return counts_model, (x, counts), {}


# -- DataLoader minibatches (svi_torch.py) ---------------------------------------------


class LinearRegression(PyroModule):
    """Pyro's ``examples/svi_torch.py``: ``coeff``, ``bias`` and a LogNormal ``scale``, the
    data plate of the full size subsampled to the minibatch a DataLoader gives."""

    def __init__(self, size):
        super().__init__()
        self.size = size
        self.register_buffer("zero", torch.tensor(0.0))

    def forward(self, covariates, data=None):
        coeff = pyro.sample("coeff", dist.Normal(self.zero, 1))
        bias = pyro.sample("bias", dist.Normal(self.zero, 1))
        scale = pyro.sample("scale", dist.LogNormal(self.zero, 1))
        with pyro.plate("data", self.size, len(covariates)):
            loc = bias + coeff * covariates
            return pyro.sample("obs", dist.Normal(loc, scale), obs=data)


def _svi_torch(full_batch: bool):
    generator = _generator()
    size = 120
    covariates = torch.randn(size, generator=generator)
    data = 0.7 * covariates - 0.4 + 0.5 * torch.randn(size, generator=generator)
    module = LinearRegression(size).to(torch.get_default_dtype())
    if full_batch:
        return module, (covariates, data), {}
    loader = TensorLoader((covariates, data), batch_size=32)

    def model(batch):
        # svi_torch.py calls the model on each (covariates, data) minibatch in its loop
        return module(*batch)

    return model, (loader,), {}


MODELS: dict[str, PortedModel] = {
    model.name: model
    for model in [
        PortedModel(
            "regression",
            _regression,
            "tutorial/source/bayesian_regression.ipynb",
            ("PyroModule[nn.Linear]", "PyroSample", "Uniform sigma", "constant plate"),
        ),
        PortedModel(
            "eight_schools",
            _eight_schools,
            "examples/eight_schools/mcmc.py",
            ("poutine.condition", "data in a closure", "HalfCauchy", "batch latent"),
        ),
        PortedModel(
            "eight_schools_centred",
            _eight_schools_centred,
            "examples/eight_schools (centred, BDA3 5.5)",
            ("latent in a plate", "hierarchical prior", "HalfCauchy"),
            has_mode=False,
        ),
        PortedModel(
            "logistic_subsample",
            _logistic,
            "tutorial/source/svi_part_ii.ipynb (subsampling)",
            ("pyro.plate subsample_size", "data indexed by the plate"),
        ),
        PortedModel(
            "coin",
            _coin,
            "tutorial/source/svi_part_i.ipynb",
            ("Beta latent", "several observed sites", "0-d latent"),
            exact=_coin_laplace,
        ),
        PortedModel(
            "coin_subsample",
            _coin_subsampled,
            "tutorial/source/svi_part_ii.ipynb",
            ("Beta latent", "pyro.plate subsample_size", "index_select"),
            exact=_coin_laplace,
        ),
        PortedModel(
            "scale",
            _scale,
            "tutorial/source/intro_part_ii.ipynb",
            ("pyro.condition", "0-d latent", "global observation"),
            exact=_scale_posterior,
        ),
        PortedModel(
            "annealed_scale",
            _annealed,
            "examples/dmm.py (poutine.scale annealing) on intro_part_ii's model",
            ("poutine.scale", "0-d latent"),
            exact=lambda: _scale_posterior(ANNEALING),
        ),
        PortedModel(
            "counts_deterministic",
            _counts,
            "tutorial/source/predictive_deterministic.ipynb",
            ("pyro.deterministic", "hierarchical prior", "LogNormal", "GammaPoisson"),
        ),
        PortedModel(
            "svi_torch_dataloader",
            _svi_torch,
            "examples/svi_torch.py",
            ("DataLoader minibatches", "plate subsampled to the batch", "LogNormal scale"),
        ),
    ]
}

#: The models whose log joint has a mode: those a Laplace approximation applies to.
LAPLACE_MODELS = [name for name, model in MODELS.items() if model.has_mode]
