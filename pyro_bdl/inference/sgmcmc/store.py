"""A chain's kept draws on disk: a chunked zarr array store that xarray opens lazily.

Layout of one chain's store (a zarr v3 group)::

    draws.zarr/
        posterior/<site>       (chain=1, draw, *site_shape), the constrained draws
        posterior/chain, draw  the coordinates: this chain's number, 0 .. num_draws - 1
        sample_stats/<stat>    (chain=1, draw), the kernel's statistics per kept draw
        sample_stats/chain, draw

Draws are appended in chunks of ``draws_per_chunk`` draws (a memory budget divided by
the bytes of one draw), each chunk one file per site (a zarr shard) cut into inner chunks
of about 256 kB along the site's coordinates, so that a reader streaming a block of
coordinates over all draws (R-hat, ESS) reads only that block. Until a chunk is full its
draws wait in memory; :meth:`DrawStore.flush` writes them (the checkpoint flushes before
it saves the chain's state, so draws on disk are never ahead of a state that knows them).

Chains are separate stores (one per rank's chain, on any node); :func:`open_tree` merges
them by their ``chain`` coordinate into one dask-backed ``DataTree`` without copying.

Only zarr format 3 is read: its arrays hold plain numbers, while format 2 can declare an
object array decoded by pickle, and unpickling runs code.

We write zarr directly rather than through ``xarray.Dataset.to_zarr(append_dim=...)``:
xarray re-validates and rewrites the coordinates on every append, several times the cost
of appending a small draw.
"""

from __future__ import annotations

import json
import math
import shutil
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    # Every SGMCMC kernel imports this module; zarr and xarray (with pandas) load when a
    # store is first written or opened, so that `import pyro_bdl.inference` stays light.
    import xarray as xr
    import zarr

__all__ = ["DrawStore", "open_tree", "chain_directories"]

#: Memory a chain's unwritten draws may take before they are written as one chunk.
BUFFER_BYTES = 64 * 2**20
#: At most this many draws per chunk, however small a draw is.
MAX_DRAWS_PER_CHUNK = 256
#: Target size of an inner chunk (what a reader of a block of coordinates reads at once).
INNER_CHUNK_BYTES = 256 * 2**10
GROUPS = ("posterior", "sample_stats")
_FORMAT = 3
_RESERVED = {"chain", "draw"}


