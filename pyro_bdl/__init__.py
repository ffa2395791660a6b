"""pyro_bdl: scalable Bayesian deep learning in Pyro.

Example::

    import pyro_bdl as bdl
    net = bdl.lift(peft_model, prior=bdl.priors.IIDNormal(scale=0.2))  # adapters and head
"""

from pyro_bdl import data, diagnostics, metrics, priors
from pyro_bdl._version import __version__
from pyro_bdl.lift import LiftedModule, init_to_module, lift
from pyro_bdl.likelihoods import observe
from pyro_bdl.persistence import load, save
from pyro_bdl.posterior import Posterior, as_posterior, predict_proba

__all__ = [
    "lift",
    "LiftedModule",
    "init_to_module",
    "observe",
    "to_arviz",
    "save",
    "load",
    "Posterior",
    "as_posterior",
    "predict_proba",
    "priors",
    "data",
    "metrics",
    "diagnostics",
    "models",
    "lm",
    "__version__",
]


def __getattr__(name: str):
    # What `import pyro_bdl` would pay for on every start loads on first use (PEP 562):
    # pyro_bdl.models imports transformers and peft (seconds), pyro_bdl.lm imports them when
    # called, to_arviz imports ArviZ, xarray and matplotlib (together about half of
    # `import pyro`).
    if name == "models":
        import pyro_bdl.models as models

        return models
    if name == "lm":
        import pyro_bdl.lm as lm

        return lm
    if name == "to_arviz":
        from pyro_bdl.arviz import to_arviz

        return to_arviz
    raise AttributeError(f"module 'pyro_bdl' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), "models", "lm", "to_arviz"})
