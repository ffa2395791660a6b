"""LaplaceGuide as a Pyro guide: sampling, Predictive, export, and its errors."""

import json
import math
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import Predictive
from torch.utils.data import DataLoader, TensorDataset

import pyro_bdl as bdl
from pyro_bdl.inference import KronLowRank, LaplaceGuide
from pyro_bdl.predict import predict_proba

CURVATURES = ["diag_ggn", "diag_ef", "kron", KronLowRank(rank=3), "full"]


def fitted(helpers, curvature, temperature=1.0, bias=False):
    network = helpers.mlp(bias=bias)
    x, y = helpers.classification_data()
    net = bdl.lift(network, prior=bdl.priors.IIDNormal(0.5))
    guide = LaplaceGuide(helpers.classifier(net), curvature=curvature, temperature=temperature)
    loader = DataLoader(TensorDataset(x, y), batch_size=16)
    guide.fit(loader, len(x), map=False, progress=False)
    return guide, net, x, y


@pytest.mark.parametrize("curvature", CURVATURES, ids=str)
def test_draws_have_the_covariance_of_the_precision(helpers, curvature):
    guide, _, _, _ = fitted(helpers, curvature, temperature=0.5)
    num_draws = 20000
    draws = guide.sample_posterior(num_draws, torch.Generator().manual_seed(0))
    loc = guide.median()
    for block in guide.laplace_fit.blocks:
        covariance = 0.5 * torch.linalg.inv(helpers.dense_precision(block, guide.prior_precision))
        flat = torch.cat([(draws[s] - loc[s]).flatten(1) for s in block.sites], 1)
        estimate = flat.T @ flat / num_draws
        # Standard error of a second-moment entry: sqrt((S_ii S_jj + S_ij^2) / n); allow 5.
        var = covariance.diagonal()
        error = ((var[:, None] * var[None, :] + covariance**2) / num_draws).sqrt()
        assert torch.all((estimate - covariance).abs() <= 5 * error)
        mean_error = (var / num_draws).sqrt()
        assert torch.all(flat.mean(0).abs() <= 5 * mean_error)


@pytest.mark.parametrize("curvature", CURVATURES, ids=str)
def test_get_posterior_is_the_gaussian_of_the_flat_latent_vector(helpers, curvature):
    # Against the block-diagonal T P^-1, each block's precision read through quadratic()
    # alone (not the square root that get_posterior uses); sites flattened in model order.
    guide, _, x, y = fitted(helpers, curvature, temperature=0.5)
    posterior = guide.get_posterior((x, y), len(x))
    loc = guide.median()
    sizes = {site: loc[site].numel() for site in guide.sites}
    starts = dict(zip(sizes, [0, *torch.tensor(list(sizes.values())).cumsum(0).tolist()]))
    covariance = torch.zeros(sum(sizes.values()), sum(sizes.values()))
    for block in guide.laplace_fit.blocks:
        index = torch.cat([torch.arange(starts[s], starts[s] + sizes[s]) for s in block.sites])
        inverse = torch.linalg.inv(helpers.dense_precision(block, guide.prior_precision))
        covariance[index.unsqueeze(-1), index] = 0.5 * inverse
    torch.testing.assert_close(posterior.mean, torch.cat([loc[s].flatten() for s in sizes]))
    assert posterior.event_shape == (len(covariance),)
    if str(curvature).startswith("diag"):
        assert isinstance(posterior.base_dist, dist.Normal)
        torch.testing.assert_close(posterior.variance, covariance.diagonal())
        torch.testing.assert_close(covariance, covariance.diagonal().diag())
    else:
        assert isinstance(posterior, dist.MultivariateNormal)
        torch.testing.assert_close(posterior.covariance_matrix, covariance)


def test_get_posterior_of_a_large_kfac_fit_says_what_to_use_instead(helpers, monkeypatch):
    guide, _, _, _ = fitted(helpers, "kron")
    monkeypatch.setattr("pyro_bdl.inference.laplace.guide._DENSE_LIMIT", 10)
    with pytest.raises(NotImplementedError, match="sample_posterior.*variance"):
        guide.get_posterior()
    full, _, _, _ = fitted(helpers, "full")  # already dense: any size
    assert isinstance(full.get_posterior(), dist.MultivariateNormal)