class DrawStore:
    """The kept draws and statistics of one chain, appended as chunks to a zarr group.

    Example::

        store = DrawStore(path, chain=0)
        store.append({"w": w}, {"potential_energy": 3.2})
        if store.chunk_is_full:
            store.flush()
        store.read(0, len(store))["w"]          # (num_draws, *shape)

    :param Path path: the ``draws.zarr`` directory (created on the first append).
    :param int chain: the chain's number, its ``chain`` coordinate.
    :param int buffer_bytes: memory the unwritten draws may take.
    """

    def __init__(self, path: Path, chain: int, buffer_bytes: int = BUFFER_BYTES):
        self.path = Path(path)
        self.chain = chain
        self.buffer_bytes = buffer_bytes
        self._group = _open_group(self.path) if (self.path / "zarr.json").exists() else None
        self._buffer: list[tuple[dict[str, np.ndarray], dict[str, float]]] = []

    # -- sizes ---------------------------------------------------------------------------

    @property
    def num_written(self) -> int:
        """Draws on disk."""
        return 0 if self._group is None else int(self._group["posterior/draw"].shape[0])

    def __len__(self) -> int:
        return self.num_written + len(self._buffer)

    @property
    def draws_per_chunk(self) -> int:
        """Draws written together (one shard per site)."""
        if self._group is not None:
            return int(next(iter(self._arrays("posterior").values())).shards[1])
        return _draws_per_chunk(self._buffer[0][0] if self._buffer else {}, self.buffer_bytes)

    # -- writing -------------------------------------------------------------------------

    @property
    def chunk_is_full(self) -> bool:
        """Whether the draws waiting in memory fill a chunk (time to :meth:`flush`)."""
        return len(self._buffer) >= self.draws_per_chunk

    def append(self, draw: Mapping[str, torch.Tensor], stats: Mapping[str, float]) -> None:
        """Keep one draw (site -> constrained value) and its statistics, in memory."""
        values = {name: _numpy(value) for name, value in draw.items()}
        self._buffer.append((values, {key: float(stat) for key, stat in stats.items()}))

    def flush(self) -> None:
        """Write the draws waiting in memory."""
        if not self._buffer:
            return
        if self._group is None:
            self._create(*self._buffer[0])
        start, count = self.num_written, len(self._buffer)
        stop = start + count
        columns = {
            "posterior": {
                name: np.stack([draw[name] for draw, _ in self._buffer])
                for name in self._buffer[0][0]
            },
            "sample_stats": {
                key: np.asarray([stats[key] for _, stats in self._buffer], dtype=np.float64)
                for key in self._buffer[0][1]
            },
        }
        for group, values in columns.items():
            arrays = self._arrays(group)
            missing = sorted(set(values) ^ set(arrays))
            if missing:
                raise ValueError(
                    f"store {self.path}: the draws' {group} names changed ({missing}); "
                    "use a new checkpoint directory for a different model or kernel"
                )
            for name, value in values.items():
                array = arrays[name]
                array.resize((1, stop, *array.shape[2:]))
                array[:, start:stop] = value[np.newaxis]
        # The draw coordinates grow last: a store killed mid-write shows only whole draws.
        for group in GROUPS:
            coordinate = self._group[f"{group}/draw"]
            coordinate.resize((stop,))
            coordinate[start:stop] = np.arange(start, stop)
        self._buffer = []

    def truncate(self, num_draws: int) -> None:
        """Drop every draw from ``num_draws`` on (those a saved state does not know)."""
        self._buffer = []
        if num_draws == 0:
            # No saved state knows any draw: the store may be one that a process killed
            # while creating it left without some of its arrays. It is made afresh, with
            # the names of the draws, at the next flush.
            self._group = None
            shutil.rmtree(self.path, ignore_errors=True)
            return
        if self._group is None or self.num_written <= num_draws:
            return
        for group in GROUPS:
            for array in self._arrays(group).values():
                array.resize((1, num_draws, *array.shape[2:]))
            self._group[f"{group}/draw"].resize((num_draws,))

    def _create(self, draw: dict[str, np.ndarray], stats: dict[str, float]) -> None:
        for name in [*draw, *stats]:
            if "/" in name or name in _RESERVED or name.startswith("__"):
                raise ValueError(
                    f"store: a site or statistic named {name!r} cannot be stored (no '/', not "
                    "'chain' or 'draw', no leading '__'); rename the site"
                )
        import zarr

        per_chunk = _draws_per_chunk(draw, self.buffer_bytes)
        root = zarr.open_group(self.path, mode="w", zarr_format=_FORMAT)
        for group, variables in (
            ("posterior", {name: (value.shape, value.dtype) for name, value in draw.items()}),
            ("sample_stats", {key: ((), np.dtype(np.float64)) for key in stats}),
        ):
            node = root.create_group(group)
            chain = node.create_array("chain", shape=(1,), dtype="int64", dimension_names=["chain"])
            chain[:] = [self.chain]
            node.create_array(
                "draw", shape=(0,), chunks=(4096,), dtype="int64", dimension_names=["draw"]
            )
            for name, (shape, dtype) in variables.items():
                inner = _inner_chunks(shape, dtype.itemsize * per_chunk)
                node.create_array(
                    name,
                    shape=(1, 0, *shape),
                    chunks=(1, per_chunk, *inner),
                    shards=(1, per_chunk, *(math.ceil(s / c) * c for s, c in zip(shape, inner))),
                    dtype=dtype,
                    fill_value=0,
                    compressors=None,  # network weights are noise to a compressor
                    dimension_names=["chain", "draw", *_site_dims(name, len(shape))],
                )
        self._group = root

    # -- reading -------------------------------------------------------------------------

    def read(self, start: int, stop: int) -> dict[str, torch.Tensor]:
        """Draws ``start`` to ``stop`` (on disk or waiting in memory), site -> tensor."""
        written = self.num_written
        parts: dict[str, list[np.ndarray]] = {}
        if start < written:
            for name, array in self._arrays("posterior").items():
                parts.setdefault(name, []).append(array[0, start : min(stop, written)])
        buffered = self._buffer[max(0, start - written) : max(0, stop - written)]
        for draw, _ in buffered:
            for name, value in draw.items():
                parts.setdefault(name, []).append(value[np.newaxis])
        return {name: torch.from_numpy(np.concatenate(values)) for name, values in parts.items()}

    def stats(self, stop: int | None = None) -> dict[str, list[float]]:
        """The statistics of the first ``stop`` draws (all by default), name -> list."""
        stop = len(self) if stop is None else stop
        result = {}
        if self._group is not None:
            for key, array in self._arrays("sample_stats").items():
                result[key] = array[0, : min(stop, self.num_written)].tolist()
        for _, stats in self._buffer[: max(0, stop - self.num_written)]:
            for key, value in stats.items():
                result.setdefault(key, []).append(value)
        return result

    def _arrays(self, group: str) -> dict[str, zarr.Array]:
        node = self._group[group]
        return {name: array for name, array in node.arrays() if name not in _RESERVED}


