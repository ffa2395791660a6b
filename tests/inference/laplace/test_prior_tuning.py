"""Prior-precision tuning and link selection: per-site evidence, grid search, links."""

import pyro
import pyro.distributions as dist
import pytest
import torch

import pyro_bdl as bdl
from pyro_bdl.data import TensorLoader
from pyro_bdl.inference import LaplaceGuide
from pyro_bdl.metrics import nll


class TwoBlocks:
    """y = X1 w1 + X2 w2 + noise with w1 ~ N(0, 1/delta1), w2 ~ N(0, 1/delta2).

    The evidence is N(y; 0, sigma^2 I + X1 X1^T / delta1 + X2 X2^T / delta2) in closed
    form. The data are drawn with a wide w1 and a narrow w2, so the two evidence-optimal
    precisions are far apart and no single precision is right for both.
    """

    def __init__(self, num_data=200, sigma=0.5, seed=0):
        generator = torch.Generator().manual_seed(seed)
        self.x1 = torch.randn(num_data, 4, generator=generator)
        self.x2 = torch.randn(num_data, 3, generator=generator)
        w1 = 3.0 * torch.randn(4, generator=generator)
        w2 = 0.1 * torch.randn(3, generator=generator)
        noise = sigma * torch.randn(num_data, generator=generator)
        self.y = self.x1 @ w1 + self.x2 @ w2 + noise
        self.num_data, self.sigma = num_data, sigma

    def model(self, batch, num_data):
        x1, x2, y = batch
        w1 = pyro.sample("w1", dist.Normal(0.0, 1.0).expand([4]).to_event(1))
        w2 = pyro.sample("w2", dist.Normal(0.0, 1.0).expand([3]).to_event(1))
        bdl.observe("y", dist.Normal(x1 @ w1 + x2 @ w2, self.sigma), y, num_data)

    def loader(self):
        return TensorLoader((self.x1, self.x2, self.y), batch_size=50)

    def log_evidence(self, log_delta):
        delta1, delta2 = log_delta.exp()
        covariance = (
            self.sigma**2 * torch.eye(self.num_data)
            + self.x1 @ self.x1.T / delta1
            + self.x2 @ self.x2.T / delta2
        )
        return dist.MultivariateNormal(torch.zeros(self.num_data), covariance).log_prob(self.y)

    def maximiser(self):
        """The evidence-maximising (delta1, delta2), by L-BFGS on the closed form."""
        log_delta = torch.zeros(2, requires_grad=True)
        optimiser = torch.optim.LBFGS(
            [log_delta], max_iter=200, tolerance_grad=1e-12, line_search_fn="strong_wolfe"
        )

        def closure():
            optimiser.zero_grad()
            loss = -self.log_evidence(log_delta)
            loss.backward()
            return loss

        optimiser.step(closure)
        return log_delta.detach().exp()

    def posterior_mean(self, delta):
        x = torch.cat([self.x1, self.x2], 1)
        precision = x.T @ x / self.sigma**2 + torch.diag(
            delta.repeat_interleave(torch.tensor([4, 3]))
        )
        mean = torch.linalg.solve(precision, x.T @ self.y / self.sigma**2)
        return {"w1": mean[:4], "w2": mean[4:]}


def test_per_site_evidence_recovers_the_exact_maximiser_of_two_blocks():
    """At the MAP of the optimal precisions the Laplace evidence is exact, and its maximum
    over per-site precisions (from the model's prior, 1 and 1) is the exact maximiser."""
    problem = TwoBlocks()
    best = problem.maximiser()
    assert best[1] / best[0] > 100  # the blocks want very different priors
    guide = LaplaceGuide(problem.model, curvature="full")
    guide.fit(problem.loader(), problem.num_data, map=problem.posterior_mean(best), progress=False)
    tuned = guide.optimize_prior_precision()  # the default: per site, by the evidence
    found = torch.stack([tuned["w1"], tuned["w2"]])
    assert torch.allclose(found, best, rtol=1e-3)
    exact = problem.log_evidence(best.log())
    assert torch.allclose(guide.log_marginal_likelihood(), exact, rtol=0, atol=1e-8)

    # One shared precision cannot reach it: the old default is worse by a clear margin.
    guide.prior_precision = None  # start again from the model's prior
    guide.optimize_prior_precision(structure="scalar")
    assert guide.log_marginal_likelihood() < exact - 5


def test_marglik_warns_when_the_evidence_is_not_maximised():
    problem = TwoBlocks()
    guide = LaplaceGuide(problem.model, curvature="full")
    mean = problem.posterior_mean(problem.maximiser())
    guide.fit(problem.loader(), problem.num_data, map=mean, progress=False)
    with pytest.warns(RuntimeWarning, match="raise num_steps"):
        guide.optimize_prior_precision(num_steps=3)


def _fitted_classifier(helpers, prior_precision=None):
    x, y = helpers.classification_data()
    net = bdl.lift(helpers.mlp(bias=False), prior=bdl.priors.IIDNormal(1.0))
    guide = LaplaceGuide(helpers.classifier(net), curvature="kron", prior_precision=prior_precision)
    guide.fit(TensorLoader((x, y), batch_size=16), 60, map=False, progress=False)
    x_val, y_val = helpers.classification_data(num_data=30, seed=5)
    return guide, TensorLoader((x_val, y_val), batch_size=8), y_val


def test_gridsearch_scales_a_per_site_profile_to_the_best_validation_nll(helpers):
    profile = {"0.weight": 5.0, "2.weight": 0.5}
    guide, val_loader, y_val = _fitted_classifier(helpers, profile)
    grid = torch.logspace(-2, 2, 9)
    tuned = guide.optimize_prior_precision("gridsearch", val_loader, 60, grid=grid)
    scores = [
        nll(
            guide.predictive(
                val_loader,
                60,
                link="probit",
                prior_precision={site: float(c) * delta for site, delta in profile.items()},
            ),
            y_val,
        )
        for c in grid
    ]
    best = grid[int(torch.tensor(scores).argmin())]
    assert len(set(scores)) > 1  # the choice is not a tie
    for site, delta in profile.items():
        assert torch.allclose(tuned[site], best * delta)


def test_select_link_picks_the_link_with_the_lowest_validation_nll(helpers):
    guide, val_loader, y_val = _fitted_classifier(helpers)
    guide.prior_precision = 0.3  # a wide posterior: the links disagree
    link, scores = guide.select_link(val_loader, 60, num_samples=20_000)
    assert set(scores) == {"mc", "probit", "bridge"} and link == min(scores, key=scores.get)
    for name in ("probit", "bridge"):  # closed forms: the same numbers as the predictive
        assert scores[name] == pytest.approx(
            nll(guide.predictive(val_loader, 60, link=name), y_val)
        )
    generator = torch.Generator().manual_seed(1)
    mc = guide.predictive(val_loader, 60, link="mc", num_samples=20_000, generator=generator)
    assert scores["mc"] == pytest.approx(nll(mc, y_val), abs=0.01)  # Monte Carlo error ~1e-3
    only, _ = guide.select_link(val_loader, 60, links=("bridge",))
    assert only == "bridge" and guide.link == "bridge"  # the predictive's default now
    assert torch.equal(
        guide.predictive(val_loader, 60), guide.predictive(val_loader, 60, link="bridge")
    )


def test_select_link_arguments_are_checked(helpers):
    guide, val_loader, _ = _fitted_classifier(helpers)
    with pytest.raises(ValueError, match="needs the validation data"):
        guide.select_link()
    with pytest.raises(ValueError, match="links must be one of"):
        guide.select_link(val_loader, 60, links=("softmax",))
