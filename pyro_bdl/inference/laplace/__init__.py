"""Laplace approximations as Pyro guides: curvature, linearised predictive, evidence.

See :class:`LaplaceGuide`, which holds what its fit found as one :class:`LaplaceFit`; the
curvature structures are in
:mod:`pyro_bdl.inference.laplace.curvature`; :func:`fit_laplace_lora` is Laplace-LoRA's
post-hoc recipe in one call.
"""

from pyro_bdl.inference.laplace.approximation import LaplaceFit
from pyro_bdl.inference.laplace.curvature import (
    Curvature,
    Diagonal,
    Full,
    Kron,
    KronLowRank,
)
from pyro_bdl.inference.laplace.guide import LaplaceGuide
from pyro_bdl.inference.laplace.laplace_lora import fit_laplace_lora
from pyro_bdl.inference.laplace.laplace_prior import BlockNormal, LaplacePrior

__all__ = [
    "LaplaceGuide",
    "LaplaceFit",
    "fit_laplace_lora",
    "LaplacePrior",
    "BlockNormal",
    "Curvature",
    "Diagonal",
    "Kron",
    "KronLowRank",
    "Full",
]
