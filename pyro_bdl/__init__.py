"""pyro_bdl: scalable Bayesian deep learning in Pyro.

Example::

    import pyro_bdl as bdl
    net = bdl.lift(peft_model, prior=bdl.priors.IIDNormal(scale=0.2))  # adapters and head
"""

from pyro_bdl import data, diagnostics, metrics, priors
from pyro_bdl.arviz import to_arviz
from pyro_bdl.lift import LiftedModule, init_to_module, lift
from pyro_bdl.likelihoods import observe
from pyro_bdl.persistence import load, save

__version__ = "0.1.0"

__all__ = [
    "lift",
    "LiftedModule",
    "init_to_module",
    "observe",
    "to_arviz",
    "save",
    "load",
    "priors",
    "data",
    "metrics",
    "diagnostics",
    "models",
    "lm",
    "__version__",
]


def __getattr__(name: str):
    # pyro_bdl.models imports transformers and peft (seconds); load it on first use, and
    # pyro_bdl.lm (which imports them only when called) alike.
    if name in ("models", "lm"):
        import importlib

        return importlib.import_module(f"pyro_bdl.{name}")
    raise AttributeError(f"module 'pyro_bdl' has no attribute {name!r}")
