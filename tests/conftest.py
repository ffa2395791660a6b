import os
from pathlib import Path

import pyro
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(autouse=True)
def _clear_param_store():
    pyro.clear_param_store()
    yield
    pyro.clear_param_store()


@pytest.fixture
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"the shared datasets are not at {SHARED_DATA}")
    return SHARED_DATA
