"""Variational guides: mean-field Gaussian VI, BLoB (with flipout and KL re-weighting) and IVON."""

from pyro_bdl.inference.vi.blob import BLoBGuide
from pyro_bdl.inference.vi.blob_svi import BLoBSVI, fit_blob
from pyro_bdl.inference.vi.flipout import LoRAFlipout, flipout_linear
from pyro_bdl.inference.vi.ivon import IVONGuide
from pyro_bdl.inference.vi.ivon_svi import IVONSVI, fit_ivon
from pyro_bdl.inference.vi.kl_weights import (
    blob_kl_cycle,
    exponential_kl_weight,
    uniform_kl_weight,
)
from pyro_bdl.inference.vi.mean_field import MeanFieldGuide
from pyro_bdl.inference.vi.normal import VariationalNormal

__all__ = [
    "MeanFieldGuide",
    "BLoBGuide",
    "BLoBSVI",
    "fit_blob",
    "IVONGuide",
    "IVONSVI",
    "fit_ivon",
    "VariationalNormal",
    "LoRAFlipout",
    "flipout_linear",
    "blob_kl_cycle",
    "exponential_kl_weight",
    "uniform_kl_weight",
]
