"""A network whose posterior has mirrored modes: logits = w2 tanh(w1 x), unchanged when
both weights flip sign. Shared by the function-space tests."""

import pyro.distributions as dist
import torch

import pyro_bdl as bdl

#: One mode of the posterior; its mirror image (-w1, -w2) makes the same predictions.
MODE = {"0.weight": torch.tensor([[1.5]]), "2.weight": torch.tensor([[-2.0], [2.0]])}


def sign_flip_model():
    """``(model, x, y)``: the lifted 1-1-2 tanh network, float64, and 200 labels drawn
    from it at :data:`MODE` (seed 0)."""
    module = torch.nn.Sequential(
        torch.nn.Linear(1, 1, bias=False), torch.nn.Tanh(), torch.nn.Linear(1, 2, bias=False)
    ).double()
    net = bdl.lift(module, prior=bdl.priors.IIDNormal(1.0))

    def model(x, y=None, num_data=None):
        logits = net(x)
        bdl.observe("y", dist.Categorical(logits=logits), y, num_data)
        return logits

    x = torch.linspace(-2, 2, 200, dtype=torch.float64)[:, None]
    mode = {name: value.double() for name, value in MODE.items()}
    with torch.no_grad(), net.fixed(mode):
        logits = net(x)
    generator = torch.Generator().manual_seed(0)
    y = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator).squeeze(-1)
    return model, x, y


def draws_near(centres, num_draws, scale=0.05, seed=0):
    """Independent draws around one centre per chain: site -> (chain, draw, *shape)."""
    generator = torch.Generator().manual_seed(seed)
    return {
        name: torch.stack(
            [
                c[name].double() + scale * torch.randn(num_draws, *c[name].shape,
                                                       generator=generator, dtype=torch.float64)
                for c in centres
            ]
        )
        for name in centres[0]
    }  # fmt: skip


def mirrored(mode):
    return {name: -value for name, value in mode.items()}


def flipped_output(mode):
    """A mode of a different function: the output layer's sign flipped alone."""
    return {**mode, "2.weight": -mode["2.weight"]}
