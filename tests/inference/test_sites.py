"""LatentSites: the unconstrained packing that every guide shares, against Pyro's own."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.distributions.transforms import biject_to
from pyro.infer.autoguide import AutoDiagonalNormal
from pyro_models import MODELS

import pyro_bdl as bdl
from pyro_bdl.inference.sites import LatentSites


def _model():
    pyro.sample("scalar", dist.Normal(0.0, 1.0))
    pyro.sample("positive", dist.HalfNormal(torch.ones(2, 3)).to_event(2))
    with pyro.plate("groups", 4):
        pyro.sample("simplex", dist.Dirichlet(torch.ones(3)))  # 3 entries, 2 free
    pyro.sample("y", dist.Normal(0.0, 1.0), obs=torch.tensor(0.5))


def _sites(model=_model):
    trace = pyro.poutine.trace(pyro.poutine.block(model, hide=["y"])).get_trace()
    return trace, LatentSites(trace, "test")


def test_shapes_and_the_flat_vector_are_autocontinuous():
    pyro.set_rng_seed(0)
    trace, sites = _sites()
    assert list(sites) == ["scalar", "positive", "simplex"]  # observed sites left out
    reference = AutoDiagonalNormal(_model)
    reference()
    assert sites.numel == reference.latent_dim == 1 + 6 + 4 * 2
    for name, shape in reference._unconstrained_shapes.items():
        assert sites[name].unconstrained_shape == shape
    assert sites["simplex"].event_dim == 1 and sites["positive"].event_dim == 2
    assert [f.name for f in sites["simplex"].frames] == ["groups"]
    assert not sites.all_real and sites["scalar"].is_real


def test_constrain_inverts_unconstrain_with_pyros_log_jacobian():
    trace, sites = _sites()
    values = {name: trace.nodes[name]["value"] for name in sites}
    flat = sites.pack(sites.unconstrain(values))
    z = sites.unpack(flat)
    constrained, log_det = sites.constrain(z)
    for name, value in values.items():
        torch.testing.assert_close(constrained[name], value)
    expected = sum(
        biject_to(trace.nodes[n]["fn"].support).log_abs_det_jacobian(z[n], values[n]).sum()
        for n in ("positive", "simplex")
    )
    torch.testing.assert_close(log_det, expected)
    batched = sites.unpack(torch.stack([flat, flat]))  # draws in front
    assert batched["simplex"].shape == (2, 4, 2) and batched["scalar"].shape == (2,)


def test_fixed_priors_find_the_hierarchical_ones_without_running_the_network():
    model, args, kwargs = MODELS["eight_schools_centred"].make()
    trace = pyro.poutine.trace(pyro.poutine.block(model, hide=["obs"])).get_trace(*args)
    sites = LatentSites(trace, "test")
    assert sites.fixed_priors(model, args, kwargs) == {"mu", "tau"}  # theta ~ N(mu, tau)

    class Exploding(torch.nn.Module):  # a network whose forward must not run
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(3))

        def forward(self, x):
            raise AssertionError("the forward pass ran")

    net = bdl.lift(Exploding(), prior=bdl.priors.IIDNormal(1.0))

    def lifted():
        net(torch.zeros(3))

    def latent_sites_only():  # the prototype: the sites, the forward stopped after them
        with pytest.raises(AssertionError, match="forward pass ran"):
            lifted()

    sites = LatentSites(pyro.poutine.trace(latent_sites_only).get_trace(), "test")
    assert sites.fixed_priors(lifted, (), {}) == {"weight"}  # and the forward never ran
    assert sites.normal_prior("weight", {"weight"})[1].eq(1.0).all()


def test_a_local_latent_of_a_subsampled_plate_is_refused_by_name():
    def model():
        with pyro.plate("data", 100, subsample_size=10):
            pyro.sample("z", dist.Normal(0.0, 1.0))

    _, sites = _sites(model)
    with pytest.raises(ValueError, match="'z' is local to the subsampled plate 'data'.*10 of 100"):
        sites.refuse_local("a reason")
