"""Inference for Bayesian deep learning in Pyro: SGMCMC kernels, Laplace and VI guides."""

from pyro_bdl.inference import laplace, vi
from pyro_bdl.inference.laplace import *  # noqa: F403
from pyro_bdl.inference.map import fit_map
from pyro_bdl.inference.minibatch import Minibatches
from pyro_bdl.inference.sgmcmc import (
    SGHMC,
    SGLD,
    SGNHT,
    Chains,
    Constant,
    DivergenceError,
    RobbinsMonro,
    SGMCMCKernel,
)
from pyro_bdl.inference.vi import *  # noqa: F403

__all__ = [
    "SGLD",
    "SGHMC",
    "SGNHT",
    "SGMCMCKernel",
    "Chains",
    "DivergenceError",
    "Constant",
    "RobbinsMonro",
    "fit_map",
    "Minibatches",
    *laplace.__all__,
    *vi.__all__,
]
