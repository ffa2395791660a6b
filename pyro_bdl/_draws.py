"""The former name of :mod:`pyro_bdl._offload` (three modules were about "draws": this one,
the SGMCMC kernels' kept draws and their store on disk), kept while
``pyro_bdl.inference.sgmcmc.base`` still imports it by that name; private, so no warning.
"""

from pyro_bdl._offload import copied_to, draw_at, kept_draws, num_draws

__all__ = ["copied_to", "kept_draws", "num_draws", "draw_at"]
