"""Sphinx configuration of the pyro_bdl documentation (``make docs``)."""

import importlib
import inspect
import os
import sys

from sphinx.util import logging

sys.path.insert(0, os.path.abspath(".."))
import pyro_bdl  # noqa: E402

project = "pyro_bdl"
author = "the pyro_bdl authors"
copyright = "2025, " + author
release = version = pyro_bdl.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
    "myst_parser",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]
html_theme = "furo"
html_title = f"pyro_bdl {release}"
# MathJax is loaded by the reader's browser; the build itself never touches the network.
myst_enable_extensions = ["dollarmath"]
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented_params"
autodoc_default_options = {"show-inheritance": False}
autodoc_inherit_docstrings = False
autoclass_content = "class"

# No intersphinx: the build runs offline. References to other libraries' objects (in
# type hints and docstrings) render as plain code instead of links.
nitpicky = True
_EXTERNAL = (
    "torch",
    "pyro",
    "numpy",
    "np",
    "xarray",
    "xr",
    "matplotlib",
    "transformers",
    "peft",
    "scipy",
    "pandas",
    "pd",
    "arviz_base",
    "arviz_stats",
    "arviz_plots",
    "collections",
    "typing",
    "os",
    "pathlib",
    "tqdm",
    "dataclasses",
    "contextlib",
    "sklearn",
    "accelerate",
)
nitpick_ignore_regex = [
    ("py:.*", rf"({'|'.join(_EXTERNAL)})(\..*)?"),
    # builtins and the plain-English types of ``:param type name:`` fields
    (
        "py:.*",
        r"(int|float|str|bool|bytes|dict|list|tuple|set|callable|None|object|type|"
        r"optional|iterable|sequence|mapping|function|module|Any|Path|Tensor|"
        r"Iterator|Callable|Mapping|Sequence|NamedTuple|Protocol)",
    ),
    ("py:.*", r".*(\s|\[|\]|,).*"),  # compound types written in words ("list of str")
    ("py:class", r"PriorPrecision|Record"),  # type aliases in signatures
    ("py:class", r"(.*\.)?_\w+"),  # private classes in signatures
]
# docs/experiments.md is written for GitHub as well, whose headings may skip levels.
suppress_warnings = ["myst.header"]

# Every public name of these modules must be documented on some page of the site.
PUBLIC_MODULES = [
    "pyro_bdl",
    "pyro_bdl.priors",
    "pyro_bdl.inference",
    "pyro_bdl.inference.baselines",
    "pyro_bdl.models",
    "pyro_bdl.data",
    "pyro_bdl.metrics",
    "pyro_bdl.diagnostics",
    "pyro_bdl.predict",
    "pyro_bdl.plots",
    "experiments",
]
logger = logging.getLogger("pyro_bdl.docs")


def _objects(env):
    return env.get_domain("py").objects


def _check_public_names(app, env):
    """Warn (an error under -W) for a public name no page documents, or without a docstring."""
    documented = {id(_resolve(name)) for name in _objects(env)} - {id(None)}
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        for name in getattr(module, "__all__", []):
            obj = getattr(module, name)
            if inspect.ismodule(obj) or name.startswith("__"):
                continue
            if id(obj) not in documented:
                logger.warning(f"public name {module_name}.{name} is not documented on any page")
            elif (inspect.isclass(obj) or callable(obj)) and not inspect.getdoc(obj):
                logger.warning(f"public name {module_name}.{name} has no docstring")


def _resolve(path: str):
    """The object at a dotted path, or None; an attribute wins over a submodule of that name
    (``pyro_bdl.lift`` is the function, not the module ``pyro_bdl/lift.py``)."""
    parts = path.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        try:
            for attribute in parts[split:]:
                obj = getattr(obj, attribute)
        except AttributeError:
            break
        return obj
    try:
        return importlib.import_module(path)
    except ImportError:
        return None


def _resolve_alias(app, env, node, contnode):
    """Resolve ``pyro_bdl.x.y.Name`` to the page that documents the same object elsewhere.

    Docstrings refer to objects by the module that defines them or by the package that
    re-exports them; each object is documented once, under its public name.
    """
    if node.get("refdomain") != "py":
        return None
    target, module = node["reftarget"], node.get("py:module") or ""
    if target.startswith("."):
        target = module + target if target.count(".") == 1 else target.lstrip(".")
    elif not target.startswith("pyro_bdl"):
        # A bare name: one the docstring's module imports (``fit_blob`` in baselines).
        if not module.startswith("pyro_bdl") or "." in target:
            return None
        target = f"{module}.{target}"
    domain = env.get_domain("py")
    if node["reftype"] == "mod":
        # An undocumented submodule: link to the closest documented package above it.
        while "." in target and _objects(env).get(target) is None:
            target = target.rpartition(".")[0]
        if target not in _objects(env) or _resolve(target) is None:
            return None
        return domain.resolve_xref(env, node["refdoc"], app.builder, "mod", target, node, contnode)
    obj = _resolve(target)
    if obj is None:
        return None
    names = {
        id(_resolve(name)): name
        for name, entry in _objects(env).items()
        if entry.objtype != "module"
    }
    name = names.get(id(obj))
    if name is None:
        return None
    return domain.resolve_xref(env, node["refdoc"], app.builder, "obj", name, node, contnode)


def setup(app):
    app.connect("env-check-consistency", _check_public_names)
    app.connect("missing-reference", _resolve_alias)
