"""Tempered stochastic-gradient MCMC kernels for ``pyro.infer.MCMC``."""

from pyro_bdl.inference.sgmcmc.base import DivergenceError, SGMCMCKernel
from pyro_bdl.inference.sgmcmc.chains import Chains
from pyro_bdl.inference.sgmcmc.schedules import Constant, RobbinsMonro
from pyro_bdl.inference.sgmcmc.sghmc import SGHMC
from pyro_bdl.inference.sgmcmc.sgld import SGLD
from pyro_bdl.inference.sgmcmc.sgnht import SGNHT

__all__ = [
    "SGLD",
    "SGHMC",
    "SGNHT",
    "SGMCMCKernel",
    "Chains",
    "DivergenceError",
    "Constant",
    "RobbinsMonro",
]
