"""Inference for Bayesian deep learning in Pyro: SGMCMC kernels, Laplace and VI guides."""

from pyro_bdl.inference import baselines, laplace, sgmcmc, vi
from pyro_bdl.inference.laplace import *  # noqa: F403
from pyro_bdl.inference.map import fit_map
from pyro_bdl.inference.minibatch import Minibatches
from pyro_bdl.inference.sgmcmc import *  # noqa: F403
from pyro_bdl.inference.vi import *  # noqa: F403

__all__ = [
    "fit_map",
    "Minibatches",
    "baselines",
    *sgmcmc.__all__,
    *laplace.__all__,
    *vi.__all__,
]
