"""How far a reader walks to follow a Laplace fit: issue 38's counts, measured.

Static counts (read with ``ast`` from the package's source):

* **writes**: attributes of the guide assigned (or mutated in place, ``.update``) by a
  module of ``pyro_bdl/inference/laplace/`` other than ``guide.py``, and the modules
  that do it;
* **private accesses**: ``guide._<name>`` outside ``guide.py`` (anywhere in ``pyro_bdl``)
  where ``<name>`` is a private member of a fitted :class:`~pyro_bdl.inference.LaplaceGuide`
  (its instance attributes and its class's own methods): how often, and how many names;
* **methods**: those ``LaplaceGuide`` defines, those that only pass a call on (their
  body, less the docstring and ``self._check_fitted()``-style guards, is one call of a
  function of another module, the assignments feeding it and ``return self``), and those
  that hand the guide itself (``self``) to a function of another module.

The walk (run, traced with ``sys.setprofile``): ``lora_model`` on a tiny Llama,
``LaplaceGuide(...).fit(loader, N, map=False)`` and ``guide.predictive(batch, N)``. A
reader reads each function of ``pyro_bdl`` once, where the run first enters it; following
those first calls and their returns in order, the walk reports the modules crossed and
how often the reader moves to a module already left (a call into it, or a return to it).

Run::

    PYTHONPATH=. python benchmarks/laplace_structure.py
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pyro_bdl"
LAPLACE = PACKAGE / "inference" / "laplace"
GUIDE = LAPLACE / "guide.py"


def _modules(folder: Path) -> list[Path]:
    return sorted(path for path in folder.rglob("*.py") if path != GUIDE)


def _guide_attributes(tree: ast.AST):
    """``(node, is_write)`` for every ``guide.<attr>`` in ``tree``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id == "guide":
                yield node, isinstance(node.ctx, ast.Store)
        if (  # guide._x.update(...): a write in place
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("update", "clear", "pop", "setdefault")
            and isinstance(node.func.value, ast.Attribute)
            and isinstance(node.func.value.value, ast.Name)
            and node.func.value.value.id == "guide"
        ):
            yield node.func.value, True


def private_members() -> set[str]:
    """The private names a fitted LaplaceGuide has: instance attributes and own methods."""
    import pyro_bdl.inference.laplace.guide as guide_module

    cls = guide_module.LaplaceGuide
    names = {name for name in vars(cls) if name.startswith("_") and not name.startswith("__")}
    tree = ast.parse(GUIDE.read_text())
    for node in ast.walk(tree):  # self._x = ... anywhere in guide.py
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and isinstance(node.ctx, ast.Store)
        ):
            names.add(node.attr)
    for path in _modules(LAPLACE):  # and those the sibling modules create on it
        for node, write in _guide_attributes(ast.parse(path.read_text())):
            if write and node.attr.startswith("_"):
                names.add(node.attr)
    return names


def static_counts() -> dict:
    members = private_members()
    written: dict[str, set[str]] = {}
    for path in _modules(LAPLACE):
        for node, write in _guide_attributes(ast.parse(path.read_text())):
            if write:
                written.setdefault(node.attr, set()).add(path.name)
    accesses: dict[str, int] = {}
    by_module: dict[str, int] = {}
    for path in _modules(PACKAGE):
        for node, _ in _guide_attributes(ast.parse(path.read_text())):
            if node.attr in members:
                accesses[node.attr] = accesses.get(node.attr, 0) + 1
                name = str(path.relative_to(PACKAGE))
                by_module[name] = by_module.get(name, 0) + 1
    methods, forwarders, handing = _methods()
    private_written = sorted(name for name in written if name.startswith("_"))
    return {
        "private attributes written outside guide.py": len(private_written),
        "their names": private_written,
        "modules writing the guide's attributes": sorted(set().union(*written.values()))
        if written
        else [],
        "all attributes written outside guide.py": sorted(written),
        "private accesses outside guide.py": sum(accesses.values()),
        "private members accessed": len(accesses),
        "accesses per member": dict(sorted(accesses.items())),
        "accesses per module": dict(sorted(by_module.items())),
        "LaplaceGuide methods": len(methods),
        "methods that only pass a call on": len(forwarders),
        "those methods": forwarders,
        "methods that hand the guide to another module": len(handing),
        "the methods handing it": handing,
    }


def _methods() -> tuple[list[str], list[str], list[str]]:
    tree = ast.parse(GUIDE.read_text())
    imported = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            imported.update(alias.asname or alias.name for alias in node.names)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "LaplaceGuide")
    methods = [n for n in cls.body if isinstance(n, ast.FunctionDef)]
    forwarders = [_label(method) for method in methods if _only_passes_on(method, imported)]
    handing = [_label(method) for method in methods if _hands_self(method, imported)]
    return [_label(method) for method in methods], forwarders, handing


def _hands_self(method: ast.FunctionDef, imported: set[str]) -> bool:
    """Whether the method calls a function of another module with ``self`` as an argument."""
    return any(
        _foreign_call(node, imported)
        and any(isinstance(arg, ast.Name) and arg.id == "self" for arg in node.args)
        for node in ast.walk(method)
    )


