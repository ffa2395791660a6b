"""BLoBGuide: eq. 11 KL, eq. 63 gradient, asymmetric B, flipout wherever the guide draws."""

import copy
import gc
import math

import pyro
import pytest
import torch
from pyro import poutine
from pyro.infer import SVI, Predictive, TraceMeanField_ELBO
from torch.distributions import kl_divergence

import pyro_bdl as bdl
from pyro_bdl.inference import BLoBGuide
from pyro_bdl.predict import predict_proba

F64 = {"dtype": torch.float64}
PRIOR_STD = 0.3


def _prior_only(net):
    """The model without data: its TraceMeanField loss is the KL alone."""

    def model(x):
        net(x)

    return model


def _guide(make_lora_net, make_classifier, **options):
    net = make_lora_net()
    model = make_classifier(net)
    guide = BLoBGuide(model, net, **options)
    x = torch.randn(6, 5, **F64)
    guide(x, torch.zeros(6, dtype=torch.long))
    # A fresh adapter has B = 0, which would hide A entirely.
    (b_site,) = net.point_sites
    pyro.get_param_store()[b_site] = torch.randn(3, 2, **F64)
    return net, model, guide


def _g(guide):
    (site,) = guide.site_names
    return site, guide.variational_parameters()[0][site], guide.variational_parameters()[1][site]


def test_kl_is_eq_11_and_equals_torch_kl(make_lora_net):
    net = make_lora_net()
    x = torch.randn(6, 5, **F64)
    guide = BLoBGuide(_prior_only(net), net, eps=0.2, prior_std=PRIOR_STD)
    guide(x)
    site, m, g = _g(guide)
    kl = TraceMeanField_ELBO().differentiable_loss(_prior_only(net), guide, x)
    omega = g.detach() ** 2
    expected = kl_divergence(
        torch.distributions.Normal(m.detach(), omega),
        torch.distributions.Normal(torch.tensor(0.0, **F64), PRIOR_STD),
    ).sum()
    torch.testing.assert_close(kl.detach(), expected, rtol=1e-12, atol=1e-12)
    # Eq. 11 drops the constant sum_ij (log sigma_p - 1/2).
    eq_11 = (m.detach().square().sum() + omega.square().sum()) / (
        2 * PRIOR_STD**2
    ) - omega.log().sum()
    constant = m.numel() * (math.log(PRIOR_STD) - 0.5)
    torch.testing.assert_close(kl.detach(), eq_11 + constant, rtol=1e-12, atol=1e-12)


def test_gradient_of_the_kl_with_respect_to_g_is_eq_63(make_lora_net):
    net = make_lora_net()
    x = torch.randn(6, 5, **F64)
    guide = BLoBGuide(_prior_only(net), net, eps=0.2, prior_std=PRIOR_STD)
    guide(x)
    _, m, g = _g(guide)
    kl = TraceMeanField_ELBO().differentiable_loss(_prior_only(net), guide, x)
    ((flat_m, flat_g),) = guide.flat_parameters()  # one site: its entries, end to end
    grad_m, grad_g = (grad.view_as(m) for grad in torch.autograd.grad(kl, [flat_m, flat_g]))
    rho = g.detach()
    torch.testing.assert_close(grad_g, -2 / rho + 2 * rho**3 / PRIOR_STD**2)
    torch.testing.assert_close(grad_m, m.detach() / PRIOR_STD**2)


def test_initialisation_follows_algorithm_1(make_lora_net, make_classifier):
    pyro.set_rng_seed(0)
    net, _, guide = _guide(make_lora_net, make_classifier, eps=0.05, prior_std=PRIOR_STD)
    site, m, g = _g(guide)
    torch.testing.assert_close(m.detach(), net.parameter(site).detach())
    assert g.min() >= 0.05 / math.sqrt(2) and g.max() <= 0.05
    assert g.std() > 0  # drawn, not a constant
    assert isinstance(net.prior, bdl.priors.IIDNormal) and net.prior.scale == PRIOR_STD
    assert guide.hyperparameters() == {"eps": 0.05, "prior_std": PRIOR_STD, "flipout": True}


