"""Posteriors fitted and saved in one process, loaded in another (see test_persistence.py).

Every case builds its model the same way in both processes (fixed seeds), fits and saves
in the test's process, and computes its outputs there right after saving: predictions
from fixed seeds, the Laplace prior, and for the training runs the state after a few more
steps. ``python tests/persistence_cases.py ROOT`` is the other process: for every case
saved under ``ROOT`` it builds the model afresh (no fit), ``bdl.load``\\ s the directory
and writes the same outputs to ``ROOT/<case>/loaded.safetensors``.
"""

import sys
import warnings
from pathlib import Path

import pyro
import torch
from pyro.infer import MCMC, SVI, Predictive, TraceMeanField_ELBO
from safetensors.torch import save_file

import pyro_bdl as bdl
from pyro_bdl.demo import classifier
from pyro_bdl.inference import (
    IVONSVI,
    SGHMC,
    BLoBGuide,
    BLoBSVI,
    Chains,
    IVONGuide,
    KronLowRank,
    LaplaceGuide,
    MeanFieldGuide,
)
from pyro_bdl.predict import predict_proba

NUM_DATA = 48
MORE_STEPS = 3


def data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(NUM_DATA, 5, generator=generator, dtype=torch.float64)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class TwoHeads(torch.nn.Module):
    """A hidden layer read by two heads: K-FAC gives them one shared input factor."""

    def __init__(self, hidden: int = 6):
        super().__init__()
        self.hidden = torch.nn.Linear(5, hidden)
        self.left = torch.nn.Linear(hidden, 3)
        self.right = torch.nn.Linear(hidden, 3, bias=False)

    def forward(self, x):
        h = torch.tanh(self.hidden(x))
        return self.left(h) + self.right(h)


class TinyNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(5, 3)

    def forward(self, x):
        return self.proj(x)


def mlp_model(hidden: int = 6):
    """The Pyro model of a lifted TwoHeads (every weight random), float64."""
    torch.manual_seed(0)
    return classifier(bdl.lift(TwoHeads(hidden).double(), bdl.priors.IIDNormal(1.0)))


