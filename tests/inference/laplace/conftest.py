"""Small problems shared by the Laplace tests (float64 throughout)."""

import math
import warnings
from types import SimpleNamespace

import pyro
import pyro.distributions as dist
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import pyro_bdl as bdl


@pytest.fixture(autouse=True)
def _float64(float64):
    yield


@pytest.fixture(autouse=True)
def _fits_anywhere():
    """The curvature tests fit at arbitrary points on purpose (``map=False`` at a random
    initialisation), which ``LaplaceGuide.fit`` rightly warns about; test_mode.py checks
    that warning (``pytest.warns`` records it through this filter)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="LaplaceGuide.fit: the point is not a mode")
        yield


class LinearGaussian:
    """y = X w + noise, w ~ N(mu0, 1/alpha): the Laplace approximation is exact.

    ``copies`` repeats the ``num_data`` examples that many times: the data set of a fit
    on one copy with ``num_data`` set to the whole size.
    """

    def __init__(self, num_data=40, dim=3, sigma=0.5, alpha=2.0, seed=0, prior_mean=0.0, copies=1):
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(num_data, dim, generator=generator)
        self.w = torch.randn(dim, generator=generator)
        self.y = self.x @ self.w + sigma * torch.randn(num_data, generator=generator)
        self.x, self.y = self.x.repeat(copies, 1), self.y.repeat(copies)
        self.num_data, self.dim, self.sigma, self.alpha = num_data * copies, dim, sigma, alpha
        self.prior_mean = prior_mean
        self.precision = self.x.T @ self.x / sigma**2 + alpha * torch.eye(dim)
        self.covariance = torch.linalg.inv(self.precision)
        self.mean = self.covariance @ (self.x.T @ self.y / sigma**2 + alpha * prior_mean)

    def model(self, batch, num_data):
        x, y = batch
        prior = dist.Normal(self.prior_mean, self.alpha**-0.5).expand([self.dim]).to_event(1)
        w = pyro.sample("w", prior)
        bdl.observe("y", dist.Normal(x @ w, self.sigma), y, num_data)
        return x @ w

    def loader(self, batch_size=16, first=None):
        """The data (its ``first`` examples only, if given) in batches."""
        dataset = TensorDataset(self.x[:first], self.y[:first])
        return DataLoader(dataset, batch_size=batch_size)

    def log_evidence(self, alpha=None):
        alpha = self.alpha if alpha is None else alpha
        covariance = self.sigma**2 * torch.eye(self.num_data) + self.x @ self.x.T / alpha
        mean = self.x @ torch.full((self.dim,), float(self.prior_mean))
        return dist.MultivariateNormal(mean, covariance).log_prob(self.y)


@pytest.fixture
def linear_gaussian():
    return LinearGaussian()


def mlp(bias=True, inputs=5, hidden=8, classes=3, seed=1):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(inputs, hidden, bias=bias),
        torch.nn.Tanh(),
        torch.nn.Linear(hidden, classes, bias=bias),
    )


def classification_data(num_data=60, inputs=5, classes=3, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_data, inputs, generator=generator)
    y = torch.randint(0, classes, (num_data,), generator=generator)
    return x, y


def classifier(net):
    """The Pyro model of a lifted classifier taking (x, y) batches."""

    def model(batch, num_data):
        x, y = batch
        logits = net(x)
        bdl.observe("y", dist.Categorical(logits=logits), y, num_data)
        return logits

    return model


def dense_precision(block, delta):
    """The block's precision as a dense matrix, read through quadratic() alone."""
    sizes = [math.prod(shape) for shape in block.shapes.values()]
    dim = sum(sizes)

    def split(rows):
        parts = zip(block.shapes.items(), rows.split(sizes, -1))
        return {site: part.reshape(-1, *shape) for (site, shape), part in parts}

    basis = torch.eye(dim)
    single = block.quadratic(split(basis), delta)
    pairs = (basis.unsqueeze(0) + basis.unsqueeze(1)).reshape(-1, dim)
    both = block.quadratic(split(pairs), delta).reshape(dim, dim)
    return (both - single[:, None] - single[None, :]) / 2


@pytest.fixture
def laplace_torch():
    """laplace-torch with its curvature backends, a test peer: the tests that compare
    with it take this fixture and skip without it; the others run regardless."""
    pytest.importorskip("laplace.curvature")
    import laplace

    return laplace


@pytest.fixture
def helpers():
    """The builders above, for test modules (which cannot import this conftest)."""
    return SimpleNamespace(
        mlp=mlp,
        classification_data=classification_data,
        classifier=classifier,
        dense_precision=dense_precision,
        LinearGaussian=LinearGaussian,
    )
