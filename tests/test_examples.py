"""Every example compiles and takes ``--quick`` (their runs, 20 s to minutes each, are
checks of the validation tier: ``validation/test_examples.py``)."""

from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.py")), ids=lambda path: path.stem)
def test_example_compiles_and_has_a_quick_mode(path):
    source = path.read_text()
    compile(source, str(path), "exec")  # a SyntaxError names the file and line
    assert '"--quick"' in source, f"{path.name} has no --quick flag for its smoke run"
