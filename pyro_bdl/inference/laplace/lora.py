"""Deprecated alias of :mod:`pyro_bdl.inference.laplace.laplace_lora` (renamed: two modules
were called ``lora.py``, this recipe and the LoRA models of :mod:`pyro_bdl.models.lora`); it
goes in the next release.

``import pyro_bdl.inference.laplace.lora`` warns and gives the module
:mod:`pyro_bdl.inference.laplace.laplace_lora` itself, so every name (private ones too) is
there as before.
"""

from pyro_bdl._renamed import renamed_module

renamed_module(__name__, "pyro_bdl.inference.laplace.laplace_lora")
