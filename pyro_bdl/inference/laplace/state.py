"""Deprecated alias of :mod:`pyro_bdl.inference.laplace.serialization` (renamed: ``state`` also
named the SGMCMC chain state); it goes in the next release.

``import pyro_bdl.inference.laplace.state`` warns and gives the module
:mod:`pyro_bdl.inference.laplace.serialization` itself, so every name (private ones too) is
there as before.
"""

from pyro_bdl._renamed import renamed_module

renamed_module(__name__, "pyro_bdl.inference.laplace.serialization")