def _label(method: ast.FunctionDef) -> str:
    setter = any(isinstance(d, ast.Attribute) and d.attr == "setter" for d in method.decorator_list)
    return method.name + (" (setter)" if setter else "")


def _is_guard(statement: ast.stmt) -> bool:
    return (
        isinstance(statement, ast.Expr)
        and isinstance(statement.value, ast.Call)
        and isinstance(statement.value.func, ast.Attribute)
        and isinstance(statement.value.func.value, ast.Name)
        and statement.value.func.value.id == "self"
        and statement.value.func.attr in ("_check_fitted", "_require_structure")
    )


def _foreign_call(node: ast.AST, imported: set[str]) -> bool:
    """A call of a function imported from another module (``f(...)`` or ``module.f(...)``)."""
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    if isinstance(func, ast.Name):
        return func.id in imported
    return (
        isinstance(func, ast.Attribute)
        and isinstance(func.value, ast.Name)
        and func.value.id in imported
    )


def _only_passes_on(method: ast.FunctionDef, imported: set[str]) -> bool:
    body = list(method.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    body = [statement for statement in body if not _is_guard(statement)]
    if body and isinstance(body[-1], ast.Return):
        value = body[-1].value
        if isinstance(value, ast.Name) and value.id == "self":
            body = body[:-1]
    calls = [
        statement.value
        for statement in body
        if isinstance(statement, (ast.Expr, ast.Return, ast.Assign))
    ]
    if len(calls) != len(body) or not calls:
        return False
    # every statement a call; exactly one of them into another module, the others the
    # guide's own (an argument prepared by self._resolve(...), say)
    foreign = [call for call in calls if _foreign_call(call, imported)]
    own = [
        call
        for call in calls
        if isinstance(call, ast.Call)
        and isinstance(call.func, ast.Attribute)
        and isinstance(call.func.value, ast.Name)
        and call.func.value.id == "self"
    ]
    return len(foreign) == 1 and len(foreign) + len(own) == len(calls)


# -- the walk ---------------------------------------------------------------------------


def walk() -> dict:
    """Trace ``lora_model`` -> ``LaplaceGuide.fit`` -> ``predictive`` on a tiny Llama."""
    import warnings

    import torch
    from torch.utils.data import DataLoader

    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import tiny_llama

    import pyro_bdl as bdl
    from pyro_bdl.inference import LaplaceGuide
    from pyro_bdl.models import lora_model

    base = tiny_llama(0, torch.float64, vocab_size=23, bos_token_id=1, eos_token_id=2)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(6, 23, (16, 6), generator=generator)
    examples = [
        {"input_ids": row, "attention_mask": torch.ones_like(row), "labels": row[0] % 3}
        for row in ids
    ]
    loader = DataLoader(examples, batch_size=8)
    batch = next(iter(loader))

    events: list[tuple[str, str, object]] = []  # (call | return, module, code)
    package = str(PACKAGE)

    def profile(frame, event, _arg):
        if event in ("call", "return") and frame.f_code.co_filename.startswith(package):
            events.append((event, frame.f_code.co_filename, frame.f_code))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sys.setprofile(profile)
        try:
            lora = lora_model(
                base,
                "multiple_choice",
                label_token_ids=[3, 4, 5],
                prior=bdl.priors.LayerwiseNormal.fan_in(),
                rank=2,
            )
            guide = LaplaceGuide(lora.model, curvature="kron")
            guide.fit(loader, 16, map=False, mode_tolerance=None, progress=False)
            guide.predictive(batch, 16)
        finally:
            sys.setprofile(None)
    return _walk_counts(events)


def _walk_counts(events) -> dict:
    """Follow the first run of every function (its subtree), skipping later runs."""
    read: set = set()
    stack: list[tuple[str, bool]] = []  # (module, skipped) per open frame
    path: list[str] = []  # the modules the reader is in, one entry per move
    for event, module, code in events:
        if event == "call":
            skipped = (stack and stack[-1][1]) or code in read
            read.add(code)
            stack.append((module, skipped))
            if not skipped and (not path or path[-1] != module):
                path.append(module)
        elif stack:
            _, skipped = stack.pop()
            if not skipped and stack and path[-1] != stack[-1][0]:
                path.append(stack[-1][0])
    inside = [module for module in path if module.startswith(str(LAPLACE))]
    inside = [m for i, m in enumerate(inside) if i == 0 or inside[i - 1] != m]
    return {
        "functions read": len(read),
        **_moves(path, "whole package"),
        **_moves(inside, "inference/laplace only"),
    }


def _moves(path: list[str], label: str) -> dict:
    seen: set[str] = set()
    back = 0
    for module in path:
        back += module in seen
        seen.add(module)
    modules = sorted(str(Path(m).relative_to(PACKAGE)) for m in seen)
    return {
        label: {
            "modules crossed": len(modules),
            "moves between modules": len(path) - 1,
            "moves to a module already left": back,
            "modules": modules,
        }
    }


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    print(json.dumps({"static": static_counts(), "walk": walk()}, indent=1))