@pytest.mark.parametrize("curvature", ["diag_ggn", "kron", "full"])
def test_the_guide_trace_has_the_gaussian_log_density(helpers, curvature):
    guide, _, x, y = fitted(helpers, curvature)
    trace = pyro.poutine.trace(guide).get_trace((x, y), len(x))
    loc = guide.median()
    log_density = 0.0
    for block in guide.laplace_fit.blocks:
        precision = helpers.dense_precision(block, guide.prior_precision)
        flat = torch.cat([(trace.nodes[s]["value"] - loc[s]).flatten() for s in block.sites])
        gaussian = dist.MultivariateNormal(torch.zeros_like(flat), precision_matrix=precision)
        log_density = log_density + gaussian.log_prob(flat)
    assert torch.allclose(trace.log_prob_sum(), log_density)


def test_predictive_and_predict_proba_draw_through_the_guide(helpers):
    guide, net, x, y = fitted(helpers, "kron")
    draws = Predictive(guide.model, guide=guide, num_samples=3)((x[:5], None), len(x))
    # Predictive pads global sites with a dimension for the model's data plate.
    assert draws["0.weight"].shape == (3, 1, 8, 5) and draws["y"].shape == (3, 5)
    assert not torch.allclose(draws["0.weight"][0], draws["0.weight"][1])
    probs = predict_proba(guide.model, (x[:5], None), len(x), guide=guide, num_samples=4)
    assert probs.shape == (4, 5, 3)
    assert torch.allclose(probs.sum(-1), torch.ones(4, 5))
    assert not torch.allclose(probs[0], probs[1])


def test_median_quantiles_and_temperature(helpers):
    cold, net, _, _ = fitted(helpers, "kron", temperature=0.25)
    warm, _, _, _ = fitted(helpers, "kron")
    assert all(torch.equal(v, net.init_values()[k]) for k, v in cold.median().items())
    for name, variance in warm.variance().items():
        assert torch.allclose(cold.variance()[name], 0.25 * variance)
    quantiles = cold.quantiles([0.5, 0.8413447460685429])
    sd = cold.variance()["2.weight"].sqrt()
    assert torch.allclose(quantiles["2.weight"][0], cold.median()["2.weight"])
    assert torch.allclose(quantiles["2.weight"][1], cold.median()["2.weight"] + sd)


@pytest.mark.parametrize("curvature", CURVATURES, ids=str)
def test_exports_for_arviz(helpers, curvature):
    guide, _, x, y = fitted(helpers, curvature, bias=True)
    parameters = guide.approximation_parameters()
    for site in ("0.weight", "0.bias", "2.weight", "2.bias"):
        assert parameters[f"{site}.loc"].shape == parameters[f"{site}.scale"].shape
    settings = guide.hyperparameters()
    json.dumps(settings)
    assert settings["num_data"] == 60 and settings["num_params"] == 5 * 8 + 8 + 8 * 3 + 3
    assert math.isclose(settings["prior_precision"], 4.0)
    idata = bdl.to_arviz(guide, num_samples=4, model_args=((x, y), len(x)))
    assert idata.posterior["0.weight"].shape[:2] == (1, 4)


def test_map_is_fitted_by_default(helpers):
    network = helpers.mlp()
    x, y = helpers.classification_data()
    net = bdl.lift(network, prior=bdl.priors.IIDNormal(1.0))
    model = helpers.classifier(net)

    def largest_gradient(values):
        values = {k: v.clone().requires_grad_() for k, v in values.items()}
        trace = pyro.poutine.trace(pyro.poutine.condition(model, values)).get_trace((x, y), 60)
        grads = torch.autograd.grad(trace.log_prob_sum(), list(values.values()))
        return max(g.abs().max() for g in grads)

    guide = LaplaceGuide(model, curvature="diag_ggn")
    loader = DataLoader(TensorDataset(x, y), batch_size=60)
    guide.fit(loader, 60, num_steps=100, optimizer=pyro.optim.Adam({"lr": 0.05}), progress=False)
    # The fitted values are near a stationary point of the log joint, the module's are not.
    assert largest_gradient(guide.median()) < 0.1 * largest_gradient(net.init_values())


