"""The library's version, in a module of its own: the modules that record it (in saved
posteriors and ArviZ attributes) read it here, never through the package that imports
them."""

__version__ = "0.1.0"
