"""A LoRA layer small enough for exact checks: peft on one nn.Linear(5 -> 3), in float64."""

import pyro.distributions as dist
import pytest
import torch
from peft import LoraConfig, get_peft_model

import pyro_bdl as bdl

IN_FEATURES, OUT_FEATURES, RANK = 5, 3, 2


class TinyNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(IN_FEATURES, OUT_FEATURES)

    def forward(self, x):
        return self.proj(x)


def tiny_lora_net(prior_scale=0.5, **lift_kwargs):
    """A lifted peft LoRA (rank 2, scaling 2) on TinyNet: A random, B a point weight."""
    torch.manual_seed(0)
    config = LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=["proj"])
    peft_model = get_peft_model(TinyNet(), config).double()
    lift_kwargs = {"random": "lora_A", "point": "lora_B", **lift_kwargs}
    return bdl.lift(peft_model, bdl.priors.IIDNormal(prior_scale), **lift_kwargs)


def classifier(net):
    """The Pyro model of a 3-class classifier on the tiny network."""

    def model(x, y=None, num_data=None):
        logits = net(x)
        bdl.observe("y", dist.Categorical(logits=logits), y, num_data)
        return logits

    return model


@pytest.fixture
def make_lora_net():
    return tiny_lora_net


@pytest.fixture
def make_classifier():
    return classifier


@pytest.fixture
def data():
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(16, IN_FEATURES, generator=generator, dtype=torch.float64)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    return x, y
