"""The one mechanism behind a renamed public module's old import path.

An alias module calls :func:`renamed_module` in its body: the import warns, naming the new
path, and the old name then *is* the new module in ``sys.modules``, so every name (private
ones too) and every later ``import`` of the old path give the same objects as the new one.
"""

import importlib
import sys
import warnings

__all__ = ["renamed_module"]


def renamed_module(old: str, new: str) -> None:
    """Make the module being imported as ``old`` an alias of ``new``, with a warning.

    :param str old: the former dotted path (the calling alias module's ``__name__``).
    :param str new: the dotted path of the module that replaces it.

    Example, the whole body of an alias module::

        from pyro_bdl._renamed import renamed_module

        renamed_module(__name__, "pyro_bdl.inference.laplace.laplace_lora")
    """
    module = importlib.import_module(new)
    # Three frames up is the importer's line: this function, the alias module's body, then
    # the import statement (``warnings`` skips importlib's own frames).
    warnings.warn(
        f"{old} is renamed {new}; import that instead (this alias goes in the next release)",
        DeprecationWarning,
        stacklevel=3,
    )
    sys.modules[old] = module