def test_b_has_no_kl_and_no_noise(make_lora_net, make_classifier):
    net, model, guide = _guide(make_lora_net, make_classifier, eps=0.3)
    (b_site,) = net.point_sites
    x = torch.randn(6, 5, **F64)
    # B is not a site of the guide and the KL does not involve it.
    guide_trace = poutine.trace(guide).get_trace(x)
    assert [n for n, s in guide_trace.nodes.items() if s["type"] == "sample"] == guide.site_names
    kl = TraceMeanField_ELBO().differentiable_loss(_prior_only(net), guide, x)
    (grad_b,) = torch.autograd.grad(kl, [pyro.param(b_site).unconstrained()], allow_unused=True)
    assert grad_b is None
    # With Omega = G^2 = 0, every draw (flipout on) gives the deterministic forward with A = M.
    site, m, g = _g(guide)
    with torch.no_grad():
        g.fill_(1e-10)  # Omega = 1e-20: no noise to double precision
        b = {net.point_sites[b_site]: pyro.param(b_site)}
        expected = torch.func.functional_call(net.module, b, (x,))  # the module's A is M
    draws = Predictive(model, guide=guide, num_samples=4, return_sites=["_RETURN"])(x)
    for draw in draws["_RETURN"]:
        torch.testing.assert_close(draw, expected, rtol=0, atol=1e-14)
    torch.testing.assert_close(m.detach(), net.parameter(site).detach())


def test_mean_weight_prediction_is_the_deterministic_forward_with_m(make_lora_net, make_classifier):
    net, model, guide = _guide(make_lora_net, make_classifier, eps=0.3)
    site, m, _ = _g(guide)
    with torch.no_grad():
        m.add_(0.25)  # move M away from the module's A
    x = torch.randn(6, 5, **F64)
    median = guide.median()
    probs = predict_proba(model, x, samples={k: v[None] for k, v in median.items()})
    (b_site,) = net.point_sites
    weights = {net.random_sites[site]: m, net.point_sites[b_site]: pyro.param(b_site)}
    with torch.no_grad():
        logits = torch.func.functional_call(net.module, weights, (x,))
    torch.testing.assert_close(probs[0], torch.softmax(logits, -1), rtol=0, atol=1e-14)


@pytest.mark.parametrize("flipout", [True, False])
def test_flipout_applies_wherever_the_model_runs_with_the_guides_draws(
    make_lora_net, make_classifier, flipout
):
    # A batch of identical examples: with flipout they get independent perturbations (here
    # from 2^7 / 2 sign patterns, so a few may coincide); without it they share one draw.
    net, model, guide = _guide(make_lora_net, make_classifier, eps=0.5, flipout=flipout)
    x = torch.randn(1, 5, **F64).expand(8, 5)
    y = torch.zeros(8, dtype=torch.long)

    def svi():  # as SVI runs it: a draw of the guide, the model replaying it
        replayed = poutine.replay(model, poutine.trace(guide).get_trace(x, y))
        return poutine.trace(replayed).get_trace(x, y).nodes["_RETURN"]["value"]

    outputs = {
        "predict_proba": lambda: predict_proba(model, x, guide=guide, num_samples=1)[0],
        "SVI": svi,
    }
    for where, output in outputs.items():
        distinct = torch.unique(output().detach(), dim=0).shape[0]
        assert (distinct > 4) if flipout else (distinct == 1), where
    # Pyro's Predictive stacks the guide's draws and runs the model on copies: one weight
    # draw per sample for the whole batch (each example's predictive is the same).
    predictive = Predictive(model, guide=guide, num_samples=2, return_sites=["_RETURN"])
    assert torch.unique(predictive(x)["_RETURN"][0], dim=0).shape[0] == 1


def test_flipout_can_be_switched_and_leaves_with_the_guide(make_lora_net, make_classifier):
    net, _, guide = _guide(make_lora_net, make_classifier)
    (site,) = guide.site_names
    layer, _ = net.owner(site)
    assert "forward" in vars(layer)  # flipout runs in place of the layer's forward
    guide.flipout = False
    assert "forward" not in vars(layer) and not guide.flipout
    guide.flipout = True
    guide.flipout = True
    assert "forward" in vars(layer)
    copied = copy.deepcopy(layer)  # a copy's forward is its own layer's
    assert copied.forward.__self__ is copied
    del guide
    gc.collect()
    assert "forward" not in vars(layer)


def test_svi_with_the_guide_decreases_the_loss(make_lora_net, make_classifier, data):
    x, y = data
    net = make_lora_net()
    model = make_classifier(net)
    guide = BLoBGuide(model, net, prior_std=1.0)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.05}), TraceMeanField_ELBO(num_particles=4))
    pyro.set_rng_seed(0)
    losses = [svi.step(x, y, 1000) for _ in range(150)]
    # Mean loss over the first and last 20 steps: the decrease is many times the step-to-step
    # Monte Carlo spread of the loss at the end.
    first, last = torch.tensor(losses[:20]), torch.tensor(losses[-20:])
    assert first.mean() - last.mean() > 10 * last.std()


