"""The Laplace guide and its prior on a GPU (skipped without one)."""

import pyro
import pytest
import torch
from pyro.infer import Predictive

import pyro_bdl as bdl
from pyro_bdl.data import TensorLoader
from pyro_bdl.inference import LaplaceGuide

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("curvature", ["diag_ggn", "kron", "full"])
def test_a_fit_on_the_gpu_stays_there(helpers, curvature):
    net = bdl.lift(helpers.mlp().cuda(), prior=bdl.priors.IIDNormal(0.5))
    x, y = helpers.classification_data()
    x, y = x.cuda(), y.cuda()
    guide = LaplaceGuide(helpers.classifier(net), curvature=curvature)
    guide.fit(TensorLoader((x, y), batch_size=20), len(x), num_steps=50, progress=False)
    assert all(value.is_cuda for value in guide.median().values())
    assert all(value.is_cuda for value in guide.sample_posterior(3).values())
    assert guide.log_marginal_likelihood().is_cuda
    assert guide.predictive((x[:4], None), len(x), num_samples=5).is_cuda
    pyro.set_rng_seed(0)
    draws = Predictive(guide.model, guide=guide, num_samples=3, parallel=True)((x[:4], None), 60)
    assert draws["y"].is_cuda and draws["y"].shape == (3, 4)


@pytest.mark.parametrize("curvature", ["diag_ef", "kron"])
def test_a_posterior_fitted_on_the_cpu_is_a_prior_on_the_gpu(helpers, curvature):
    module = helpers.mlp()
    net = bdl.lift(module, prior=bdl.priors.IIDNormal(0.5))
    x, y = helpers.classification_data()
    guide = LaplaceGuide(helpers.classifier(net), curvature=curvature)
    guide.fit(TensorLoader((x, y), batch_size=20), len(x), map=False, progress=False)
    prior = guide.as_prior()
    module.cuda()
    gpu = bdl.lift(module, prior=prior)
    distribution = gpu.prior_distribution("2.weight")
    draws = distribution.rsample((4,))
    assert draws.is_cuda and draws.shape == (4, 3, 8)
    assert distribution.log_prob(draws).is_cuda


def test_draws_kept_on_the_cpu_do_not_grow_gpu_memory(helpers):
    net = bdl.lift(helpers.mlp().cuda(), prior=bdl.priors.IIDNormal(0.5))
    x, y = helpers.classification_data()
    guide = LaplaceGuide(helpers.classifier(net), curvature="kron")
    loader = TensorLoader((x.cuda(), y.cuda()), batch_size=20)
    guide.fit(loader, len(x), map=False, progress=False)
    guide.sample_posterior(1)  # the eigendecompositions, once

    def peak(num_samples, device):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        draws = guide.sample_posterior(num_samples, device=device)
        torch.cuda.synchronize()
        assert all(len(value) == num_samples for value in draws.values())
        assert all(value.device.type == ("cpu" if device else "cuda") for value in draws.values())
        return torch.cuda.max_memory_allocated() - before

    assert peak(200, "cpu") <= peak(20, "cpu") + 4096
    assert peak(200, None) > 5 * peak(20, "cpu")  # drawn at once on the GPU, it grows
