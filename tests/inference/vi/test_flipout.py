"""LoRA flipout: the output distribution of direct weight sampling, decorrelated across examples."""

import gc

import pyro
import torch
from torch.func import functional_call

from pyro_bdl.inference import BLoBGuide, flipout_linear

F64 = {"dtype": torch.float64}
NUM_PASSES = 3000


def _passes(net, guide, x, b):
    """Outputs of NUM_PASSES forwards, each with one draw of A from the guide: (K, B, out)."""
    (site,) = net.random_sites
    a_name, b_name = net.random_sites[site], net.point_sites[next(iter(net.point_sites))]
    outputs = []
    with torch.no_grad():
        for _ in range(NUM_PASSES):
            a = guide.draw()[0][site]  # flipout acts on forwards with the guide's draws
            outputs.append(functional_call(net.module, {a_name: a, b_name: b}, (x,)))
    return torch.stack(outputs)


def _within(estimates, terms, expected):
    # The estimates are means of K i.i.d. terms; 5 empirical standard errors bound their
    # Monte Carlo error (fixed seed, so the test is deterministic).
    tolerance = 5 * terms.std(0) / NUM_PASSES**0.5
    return bool(((estimates - expected).abs() <= tolerance).all()), tolerance


def test_flipout_matches_direct_weight_sampling_and_decorrelates_examples(
    make_lora_net, make_classifier
):
    net = make_lora_net()
    guide = BLoBGuide(make_classifier(net), net, eps=0.6)
    x = torch.tensor([[1.0, -0.5, 0.3, 2.0, -1.0], [0.8, -0.4, 0.5, 1.5, -1.2]], **F64)
    guide(x, torch.zeros(2, dtype=torch.long))
    pyro.set_rng_seed(0)
    b = torch.randn(3, 2, **F64)

    (site,) = net.random_sites
    layer = net.module.base_model.model.proj
    scaling = layer.scaling["default"]
    w0, b0 = layer.base_layer.weight.detach(), layer.base_layer.bias.detach()
    m, omega = guide.median()[site], guide.approximation_parameters()[f"{site}.scale"]
    # z = W0 h + b0 + s B A h with A_kj ~ N(M_kj, Omega_kj^2) independent:
    # E z = W0 h + b0 + s B M h;  Cov(z_i, z_l) = s^2 B diag_k(sum_j Omega_kj^2 h_ij h_lj) B^T.
    mean = x @ w0.T + b0 + scaling * x @ m.T @ b.T

    def covariance(i, j):
        return scaling**2 * b @ torch.diag((omega**2 * x[i] * x[j]).sum(1)) @ b.T

    outputs = {}
    for flipout in (True, False):
        guide.flipout = flipout
        outputs[flipout] = _passes(net, guide, x, b)

    for flipout, z in outputs.items():
        centred = z - mean
        ok, _ = _within(z.mean(0), z, mean)
        assert ok, f"mean, flipout={flipout}"
        for i in range(2):
            terms = centred[:, i, :, None] * centred[:, i, None, :]
            ok, _ = _within(terms.mean(0), terms, covariance(i, i))
            assert ok, f"covariance of example {i}, flipout={flipout}"

    cross = {f: (c := z - mean)[:, 0, :, None] * c[:, 1, None, :] for f, z in outputs.items()}
    ok, tolerance = _within(cross[True].mean(0), cross[True], torch.zeros(3, 3, **F64))
    assert ok, "flipout: examples of one batch must be uncorrelated"
    ok, _ = _within(cross[False].mean(0), cross[False], covariance(0, 1))
    assert ok, "direct sampling: examples share one weight draw"
    # The correlation that flipout removes is far above the test's resolution.
    assert (covariance(0, 1).abs() > 5 * tolerance).any()


def test_flipout_linear_draws_signs_per_example_and_per_token():
    pyro.set_rng_seed(0)
    mean, delta = torch.randn(3, 4, **F64), torch.randn(3, 4, **F64)
    h = torch.randn(4, **F64).expand(3, 8, 4)  # 3 sequences of 8 identical tokens
    out = flipout_linear(h, mean, delta)
    assert out.shape == (3, 8, 3)
    # Each row is M h + (Delta (h o s)) o t with signs s, t: find them (up to the common
    # flip (s, t) -> (-s, -t), which leaves the row alone) among every sign choice.
    signs = list(_all_signs(4, 3))
    for sequence in out:
        s_products, t_products = set(), set()
        for row in sequence:
            residual = row - mean @ h[0, 0]
            errors = [((delta @ (h[0, 0] * s)) * t - residual).abs().max() for s, t in signs]
            s, t = signs[int(torch.stack(errors).argmin())]
            assert min(errors) < 1e-12
            # products of signs are blind to the common flip
            s_products.add(tuple((s[0] * s[1:]).tolist()))
            t_products.add(tuple((t[0] * t[1:]).tolist()))
        # identical tokens of one sequence get their own input and output signs: shared
        # ones (per sequence, or per batch) would give one product each (chance 4^-7 or
        # 8^-7 with independent signs; the seed is fixed)
        assert len(s_products) > 1 and len(t_products) > 1
    torch.testing.assert_close(flipout_linear(h, mean, torch.zeros_like(delta)), h @ mean.T)


def _all_signs(n, r):
    import itertools

    for s in itertools.product([-1.0, 1.0], repeat=n):
        for t in itertools.product([-1.0, 1.0], repeat=r):
            yield torch.tensor(s, **F64), torch.tensor(t, **F64)


def test_forwards_with_the_modules_own_weights_are_left_alone(make_lora_net, make_classifier):
    net = make_lora_net()
    guide = BLoBGuide(make_classifier(net), net, eps=0.6)
    x = torch.randn(4, 5, **F64)
    guide(x, torch.zeros(4, dtype=torch.long))
    (site,) = net.random_sites
    draw = guide.get_posterior(site).sample()
    with torch.no_grad():
        with net.fixed({site: draw}):
            fixed = net.module(x)
        guide.flipout = False
        plain = functional_call(net.module, {net.random_sites[site]: draw}, (x,))
    torch.testing.assert_close(fixed, plain)


def test_a_guide_that_lets_go_leaves_the_flipout_of_the_guide_that_replaced_it(
    make_lora_net, make_classifier
):
    # A guide loaded in place of another (a resumed run) hooks the same layers; the first
    # one's detach (or its finaliser) must not take the second's flipout off.
    net = make_lora_net()
    model = make_classifier(net)
    first = BLoBGuide(model, net, eps=0.6)
    second = BLoBGuide(model, net, eps=0.6)
    first.flipout = False
    del first
    gc.collect()
    x = torch.randn(64, 5, **F64)
    second(x, torch.zeros(64, dtype=torch.long))
    draws, _, _ = second.draw()
    (site,) = net.random_sites
    layer, _ = net.owner(site)
    with torch.no_grad():
        outputs = [functional_call(layer, {"weight": draws[site]}, (x,)) for _ in range(2)]
    # flipout draws fresh signs per example at every forward: two forwards differ, and
    # neither is the forward of the one shared draw
    assert not torch.allclose(outputs[0], outputs[1])
    assert not torch.allclose(outputs[0], x @ draws[site].T)
