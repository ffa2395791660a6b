"""Fixtures of both tiers: ``tests/`` (``make test``) and ``validation/`` (``make validate``)."""

import logging
import os
import sys
from pathlib import Path

import pyro
import pytest
import torch

# Tests never download, whatever the environment says (the library itself goes online as
# from_pretrained does); huggingface_hub reads the variable once, when first imported.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Each test process gets its share of the cores. Torch's default, every core in every
# process, oversubscribes them under xdist (and beside other work), and its small ops then
# wait on each other's spinning OpenMP threads: SGHMC's 3,000 steps on a 9-parameter
# regression took 57 s with two threads on a busy 2-core machine against 6 s with one.
# The environment variable reaches the processes that tests start (torchrun, spawn).
_THREADS = max(
    1, len(os.sched_getaffinity(0)) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
)
os.environ["OMP_NUM_THREADS"] = str(_THREADS)
torch.set_num_threads(_THREADS)

ROOT = Path(__file__).resolve().parent
SHARED_DATA = ROOT.parent / "shared" / "data"

# The models ported from Pyro's examples (tests/pyro_models.py), importable by every test
# module as ``pyro_models`` (tests are imported with --import-mode=importlib).
sys.path.insert(0, str(ROOT / "tests"))


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    """Every test runs with the Hub off, even one that changed the variable or imported
    huggingface_hub before it was set (the Hub keeps its reading as a constant)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None:
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


@pytest.fixture(autouse=True)
def _loggers():
    """The pyro_bdl and experiments loggers as a test found them, restored after (the
    commands configure them: level, a stderr handler, no propagation)."""
    loggers = [logging.getLogger(name) for name in ("pyro_bdl", "experiments")]
    saved = [(logger.level, list(logger.handlers), logger.propagate) for logger in loggers]
    yield
    for logger, (level, handlers, propagate) in zip(loggers, saved):
        logger.setLevel(level)
        logger.handlers[:] = handlers
        logger.propagate = propagate


@pytest.fixture(autouse=True)
def _clear_param_store():
    pyro.clear_param_store()
    yield
    pyro.clear_param_store()


@pytest.fixture
def float64():
    """Make float64 the default dtype for one test (its references are float64)."""
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(dtype)


@pytest.fixture
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"the shared datasets are not at {SHARED_DATA}")
    return SHARED_DATA
