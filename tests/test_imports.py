"""``import pyro_bdl`` and the inference modules load no LLM stack (transformers, peft) and
none of the export stack (ArviZ, xarray, zarr, matplotlib): they load on first use."""

import json
import subprocess
import sys

HEAVY = ("transformers", "peft", "arviz_base", "xarray", "zarr", "matplotlib", "scipy.stats")

# Run in this order in one fresh interpreter; modules only accumulate, so what is absent
# after a statement was absent after each statement before it.
LIGHT = (
    "import pyro_bdl",
    "from pyro_bdl.inference import SGHMC, LaplaceGuide, BLoBGuide, IVONGuide",
    "import pyro_bdl.inference.baselines, pyro_bdl.persistence, pyro_bdl.predict",
    "import pyro_bdl.metrics, pyro_bdl.diagnostics, pyro_bdl.cli",
    "pyro_bdl.lm",  # causal-LM uncertainty: imports transformers only when called
)
# What must still load them when asked for: proof that the check sees a module import.
ON_USE = (
    ("pyro_bdl.to_arviz", ("arviz_base", "xarray")),
    ("pyro_bdl.models.lora_model", ("transformers", "peft")),
    ("import pyro_bdl.hf", ("transformers", "peft")),
)


def _loaded_after_each(statements):
    lines = [f"import sys, json\nheavy = {HEAVY!r}\nloaded = []"]
    for statement in statements:
        lines.append(statement)
        lines.append("loaded.append(sorted(m for m in heavy if m in sys.modules))")
    lines.append("print(json.dumps(loaded))")
    done = subprocess.run(
        [sys.executable, "-c", "\n".join(lines)], capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.splitlines()[-1])


def test_light_imports_then_heavy_ones_on_first_use():
    statements = [*LIGHT, *(f"import pyro_bdl\n{name}" for name, _ in ON_USE)]
    loaded = _loaded_after_each(statements)
    for statement, modules in zip(LIGHT, loaded):
        assert modules == [], f"{statement!r} imported {modules}"
    for (name, expected), modules in zip(ON_USE, loaded[len(LIGHT) :]):
        assert set(expected) <= set(modules), f"{name} did not import {expected}"
