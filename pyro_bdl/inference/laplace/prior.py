"""Deprecated alias of :mod:`pyro_bdl.inference.laplace.laplace_prior` (renamed: three modules
were about priors; this one holds :class:`LaplacePrior`); it goes in the next release.

``import pyro_bdl.inference.laplace.prior`` warns and gives the module
:mod:`pyro_bdl.inference.laplace.laplace_prior` itself, so every name (private ones too) is
there as before.
"""

from pyro_bdl._renamed import renamed_module

renamed_module(__name__, "pyro_bdl.inference.laplace.laplace_prior")
