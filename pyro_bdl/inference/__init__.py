"""Inference for Bayesian deep learning in Pyro: SGMCMC kernels, Laplace and VI guides."""

from pyro_bdl.inference.sgmcmc import (
    SGHMC,
    SGLD,
    SGNHT,
    Constant,
    DivergenceError,
    RobbinsMonro,
    SGMCMCKernel,
)

__all__ = [
    "SGLD",
    "SGHMC",
    "SGNHT",
    "SGMCMCKernel",
    "DivergenceError",
    "Constant",
    "RobbinsMonro",
]
