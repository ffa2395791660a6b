"""pyproject.toml's hard dependencies are what the library imports; the rest are extras.

Every third-party import of ``pyro_bdl`` (lazy ones, inside functions, included) is read
with ``ast`` and mapped to its distribution: it must be a hard dependency, or belong to an
extra and be imported lazily (or by a module that is itself an extra's, as the demo is);
and every hard dependency must be imported, but for the one the library needs without
importing it.
"""

import ast
import re
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# modules whose every import an extra provides: the module is that extra's
EXTRA_MODULES = {"pyro_bdl/demo.py": "demo"}
# hard dependencies the library needs without importing them, and why
NOT_IMPORTED = {
    # xarray opens the chunked draws of a run lazily (bdl.to_arviz(directory)) with dask
    "dask": ("pyro_bdl/inference/sgmcmc/store.py", "chunks={}"),
}


def _name(requirement: str) -> str:
    """The normalised distribution name of a requirement (``"h5netcdf[h5py]>=1.3"``)."""
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


HARD = {_name(requirement) for requirement in PYPROJECT["dependencies"]}
EXTRAS = {
    _name(requirement): extra
    for extra, requirements in PYPROJECT["optional-dependencies"].items()
    for requirement in requirements
}


def _imports() -> dict[str, list[tuple[str, bool]]]:
    """Top-level module name -> (file:line, whether lazy) of every third-party import."""
    found: dict[str, list[tuple[str, bool]]] = {}
    for path in sorted((ROOT / "pyro_bdl").rglob("*.py")):
        tree = ast.parse(path.read_text())
        lazy = {
            id(node)
            for function in ast.walk(tree)
            if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef))
            for node in ast.walk(function)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.partition(".")[0]
                if top in sys.stdlib_module_names or top in ("pyro_bdl", "__future__"):
                    continue
                where = f"{path.relative_to(ROOT).as_posix()}:{node.lineno}"
                found.setdefault(top, []).append((where, id(node) in lazy))
    return found


DISTRIBUTIONS = packages_distributions()


def _distribution(module: str) -> str:
    """The distribution that provides ``module`` (its own name when none installed does:
    an optional package such as bitsandbytes)."""
    return _name(DISTRIBUTIONS.get(module, [module])[0])


def test_every_import_is_a_hard_dependency_or_an_extras():
    wrong = []
    for module, places in sorted(_imports().items()):
        distribution = _distribution(module)
        if distribution in HARD:
            continue
        extra = EXTRAS.get(distribution)
        for where, lazy in places:
            owner = EXTRA_MODULES.get(where.partition(":")[0])
            if extra is None or not (lazy or owner == extra):
                wrong.append(
                    f"{where} imports {module} ({distribution}): add it to pyproject.toml's "
                    "dependencies, or to an extra and import it inside the function that "
                    "needs it"
                )
    assert not wrong, "\n".join(wrong)


def test_every_hard_dependency_is_imported():
    imported = {_distribution(module) for module in _imports()}
    for distribution, (path, use) in NOT_IMPORTED.items():
        assert use in (ROOT / path).read_text(), f"{path} no longer needs {distribution}"
    unused = HARD - imported - set(NOT_IMPORTED)
    assert not unused, (
        f"pyproject.toml's dependencies {sorted(unused)} are never imported by pyro_bdl: "
        "move them to the extra of what needs them (and name it in the README)"
    )
