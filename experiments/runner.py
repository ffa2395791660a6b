"""What every experiment shares: settings, cached cells, ``results.json`` and tables.

An experiment is a grid of *cells* (dataset x method x seed, or whatever its axes
are). Each finished cell is written to ``<out>/cells/<key>.json`` as soon as it is done,
so an interrupted run resumes where it stopped and ``--datasets`` / ``--methods`` can
restrict a run without losing the rest. ``results.json`` gathers every number, the
settings (with the sizes of every subset), the device, the library version and the wall
time; each cell records its own wall and CPU time.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

import pyro_bdl
from pyro_bdl._checks import integer

_logger = logging.getLogger(__name__)

__all__ = ["Experiment", "markdown_table", "mean_sd", "resolve_device", "describe_device"]


@dataclass
class Experiment:
    """The run of one experiment: where it reads and writes, and what it covers.

    :param str name: the experiment's name (``calibration``, ``cold-posterior``, ...).
    :param Path data_dir: the directory holding the datasets.
    :param Path out: the output directory.
    :param bool quick: the CI-sized version (finishes in under two minutes).
    :param seeds: seeds to run.
    :param datasets: restrict to these datasets (None: all).
    :param methods: restrict to these methods (None: all).
    :param str device: where the networks run (``"cpu"``, ``"cuda"``, ``"cuda:1"``); the
        experiments that have them use their full-size settings on a GPU.
    :param int epochs: train every fine-tune for this many epochs instead of the
        experiment's own number (an ablation of the training length; only experiments
        whose module lists ``"epochs"`` in ``OPTIONS`` take it).
    :param str model: a local Hugging Face model directory to use instead of the
        experiment's own network, or ``"smollm2"`` (SmolLM2-135M-Instruct, converted once
        into the Hugging Face cache by :func:`~pyro_bdl.models.smollm2.smollm2_directory`)
        (only experiments whose module lists ``"model"`` in ``OPTIONS`` take it).
    :param dict sizes: override these of the experiment's sizes (only experiments whose
        module lists ``"sizes"`` in ``OPTIONS`` take it; each checks the names).
    """

    name: str
    data_dir: Path
    out: Path
    quick: bool = False
    seeds: Sequence[int] = (0, 1, 2)
    datasets: Sequence[str] | None = None
    methods: Sequence[str] | None = None
    device: str = "cpu"
    epochs: int | None = None
    model: str | None = None
    sizes: dict | None = None
    settings: dict = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)

    def __post_init__(self):
        self.data_dir = Path(self.data_dir)
        self.out = Path(self.out)
        if not self.data_dir.is_dir():
            raise FileNotFoundError(
                f"--data-dir: {self.data_dir} is not a directory; pass the folder that holds "
                "the datasets (e.g. ../shared/data)"
            )
        self.device = resolve_device(self.device)
        if self.epochs is not None:
            self.epochs = integer("--epochs", self.epochs, low=1)
        if self.model == "smollm2":
            from pyro_bdl.models.smollm2 import smollm2_directory

            self.model = str(smollm2_directory())
        if self.model is not None and not Path(self.model).is_dir():
            raise FileNotFoundError(
                f"--model: {self.model} is not a directory; pass a local Hugging Face model "
                "directory (its config.json, weights and tokenizer) or smollm2"
            )
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "cells").mkdir(exist_ok=True)

    @property
    def on_gpu(self) -> bool:
        """Whether the networks run on a GPU (the full-size settings)."""
        return self.device.type == "cuda"

    def selected(self, kind: str, names: Iterable[str]) -> list[str]:
        """The names of ``kind`` ("datasets" or "methods") this run covers, checked."""
        names = list(names)
        chosen = getattr(self, kind)
        if chosen is None:
            return names
        unknown = sorted(set(chosen) - set(names))
        if unknown:
            raise ValueError(f"--{kind}: {unknown} are not among {names}")
        return [name for name in names if name in chosen]

    def cell(self, key: Sequence, compute: Callable[[], dict]) -> dict:
        """The result of one cell, computed once and cached on disk.

        :param key: the cell's coordinates, e.g. ``("sst2", "MAP", 0)``.
        :param compute: returns a JSON-serialisable dict of the cell's numbers.
        """
        path = self.out / "cells" / (_slug("__".join(map(str, key))) + ".json")
        where = f"{self.name} {' '.join(map(str, key))}"
        if path.exists():
            result = json.loads(path.read_text())
            _logger.info("%s: %s (read back from %s)", where, _times(result), path)
            return result
        started, cpu_started = time.perf_counter(), time.process_time()
        result = compute()
        result = {
            **result,
            "wall_time_s": time.perf_counter() - started,
            "cpu_time_s": time.process_time() - cpu_started,
        }
        text = json.dumps(_plain(result), indent=1)
        partial = path.with_suffix(".tmp")
        partial.write_text(text)
        partial.replace(path)
        _logger.info("%s: %s", where, _times(result))
        # What a resumed run reads back, so that both runs compute the same from it.
        return json.loads(text)

    def write_results(self, results: dict) -> Path:
        """Write ``results.json``: the numbers, settings, version and wall time."""
        payload = {
            "experiment": self.name,
            "quick": self.quick,
            "seeds": list(self.seeds),
            "settings": self.settings,
            "results": results,
            "library_version": pyro_bdl.__version__,
            "torch_version": torch.__version__,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "device": describe_device(self.device),
            "wall_time_s": time.perf_counter() - self.started,
        }
        path = self.out / "results.json"
        path.write_text(json.dumps(_plain(payload), indent=2))
        return path


def _times(cell: dict) -> str:
    cpu = cell.get("cpu_time_s")  # cells cached before it was recorded lack it
    return f"{cell['wall_time_s']:.0f} s" + ("" if cpu is None else f", {cpu:.0f} CPU s")


def resolve_device(device: str | torch.device) -> torch.device:
    """``device`` as a ``torch.device``, checked to exist on this machine."""
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(
            f"--device must name a torch device (cpu, cuda, cuda:1), got {device!r}"
        ) from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: no CUDA device is available here; use --device cpu")
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu or cuda, got {device!r}")
    return resolved


def describe_device(device: torch.device) -> str:
    """The device in words, for the reports: the GPU's name, or the CPU's cores."""
    if device.type == "cuda":
        return f"{device}: {torch.cuda.get_device_name(device)}"
    return f"cpu: {platform.machine()}, {os.cpu_count()} cores"


def mean_sd(values: Sequence[float]) -> dict[str, float]:
    """Mean and standard deviation (ddof 1; 0 for a single seed) of per-seed values."""
    array = np.asarray(values, dtype=float)
    sd = float(array.std(ddof=1)) if len(array) > 1 else 0.0
    return {"mean": float(array.mean()), "sd": sd}


def markdown_table(rows: Sequence[dict], columns: Sequence[str]) -> str:
    """A markdown table of ``rows`` (dicts) with the given columns, numbers to 3 decimals."""

    def show(value) -> str:
        if isinstance(value, dict) and {"mean", "sd"} <= set(value):
            return f"{value['mean']:.3f} ± {value['sd']:.3f}"
        if isinstance(value, float):
            return f"{value:.3f}"
        return str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(show(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]+", "-", text)


def _plain(value):
    """JSON-serialisable copy: tensors and numpy values become lists and numbers."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if torch.is_tensor(value):
        return value.detach().cpu().tolist()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value
