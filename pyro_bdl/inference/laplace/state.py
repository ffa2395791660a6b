"""Deprecated alias of :mod:`pyro_bdl.inference.laplace.serialization` (renamed: ``state`` also
named the SGMCMC chain state); it goes in the next release.

``import pyro_bdl.inference.laplace.state`` warns and gives the module
:mod:`pyro_bdl.inference.laplace.serialization` itself, so every name (private ones too) is
there as before.
"""

import sys
import warnings

import pyro_bdl.inference.laplace.serialization as _renamed

warnings.warn(
    "pyro_bdl.inference.laplace.state is renamed "
    "pyro_bdl.inference.laplace.serialization; import that "
    "instead (this alias goes in the next release)",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = _renamed
