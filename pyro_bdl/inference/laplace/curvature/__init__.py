"""Curvature structures of the Laplace guide, behind one interface (see :mod:`.base`)."""

from pyro_bdl.inference.laplace.curvature.base import Curvature, GaussianBlock
from pyro_bdl.inference.laplace.curvature.diagonal import Diagonal, DiagonalBlock
from pyro_bdl.inference.laplace.curvature.full import Full, FullBlock
from pyro_bdl.inference.laplace.curvature.kron import Kron, KronBlock
from pyro_bdl.inference.laplace.curvature.kron_lowrank import KronLowRank

__all__ = [
    "Curvature",
    "GaussianBlock",
    "Diagonal",
    "DiagonalBlock",
    "Full",
    "FullBlock",
    "Kron",
    "KronBlock",
    "KronLowRank",
    "make_curvature",
]

_NAMED = {
    "diag_ggn": lambda: Diagonal(fisher="ggn"),
    "diag_ef": lambda: Diagonal(fisher="ef"),
    "kron": lambda: Kron(fisher="ggn"),
    "kron_lowrank": lambda: KronLowRank(fisher="ggn"),
    "full": lambda: Full(fisher="ggn"),
}


def make_curvature(curvature: str | Curvature) -> Curvature:
    """A :class:`Curvature` from its name (``"diag_ggn"``, ``"diag_ef"``, ``"kron"``,
    ``"kron_lowrank"``, ``"full"``) or the instance itself."""
    if isinstance(curvature, Curvature):
        return curvature
    if curvature not in _NAMED:
        raise ValueError(
            f"curvature must be one of {sorted(_NAMED)} or a Curvature instance "
            f"(e.g. KronLowRank(rank=8)), got {curvature!r}"
        )
    return _NAMED[curvature]()