def lora_model(b_random: bool = False):
    """A lifted peft LoRA (rank 2) on TinyNet: A random, B a point weight unless b_random."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    config = LoraConfig(r=2, lora_alpha=4, target_modules=["proj"])
    peft_model = get_peft_model(TinyNet(), config).double()
    point = None if b_random else "lora_B"
    random = "lora_" if b_random else "lora_A"
    return classifier(bdl.lift(peft_model, bdl.priors.IIDNormal(0.5), random, point))


def batches():
    """Fixed minibatches of 16, cycling."""
    x, y = data()
    while True:
        for start in range(0, NUM_DATA, 16):
            yield (x[start : start + 16], y[start : start + 16]), NUM_DATA


def predictions(model, guide) -> torch.Tensor:
    x, _ = data()
    pyro.set_rng_seed(2)
    predictive = Predictive(model, guide=guide, num_samples=3, return_sites=["_RETURN"])
    return predictive((x, None), NUM_DATA)["_RETURN"]


# -- Laplace ---------------------------------------------------------------------------------


class Laplace:
    build = staticmethod(mlp_model)

    def __init__(self, curvature):
        self.curvature = curvature

    def fit(self, model):
        x, y = data()
        guide = LaplaceGuide(model, self.curvature)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            guide.fit((x, y), NUM_DATA, num_steps=100, max_passes=5, progress=False)
            guide.optimize_prior_precision(num_steps=30)  # short: not converged, on purpose
        guide.select_link((x, y), NUM_DATA, links=("probit", "bridge"))  # not the default
        return guide

    def outputs(self, model, guide) -> dict[str, torch.Tensor]:
        x, _ = data()
        out = {}
        for link in ("mc", "probit", "bridge"):
            out[link] = guide.predictive((x, None), NUM_DATA, link=link, generator=seeded(0))
        out["selected link"] = guide.predictive((x, None), NUM_DATA)
        for name, draw in guide.sample_posterior(4, generator=seeded(1)).items():
            out[f"draw/{name}"] = draw
        out["Predictive"] = predictions(model, guide)
        out["evidence"] = guide.log_marginal_likelihood().detach()
        out["mode_distance"] = torch.tensor(guide.mode_distance, dtype=torch.float64)
        prior = guide.as_prior()
        for name, value in guide.median().items():
            distribution = prior.distribution(name, value)
            out[f"as_prior/{name}/mean"] = distribution.mean
            out[f"as_prior/{name}/variance"] = distribution.variance
            out[f"as_prior/{name}/log_prob"] = distribution.log_prob(value + 0.1)
        return out


# -- VI --------------------------------------------------------------------------------------


class MeanField:
    build = staticmethod(mlp_model)

    def fit(self, model):
        guide = MeanFieldGuide(model)
        svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.05}), TraceMeanField_ELBO())
        stream = batches()
        for _ in range(10):
            svi.step(*next(stream))
        return guide

    def outputs(self, model, guide):
        quantiles = guide.quantiles([0.1, 0.9])
        return {
            "Predictive": predictions(model, guide),
            **{f"quantiles/{name}": value for name, value in quantiles.items()},
        }


class Training:
    """An IVONSVI or BLoBSVI saved mid-run: its next steps are the uninterrupted run's."""

    def __init__(self, kind: str):
        self.kind = kind

    def build(self):
        return mlp_model() if self.kind == "ivon" else lora_model()

    def fit(self, model):
        if self.kind == "ivon":
            svi = IVONSVI(model, IVONGuide(model), lr=0.05)
        else:
            svi = BLoBSVI(model, BLoBGuide(model), num_steps=20, lr=1e-2, kl_lr=1e-2)
        stream = batches()
        for _ in range(5):
            svi.step(*next(stream))
        return svi

    def outputs(self, model, svi):
        x, _ = data()
        pyro.set_rng_seed(4)
        out = {"probs": predict_proba(model, (x, None), NUM_DATA, guide=svi.guide, num_samples=3)}
        pyro.set_rng_seed(5)
        stream = batches()
        for _ in range(MORE_STEPS):
            svi.step(*next(stream))
        out.update({f"median/{k}": v for k, v in svi.guide.median().items()})
        store = pyro.get_param_store()
        out.update({f"point/{name}": store[name] for name in svi.guide._point_names})
        if self.kind == "ivon":
            out["hess"] = svi.guide.hess
        return out


# -- draws -----------------------------------------------------------------------------------


class Draws:
    build = staticmethod(mlp_model)

    def __init__(self, chains: int):
        self.chains = chains

    def fit(self, model):
        x, y = data()
        kernel = SGHMC(model, step_size=1e-3)
        if self.chains == 1:
            run = MCMC(kernel, num_samples=6, warmup_steps=4, disable_progbar=True)
        else:
            run = Chains(kernel, 4, 2, num_chains=self.chains, seed=0, disable_progbar=True)
        run.run((x, y), NUM_DATA)
        return run

    def outputs(self, model, run):
        x, _ = data()
        samples = run.get_samples()
        out = {f"draws/{k}": v for k, v in run.get_samples(group_by_chain=True).items()}
        out["probs"] = predict_proba(model, (x, None), NUM_DATA, samples=samples)
        return out


CASES = {
    **{
        f"laplace_{name}": Laplace(curvature)
        for name, curvature in (
            ("diag_ggn", "diag_ggn"),
            ("diag_ef", "diag_ef"),
            ("kron", "kron"),
            ("kron_lowrank", KronLowRank(rank=2)),
            ("full", "full"),
        )
    },
    "mean_field": MeanField(),
    "ivon": Training("ivon"),
    "blob": Training("blob"),
    "mcmc": Draws(chains=1),
    "chains": Draws(chains=2),
}


def save_outputs(path: Path, outputs: dict[str, torch.Tensor]) -> None:
    save_file({k: v.detach().cpu().contiguous() for k, v in outputs.items()}, str(path))


def load_all(root: Path) -> None:
    """The other process: load every saved case and write its outputs."""
    for name, case in CASES.items():
        directory = root / name
        if not directory.is_dir():
            continue
        pyro.clear_param_store()
        model = case.build()
        posterior = bdl.load(directory, model)
        save_outputs(directory / "loaded.safetensors", case.outputs(model, posterior))


if __name__ == "__main__":
    load_all(Path(sys.argv[1]))
