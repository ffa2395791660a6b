"""Deprecated alias of :mod:`pyro_bdl.inference.laplace.laplace_prior` (renamed: three modules
were about priors; this one holds :class:`LaplacePrior`); it goes in the next release.

``import pyro_bdl.inference.laplace.prior`` warns and gives the module
:mod:`pyro_bdl.inference.laplace.laplace_prior` itself, so every name (private ones too) is
there as before.
"""

import sys
import warnings

import pyro_bdl.inference.laplace.laplace_prior as _renamed

warnings.warn(
    "pyro_bdl.inference.laplace.prior is renamed "
    "pyro_bdl.inference.laplace.laplace_prior; import that "
    "instead (this alias goes in the next release)",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = _renamed