def test_lifts_that_break_the_asymmetric_design_are_errors(make_lora_net, make_classifier):
    def model_of(net):
        return make_classifier(net)

    cases = [
        ({"random": "lora_", "point": None}, "point estimate"),
        ({"random": "lora_A", "point": None}, "never be trained"),
        ({"random": None, "point": "lora_A"}, "point estimate"),
    ]
    for lift_kwargs, message in cases:
        net = make_lora_net(**lift_kwargs)
        with pytest.raises(ValueError, match=message):
            BLoBGuide(model_of(net), net)
    net = make_lora_net()
    net.module.base_model.model.proj.base_layer.bias.requires_grad_(True)
    with_bias = bdl.lift(
        net.module, random=lambda n, p: "lora_A" in n or "bias" in n, point="lora_B"
    )
    with pytest.raises(ValueError, match="LoRA A only"):
        BLoBGuide(model_of(with_bias), with_bias)
    unlifted = torch.nn.Linear(5, 3).double()
    guide = BLoBGuide(lambda x, y=None, num_data=None: unlifted(x))
    with pytest.raises(TypeError, match="net="):
        guide(torch.randn(2, 5, **F64))
    with pytest.raises(ValueError, match="eps"):
        BLoBGuide(model_of(net), net, eps=0.0)
    with pytest.raises(ValueError, match="prior_std"):
        BLoBGuide(model_of(net), net, prior_std=-0.2)


def test_the_network_is_found_from_the_model_without_net(make_lora_net, make_classifier, data):
    x, y = data
    net = make_lora_net()
    model = make_classifier(net)  # a closure over net: no model.net to read
    pyro.set_rng_seed(0)
    found = BLoBGuide(model, prior_std=PRIOR_STD)
    found(x, y)
    (site,) = found.site_names
    layer, _ = net.owner(site)
    assert "forward" in vars(layer)  # flipout on the network the model called
    assert net.prior.scale == PRIOR_STD
    # the same guide as with net=: the same draws and outputs from the same seed
    del found
    gc.collect()
    outputs = []
    for options in ({}, {"net": net}):
        pyro.set_rng_seed(1)
        guide = BLoBGuide(model, prior_std=PRIOR_STD, **options)
        guide(x, y)
        trace = poutine.trace(poutine.replay(model, poutine.trace(guide).get_trace(x, y)))
        outputs.append(trace.get_trace(x, y).nodes["_RETURN"]["value"])
        del guide
        gc.collect()
    torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=0)


def test_flipout_leaves_other_inference_on_the_network_alone(make_lora_net, make_classifier):
    # A Laplace fit (or SGMCMC) on the same lifted network while a BLoB guide is alive:
    # its forwards sample A themselves, and flipout must not touch them.
    net, model, guide = _guide(make_lora_net, make_classifier, eps=0.5)
    x = torch.randn(1, 5, **F64).expand(8, 5)
    (site,) = net.random_sites
    other = {site: guide.median()[site] + 0.1}  # a value that is not the guide's draw
    conditioned = poutine.condition(model, data=other)
    out = poutine.trace(conditioned).get_trace(x).nodes["_RETURN"]["value"]
    assert torch.unique(out.detach(), dim=0).shape[0] == 1  # one weight, no flipout signs


def test_guide_exports_to_arviz_with_its_approximation_and_settings(make_lora_net, make_classifier):
    net, model, guide = _guide(make_lora_net, make_classifier, eps=0.1)
    x, y = torch.randn(6, 5, **F64), torch.zeros(6, dtype=torch.long)
    idata = bdl.to_arviz(guide, num_samples=3, model_args=(x, y, 60))
    (site,) = guide.site_names
    assert idata["posterior"][site].shape == (1, 3, 2, 5)
    scale = idata["approximation"][f"{site}.scale"].values
    torch.testing.assert_close(
        torch.as_tensor(scale), guide.approximation_parameters()[f"{site}.scale"]
    )
    assert idata["posterior"].attrs["eps"] == 0.1


def test_get_posterior_is_the_random_sites_gaussian(make_lora_net, make_classifier):
    # BLoB's q over A alone (B is a point): its flat Gaussian is N(M, G^2) entry by entry
    # (BLoB eq. 8, sigma = G^2), as the site's own posterior gives it.
    net, _, guide = _guide(make_lora_net, make_classifier, eps=0.2)
    site, m, g = _g(guide)
    posterior = guide.get_posterior(torch.randn(6, 5, **F64), torch.zeros(6, dtype=torch.long))
    torch.testing.assert_close(posterior.mean, m.detach().flatten())
    torch.testing.assert_close(posterior.stddev, g.detach().square().flatten())
    torch.testing.assert_close(guide.get_posterior(site).mean, m.detach())
