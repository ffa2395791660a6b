"""docs/architecture.md says what the code does: its import table is the package's import
graph, the graph has no cycles, and the page names every module.

The graph is read from the source with ``ast``: every ``import`` and ``from ... import``
of ``pyro_bdl`` in every module, lazy ones (inside functions) included. Its nodes are the
page's units: each module or subpackage directly under ``pyro_bdl`` and under
``pyro_bdl.inference`` (a package's ``__init__.py`` is the unit named by the package
itself). A failure says what to write on the page, so that whoever adds a module or an
import keeps the page true in the same change.
"""

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pyro_bdl"
PAGE = ROOT / "docs" / "architecture.md"
# units are the children of these packages (relative to pyro_bdl; "" is pyro_bdl itself)
LAYERED = ("", "inference")
# the table sits between these markers on the page
BEGIN, END = "<!-- import-table -->", "<!-- /import-table -->"


def _modules() -> dict[str, Path]:
    """Dotted name (``pyro_bdl.inference.map``) -> file, for every module of the package."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


MODULES = _modules()


def _unit(module: str) -> str:
    """The page's unit of a dotted module name: ``inference.laplace``, ``lift``, ``pyro_bdl``."""
    relative = module.split(".")[1:]
    for depth in range(len(relative)):
        if ".".join(relative[:depth]) not in LAYERED:
            return ".".join(relative[:depth])
    return ".".join(relative) or "pyro_bdl"


@functools.cache
def _imports(module: str) -> list[tuple[str, int]]:
    """The modules of ``pyro_bdl`` (or ``experiments``) that ``module`` imports, with lines."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            # `from pyro_bdl import data`: the submodule, if there is one
            names = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names
            ]
        else:
            continue
        for name in names:
            if name.partition(".")[0] in ("pyro_bdl", "experiments"):
                while name not in MODULES and "." in name:
                    name = name.rpartition(".")[0]
                found.append((name, node.lineno))
    return found


def _graph() -> dict[str, dict[str, str]]:
    """Unit -> the units it imports -> where (``file:line``, the first such import)."""
    graph: dict[str, dict[str, str]] = {_unit(module): {} for module in MODULES}
    for module, path in MODULES.items():
        for target, line in _imports(module):
            source, imported = _unit(module), _unit(target) if target in MODULES else target
            if imported != source:
                where = f"{path.relative_to(ROOT)}:{line}"
                graph[source].setdefault(imported, where)
    return graph


def _table() -> dict[str, set[str]]:
    """The page's import table: unit -> the units it imports."""
    text = PAGE.read_text()
    assert BEGIN in text and END in text, f"{PAGE.name} lost its {BEGIN} ... {END} table"
    rows = {}
    for line in text.split(BEGIN)[1].split(END)[0].splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 2 or not cells[0].startswith("`"):
            continue  # the header and its rule
        rows[cells[0].strip("`")] = set(re.findall(r"`([^`]+)`", cells[1]))
    return rows


def _row(unit: str, imports) -> str:
    return f"| `{unit}` | {', '.join(f'`{name}`' for name in sorted(imports))} |"


def test_the_import_table_is_the_import_graph():
    graph, table = _graph(), _table()
    fixes = []
    for unit in sorted(graph):
        if table.get(unit) != set(graph[unit]):
            now = sorted(set(graph[unit]) - table.get(unit, set()))
            gone = sorted(table.get(unit, set()) - set(graph[unit]))
            why = [f"imports `{name}` ({graph[unit][name]})" for name in now]
            why += [f"no longer imports `{name}`" for name in gone]
            what = "add the row" if unit not in table else "make its row"
            fixes.append(f"{what}\n  {_row(unit, graph[unit])}\n  ({'; '.join(why)})")
    fixes += [
        f"remove the row of `{unit}` (no such module)" for unit in sorted(set(table) - set(graph))
    ]
    assert not fixes, "docs/architecture.md's import table is out of date:\n" + "\n".join(fixes)


def test_the_imports_have_no_cycle():
    # module by module, lazy imports included: a cycle between units is one between modules
    edges = {
        module: {t for t, _ in _imports(module) if t in MODULES} - {module} for module in MODULES
    }
    cycles = _cycles(edges)
    assert not cycles, "import cycles (break each; imports flow one way):\n" + "\n".join(
        " -> ".join([*cycle, cycle[0]]) for cycle in cycles
    )


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(edges[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while component[-1:] != [node]:
                component.append(stack.pop())
            if len(component) > 1:
                components.append(component[::-1])

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return components


def test_the_library_never_imports_the_experiments():
    # the installed command finds them through the pyro_bdl.commands entry point only
    graph = _graph()
    assert not [unit for unit, imports in graph.items() if "experiments" in imports]


def test_the_models_do_not_import_inference_and_inference_not_the_models():
    graph = _graph()
    assert not any(name.startswith("inference") for name in graph["models"])
    assert not [u for u in graph if u.startswith("inference") and "models" in graph[u]]


def test_the_page_names_every_module():
    text = PAGE.read_text()
    missing = []
    for path in MODULES.values():
        if path.name == "__init__.py":
            continue  # a package: named by its folder
        relative = path.relative_to(PACKAGE).as_posix()
        if f"`{path.name}`" not in text and relative not in text:
            missing.append(relative)
    assert not missing, (
        "docs/architecture.md does not name these modules: add each (`name.py`, in "
        "backticks) to the paragraph or table of its package, saying what it holds:\n  "
        + "\n  ".join(missing)
    )
