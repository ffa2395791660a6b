"""At T = 0 the kernels are optimisers (Appendix C of the posteriors paper), step for step."""

import pyro.distributions as dist
import pytest
import torch
from pyro.infer import MCMC
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, TensorDataset

import pyro_bdl as bdl
from pyro_bdl.inference import SGHMC, SGLD

NUM_DATA, BATCH = 48, 8


def _problem():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(NUM_DATA, 5, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 3, (NUM_DATA,), generator=generator)
    torch.manual_seed(1)
    net = torch.nn.Sequential(
        torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)
    ).double()
    # Whole batches per index list: the same minibatch sequence for the kernel and SGD.
    sampler = BatchSampler(SequentialSampler(range(NUM_DATA)), BATCH, drop_last=False)
    loader = DataLoader(TensorDataset(x, y), sampler=sampler, batch_size=None)
    return net, loader


def _model(lifted):
    def model(batch, num_data):
        x, y = batch
        bdl.observe("y", dist.Categorical(logits=lifted(x)), y, num_data)

    return model


def _sgd_trajectory(net, loader, prior_scale, num_steps, **sgd):
    """SGD on U = -log p_hat(theta) / N, the minibatch log joint of the same model."""
    params = list(net.parameters())
    optimizer = torch.optim.SGD(params, **sgd)
    if sgd.get("momentum"):
        # PyTorch starts the momentum buffer at the first gradient; SGHMC's momentum
        # starts at zero. A zero buffer makes the first step dampened like the rest.
        for p in params:
            optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)
    trajectory = []
    batches = iter(loader)
    for _ in range(num_steps):
        try:
            x, y = next(batches)
        except StopIteration:
            batches = iter(loader)
            x, y = next(batches)
        log_lik = torch.distributions.Categorical(logits=net(x)).log_prob(y).sum()
        log_prior = sum(dist.Normal(0.0, prior_scale).log_prob(p).sum() for p in params)
        loss = -(log_prior + NUM_DATA / len(y) * log_lik) / NUM_DATA
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        trajectory.append(torch.cat([p.detach().reshape(-1).clone() for p in params]))
    return torch.stack(trajectory)


def _kernel_trajectory(kernel, net, loader, num_steps):
    mcmc = MCMC(kernel, num_samples=num_steps, warmup_steps=0, disable_progbar=True)
    mcmc.run(loader, NUM_DATA)
    samples = mcmc.get_samples()
    return torch.cat(
        [samples[name].reshape(num_steps, -1) for name, _ in net.named_parameters()], 1
    )


@pytest.mark.parametrize("step_size, friction, mass", [(0.1, 1.0, 1.0), (0.05, 3.0, 0.5)])
def test_sghmc_at_zero_temperature_is_sgd_with_momentum(step_size, friction, mass):
    num_steps = 15  # crosses an epoch boundary (6 batches per epoch)
    net, loader = _problem()
    start = {k: v.clone() for k, v in net.state_dict().items()}
    lifted = bdl.lift(net, prior=bdl.priors.IIDNormal(0.7))
    kernel = SGHMC(_model(lifted), step_size, friction=friction, mass=mass, temperature=0.0)
    ours = _kernel_trajectory(kernel, net, loader, num_steps)
    net.load_state_dict(start)
    reference = _sgd_trajectory(
        net,
        loader,
        0.7,
        num_steps,
        lr=step_size / mass,
        momentum=1 - step_size * friction / mass,
        dampening=1 - step_size,
    )
    assert torch.allclose(ours, reference, atol=1e-6, rtol=0)
    assert not torch.allclose(ours[0], ours[-1])


def test_sgld_at_zero_temperature_is_plain_sgd():
    num_steps = 9
    net, loader = _problem()
    start = {k: v.clone() for k, v in net.state_dict().items()}
    lifted = bdl.lift(net, prior=bdl.priors.IIDNormal(0.7))
    ours = _kernel_trajectory(SGLD(_model(lifted), 0.2, temperature=0.0), net, loader, num_steps)
    net.load_state_dict(start)
    reference = _sgd_trajectory(net, loader, 0.7, num_steps, lr=0.2)
    assert torch.allclose(ours, reference, atol=1e-6, rtol=0)


def test_no_noise_is_drawn_at_zero_temperature():
    net, loader = _problem()
    full_batch = next(iter(DataLoader(loader.dataset, batch_size=NUM_DATA)))
    kernel = SGHMC(_model(bdl.lift(net)), 0.1, temperature=0.0)
    state = torch.get_rng_state()
    MCMC(kernel, num_samples=3, warmup_steps=0, disable_progbar=True).run(full_batch, NUM_DATA)
    assert kernel.run.noise is None
    assert torch.equal(torch.get_rng_state(), state)
