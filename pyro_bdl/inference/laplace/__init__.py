"""Laplace approximations as Pyro guides: curvature, linearised predictive, evidence.

See :class:`LaplaceGuide`; the curvature structures are in
:mod:`pyro_bdl.inference.laplace.curvature`.
"""

from pyro_bdl.inference.laplace.curvature import (
    Curvature,
    Diagonal,
    Full,
    Kron,
    KronLowRank,
)
from pyro_bdl.inference.laplace.guide import LaplaceGuide
from pyro_bdl.inference.laplace.prior import BlockNormal, LaplacePrior

__all__ = [
    "LaplaceGuide",
    "LaplacePrior",
    "BlockNormal",
    "Curvature",
    "Diagonal",
    "Kron",
    "KronLowRank",
    "Full",
]