def test_errors_name_the_argument_and_the_fix(helpers, linear_gaussian):
    problem = linear_gaussian
    with pytest.raises(ValueError, match="curvature must be one of"):
        LaplaceGuide(problem.model, curvature="kfac")
    with pytest.raises(ValueError, match="temperature must be a positive finite number"):
        LaplaceGuide(problem.model, temperature=0.0)
    guide = LaplaceGuide(problem.model)
    with pytest.raises(RuntimeError, match="fit"):
        guide.median()
    with pytest.raises(ValueError, match="prior_precision must be a positive finite number"):
        LaplaceGuide(problem.model, prior_precision=-1.0).fit(
            problem.loader(), problem.num_data, map=False, progress=False
        )
    with pytest.raises(ValueError, match="no value for the latent sites"):
        guide.fit(problem.loader(), problem.num_data, map={}, progress=False)

    def local_latent(x):  # one latent per example of a subsampled plate
        with pyro.plate("units", 30, subsample_size=3) as ind:
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            pyro.sample("y", dist.Normal(z, 1.0), obs=x[ind, 0])

    with pytest.raises(ValueError, match="'z' is local to the subsampled plate 'units'"):
        LaplaceGuide(local_latent, "full").fit(problem.x, map=False, progress=False)

    def laplace_prior(batch, num_data):  # log density -|w|: no curvature at w = 0
        w = pyro.sample("w", dist.Laplace(0.0, 1.0).expand([3]).to_event(1))
        bdl.observe("y", dist.Normal(batch[0] @ w, 1.0), batch[1], num_data)

    with pytest.raises(ValueError, match="'w' \\(Laplace\\) is not strictly concave"):
        LaplaceGuide(laplace_prior).fit(
            problem.loader(), problem.num_data, map=False, progress=False
        )
    network = helpers.mlp(bias=False)
    x, y = helpers.classification_data()

    class Varying:  # a scale per entry: K-FAC's eigenbasis cannot hold it
        def distribution(self, name, param):
            return bdl.priors.normal_prior(param, 0.0, torch.rand(param.shape) + 0.5)

    net = bdl.lift(network, prior=Varying())
    with pytest.raises(ValueError, match="prior_precision=<float>"):
        LaplaceGuide(helpers.classifier(net), curvature="kron").fit(
            DataLoader(TensorDataset(x, y), batch_size=20), 60, map=False, progress=False
        )


def test_draws_kept_on_a_device_are_the_draws_made_one_at_a_time(helpers):
    guide, _, _, _ = fitted(helpers, "kron")
    kept = guide.sample_posterior(5, torch.Generator().manual_seed(3), device="cpu")
    generator = torch.Generator().manual_seed(3)
    one_by_one = [guide.sample_posterior(1, generator) for _ in range(5)]
    for name, value in kept.items():
        assert value.device.type == "cpu" and value.shape[0] == 5
        expected = torch.cat([draw[name] for draw in one_by_one])
        torch.testing.assert_close(value, expected, rtol=0, atol=0)
    with pytest.raises(TypeError, match="device must be"):
        guide.sample_posterior(2, device=0)


def test_a_fit_at_untrained_lora_adapters_warns_to_fine_tune_first(helpers):
    """A fresh LoRA adapter has B = 0: Laplace there is the pretrained network's, which
    predicts the same for every input; the fit says so, and not once B has moved."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    config = LoraConfig(r=2, lora_alpha=4, target_modules=["0", "2"])
    peft_model = get_peft_model(helpers.mlp(), config)
    net = bdl.lift(peft_model, bdl.priors.IIDNormal(0.5), random="lora_")
    model = helpers.classifier(net)
    x, y = helpers.classification_data()
    options = {"map": False, "mode_tolerance": None, "progress": False}
    with pytest.warns(
        UserWarning, match=r"B @ A = 0 in all 2 adapted .* then fit\(\.\.\., map=False"
    ):
        LaplaceGuide(model, curvature="kron").fit((x, y), len(x), **options)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.1)  # as after fine-tuning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        LaplaceGuide(model, curvature="kron").fit((x, y), len(x), **options)
