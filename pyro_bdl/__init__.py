"""pyro_bdl: scalable Bayesian deep learning in Pyro."""

__version__ = "0.1.0"
