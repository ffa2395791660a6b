"""The models of issue 22 with their NUTS references, for the adaptation tests and benchmarks.

Each ``make_*`` returns a :class:`Case`: a Pyro model written as its users write it, its
arguments, and the posterior means and standard deviations of its latent sites from a
long NUTS run (``references/*.json``, made by ``references/make_references.py``, which
records how). ``minibatch`` makes the model subsample its data with Pyro's own idiom,
``pyro.plate("data", N, subsample_size=B)`` indexing its tensors.

- ``breast_cancer``: logistic regression on scikit-learn's breast-cancer data, the first
  8 features standardised, N = 569, ``w ~ Normal(0, 1)``, ``b ~ Normal(0, 5)`` (the
  issue's reproducer).
- ``regression``: Pyro's Bayesian regression tutorial model (``PyroModule[nn.Linear]``
  with ``PyroSample`` priors, ``sigma ~ Uniform(0, 10)``), ``BayesianRegression`` of
  ``tests/pyro_models.py``, on data simulated like its rugged-terrain data (170
  countries, ``cont_africa``, ``rugged`` and their product; the data its NUTS reference
  was made on, drawn apart from ``pyro_models``'), since the tutorial downloads its CSV.
- ``eight_schools``: the non-centred eight-schools model of Pyro's
  ``examples/eight_schools``; ``tau`` is compared on the log scale (its sd is that of a
  Cauchy-like tail, whose Monte Carlo error is unbounded).
- ``gaussian``: a 2-d Gaussian with standard deviations 1 and 1 / sqrt(1000) (condition
  number 1,000), a model without data.
- ``moons``: a 2-H-1 tanh MLP made random by :func:`pyro_bdl.lift` (the library's default
  prior, ``IIDNormal(1.0)`` on every weight) on scikit-learn's ``make_moons``, compared
  in function space: the network's logit at ``MOONS_GRID``, points over and just
  outside the data (weight-space moments mean nothing under the hidden units'
  permutation and sign symmetries). Its NUTS reference's four chains, started apart,
  agree on the logits (R-hat at most 1.001, bulk ESS at least 2,847). The network runs
  on all the data and the plate subsamples its logits: a lifted network called inside a
  subsampled plate would have its weights broadcast over the plate.

Eight schools here has the priors of Stan's and BDA3's non-centred model (``mu ~
Normal(0, 5)``, ``tau ~ HalfCauchy(5)``, ``eta`` in a plate), not those of Pyro's example
(``Normal(0, 10)``, ``HalfCauchy(25)``) that ``tests/pyro_models.py`` ports: its NUTS
reference (25 minutes on two shared cores) was made on this one.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import MCMC

REFERENCES = Path(__file__).parent / "references"


@dataclass
class Case:
    """A model, its arguments and how its draws are compared with NUTS's."""

    name: str
    model: object
    args: tuple
    #: site -> function of the draws ``(num_draws, *shape)`` giving the compared values
    compared: dict = field(default_factory=dict)
    kernel_options: dict = field(default_factory=dict)

    def reference(self) -> dict[str, dict[str, list[float]]]:
        """NUTS's ``{"mean": [...], "sd": [...]}`` of each compared site."""
        return json.loads((REFERENCES / f"{self.name}.json").read_text())["sites"]

    def summarise(self, samples: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The compared values of ``samples`` (site -> ``(num_draws, k)``)."""
        out = {}
        for name, transform in self.compared.items():
            values = transform(samples) if callable(transform) else samples[name]
            out[name] = values.reshape(len(values), -1).double()
        return out


def _f64(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float64)


def _plate(size: int, minibatch: int | None):
    return pyro.plate("data", size, subsample_size=minibatch)


def make_breast_cancer(minibatch: int | None = None) -> Case:
    from sklearn.datasets import load_breast_cancer

    data = load_breast_cancer()
    x = torch.tensor(data.data[:, :8], dtype=torch.float64)
    x = (x - x.mean(0)) / x.std(0)
    y = torch.tensor(data.target, dtype=torch.float64)

    def model(x, y):
        w = pyro.sample("w", dist.Normal(torch.zeros(8, dtype=torch.float64), 1.0).to_event(1))
        b = pyro.sample("b", dist.Normal(_f64(0.0), 5.0))
        with _plate(len(y), minibatch) as index:
            pyro.sample("obs", dist.Bernoulli(logits=x[index] @ w + b), obs=y[index])

    return Case("breast_cancer", model, (x, y), {"w": None, "b": None})


def make_regression() -> Case:
    # the tutorial's model as tests/pyro_models.py ports it, built in the default dtype
    # (float64 in tests and in the scripts that load this module)
    from pyro_models import BayesianRegression

    generator = torch.Generator().manual_seed(1)
    size = 170
    africa = (torch.rand(size, generator=generator, dtype=torch.float64) < 0.3).double()
    rugged = -1.2 * torch.log(torch.rand(size, generator=generator, dtype=torch.float64))
    noise = 0.9 * torch.randn(size, generator=generator, dtype=torch.float64)
    y = 9.2 - 1.9 * africa - 0.2 * rugged + 0.4 * africa * rugged + noise
    x = torch.stack([africa, rugged, africa * rugged], 1)
    names = ("linear.weight", "linear.bias", "sigma")
    return Case("regression", BayesianRegression(3, 1), (x, y), dict.fromkeys(names))


def make_eight_schools() -> Case:
    y = torch.tensor([28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0], dtype=torch.float64)
    sigma = torch.tensor([15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0], dtype=torch.float64)

    def model(sigma, y):
        mu = pyro.sample("mu", dist.Normal(_f64(0.0), 5.0))
        tau = pyro.sample("tau", dist.HalfCauchy(_f64(5.0)))
        with pyro.plate("schools", len(y)):
            eta = pyro.sample("eta", dist.Normal(_f64(0.0), 1.0))
            pyro.sample("obs", dist.Normal(mu + tau * eta, sigma), obs=y)

    compared = {"mu": None, "eta": None, "tau": lambda s: s["tau"].log()}
    # The prior mean of a HalfCauchy is infinite: start where NUTS does by default.
    init = {"init_params": pyro.infer.autoguide.initialization.init_to_median}
    return Case("eight_schools", model, (sigma, y), compared, init)


def make_gaussian() -> Case:
    scale = torch.tensor([1.0, 1000**-0.5], dtype=torch.float64)

    def model():
        pyro.sample("z", dist.Normal(torch.zeros(2, dtype=torch.float64), scale).to_event(1))

    return Case("gaussian", model, (), {"z": None}, {"num_data": 1})


#: Where ``moons`` compares the network's logit: a 4 x 3 grid over and just outside the
#: data (x in [-1.1, 2.1], y in [-0.6, 1.1] for noise 0.2).
MOONS_GRID = torch.cartesian_prod(
    torch.linspace(-1.5, 2.5, 4, dtype=torch.float64),
    torch.linspace(-1.0, 1.5, 3, dtype=torch.float64),
)
MOONS_HIDDEN = 8


def make_moons(minibatch: int | None = None) -> Case:
    from sklearn.datasets import make_moons as moons

    import pyro_bdl as bdl

    inputs, labels = moons(n_samples=150, noise=0.2, random_state=0)
    x = torch.tensor(inputs, dtype=torch.float64)
    y = torch.tensor(labels, dtype=torch.float64)
    torch.manual_seed(0)  # the module's initial weights are where the chains start
    layers = (
        torch.nn.Linear(2, MOONS_HIDDEN),
        torch.nn.Tanh(),
        torch.nn.Linear(MOONS_HIDDEN, 1),
    )
    net = bdl.lift(torch.nn.Sequential(*layers).double())

    def model(x, y):
        logits = net(x).squeeze(-1)
        with _plate(len(y), minibatch) as index:
            pyro.sample("obs", dist.Bernoulli(logits=logits[index]), obs=y[index])

    def logits(samples):
        # draws stacked in front: the lifted network runs them at once (torch.func.vmap)
        draws = {site: samples[site] for site in net.random_sites}
        with torch.no_grad():
            return pyro.poutine.condition(net, data=draws)(MOONS_GRID).squeeze(-1)

    return Case("moons", model, (x, y), {"logit": logits})


def sample(case: Case, kernel, num_samples: int, warmup_steps: int, seed: int = 0) -> dict:
    """Run ``kernel`` on ``case``'s model through Pyro's ``MCMC`` from ``seed``; its draws.

    The kernels' convergence warnings are silenced here: the tests that judge them catch
    them on their own runs.
    """
    pyro.set_rng_seed(seed)
    mcmc = MCMC(kernel, num_samples=num_samples, warmup_steps=warmup_steps, disable_progbar=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        warnings.simplefilter("ignore", UserWarning)  # the Gaussian samples its "prior"
        mcmc.run(*case.args)
    return mcmc.get_samples()


CASES = {
    "breast_cancer": make_breast_cancer,
    "regression": make_regression,
    "eight_schools": make_eight_schools,
    "gaussian": make_gaussian,
    "moons": make_moons,
}
