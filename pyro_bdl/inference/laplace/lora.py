"""Deprecated alias of :mod:`pyro_bdl.inference.laplace.laplace_lora` (renamed: two modules
were called ``lora.py``, this recipe and the LoRA models of :mod:`pyro_bdl.models.lora`); it
goes in the next release.

``import pyro_bdl.inference.laplace.lora`` warns and gives the module
:mod:`pyro_bdl.inference.laplace.laplace_lora` itself, so every name (private ones too) is
there as before.
"""

import sys
import warnings

import pyro_bdl.inference.laplace.laplace_lora as _renamed

warnings.warn(
    "pyro_bdl.inference.laplace.lora is renamed "
    "pyro_bdl.inference.laplace.laplace_lora; import that "
    "instead (this alias goes in the next release)",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = _renamed