def _draws_per_chunk(draw: Mapping[str, np.ndarray], buffer_bytes: int) -> int:
    draw_bytes = sum(value.nbytes for value in draw.values()) or 1
    return max(1, min(MAX_DRAWS_PER_CHUNK, buffer_bytes // draw_bytes))


def _numpy(value: torch.Tensor) -> np.ndarray:
    value = value.detach().cpu()
    if value.dtype == torch.bfloat16:  # neither numpy nor zarr has bfloat16
        value = value.float()
    return value.numpy().copy()


def _site_dims(name: str, ndim: int) -> list[str]:
    # ArviZ's default names, as bdl.to_arviz gives a chain held in memory.
    return [f"{name}_dim_{i}" for i in range(ndim)]


def _inner_chunks(shape: Sequence[int], bytes_per_entry: int) -> tuple[int, ...]:
    """A chunk of the site's coordinates of about ``INNER_CHUNK_BYTES`` over all its draws.

    Trailing dimensions are kept whole while they fit; the first that does not is cut,
    and the dimensions before it are taken one index at a time.
    """
    budget = max(1, INNER_CHUNK_BYTES // max(1, bytes_per_entry))
    chunks = [1] * len(shape)
    for axis in reversed(range(len(shape))):
        chunks[axis] = max(1, min(shape[axis], budget))
        if chunks[axis] < shape[axis]:
            break
        budget //= max(1, shape[axis])
    return tuple(chunks)


def _open_group(path: Path) -> zarr.Group:
    import zarr

    _refuse_unsafe(path)
    return zarr.open_group(path, mode="r+", zarr_format=_FORMAT)


def _refuse_unsafe(path: Path) -> None:
    """Refuse a store that is not zarr format 3 of plain numbers (see the module docstring)."""
    path = Path(path)
    legacy = [p.name for p in path.rglob("*") if p.name in (".zarray", ".zgroup", ".zattrs")]
    if legacy or not (path / "zarr.json").exists():
        raise ValueError(
            f"store {path} is not a zarr format 3 store (found {legacy[:3] or 'no zarr.json'}); "
            "pyro_bdl reads only format 3, whose arrays hold plain numbers: format 2 may "
            "declare arrays decoded by pickle, which runs code"
        )
    for meta in path.rglob("zarr.json"):
        node = json.loads(meta.read_text())
        dtype = node.get("data_type")
        if node.get("node_type") == "array" and not (
            isinstance(dtype, str) and (np.dtype(dtype).kind in "biuf")
        ):
            raise ValueError(f"store {meta.parent}: data type {dtype!r} is not a plain number")


# -- opening stores as one DataTree ---------------------------------------------------------


def chain_directories(path: str | Path) -> list[Path]:
    """The chain directories of a checkpoint (``chain_<c>``), or ``path`` if it is one."""
    path = Path(path)
    if (path / "draws.zarr").exists():
        return [path]
    found = sorted(
        (p for p in path.glob("chain_*") if (p / "draws.zarr").exists()),
        key=lambda p: int(p.name.removeprefix("chain_")),
    )
    if not found:
        raise FileNotFoundError(
            f"{path} holds no chain store (chain_<c>/draws.zarr); pass the kernel's "
            "checkpoint directory or one chain's directory"
        )
    return found


def open_tree(path: str | Path, num_draws: Mapping[Path, int] | None = None) -> xr.DataTree:
    """Every chain store under ``path`` as one lazy (dask-backed) ``DataTree``.

    The chains are combined by their ``chain`` coordinate; each is cut to ``num_draws``
    (what its saved state knows, by default all written draws) and all to the shortest,
    with a warning if they differ. Nothing is read but metadata until values are used.

    :param path: a checkpoint directory (``chain_<c>/draws.zarr`` below it) or a chain's.
    :param dict num_draws: chain directory -> draws to keep.
    """
    import xarray as xr

    chains = []
    for directory in chain_directories(path):
        store = directory / "draws.zarr"
        _refuse_unsafe(store)
        tree = xr.open_datatree(
            store, engine="zarr", zarr_format=_FORMAT, consolidated=False, chunks={}
        )
        keep = slice(0, (num_draws or {}).get(directory))
        chains.append({group: tree[group].to_dataset().isel(draw=keep) for group in GROUPS})
    lengths = [chain["posterior"].sizes["draw"] for chain in chains]
    shortest = min(lengths)
    if len(set(lengths)) > 1:
        warnings.warn(
            f"the chains under {path} hold different numbers of draws {lengths} (a run still "
            f"going or stopped early); using the first {shortest} of each",
            stacklevel=3,
        )
    groups = {}
    for group in GROUPS:
        datasets = [chain[group].isel(draw=slice(0, shortest)) for chain in chains]
        combined = xr.combine_by_coords(datasets, combine_attrs="drop_conflicts")
        groups[group] = combined.assign_coords(
            {
                dim: np.arange(size)
                for dim, size in combined.sizes.items()
                if dim not in combined.coords
            }
        )
    return xr.DataTree.from_dict(groups)
