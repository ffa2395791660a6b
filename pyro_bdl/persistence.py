"""Keep a fitted posterior: ``bdl.save(posterior, directory)``, ``bdl.load(directory, model)``.

A K-FAC Laplace fit of a 7B LoRA model costs about an epoch; these keep it beyond the
process. What is saved:

* a guide (:class:`~pyro_bdl.inference.LaplaceGuide` with any curvature,
  :class:`~pyro_bdl.inference.MeanFieldGuide`, :class:`~pyro_bdl.inference.BLoBGuide`,
  :class:`~pyro_bdl.inference.IVONGuide`): its ``state_dict()``, which carries the whole
  approximation (see :mod:`pyro_bdl.inference.guide_state`), and the values of the
  model's point weights;
* a training run (:class:`~pyro_bdl.inference.IVONSVI`,
  :class:`~pyro_bdl.inference.BLoBSVI`): its guide and its optimiser's state, so that
  training continues step for step (a guide saved alone restarts the optimiser);
* draws (a run ``pyro.infer.MCMC`` or :class:`~pyro_bdl.inference.Chains`): the chunked
  draw store the SGMCMC checkpoints write (``chain_<c>/draws.zarr``), which
  ``bdl.to_arviz(directory)`` opens lazily. It is the one layout of draws on disk:
  :func:`load` also reads a kernel's ``checkpoint`` directory (no manifest: its chains'
  saved states say the settings and how many draws are final), with a warning that its
  files are not verified;
* a baseline's :class:`~pyro_bdl.inference.baselines.Predictor` (MAP, MLE, MC dropout, deep
  ensembles, BBB): its ``state_dict()``, every member's fitted values.

Every result goes through one interface, :class:`~pyro_bdl.posterior.Posterior`: its
``layout`` chooses the writer (``"guide"``, ``"draws"``, ``"members"``; a training run
says ``"training"``), the manifest's ``kind`` the reader; neither switches on classes.

The directory (format version 2)::

    manifest.json              format and version, pyro_bdl's version, the method, its
                               settings, the latent sites' names, shapes, dtypes, supports
                               (the constraint's name and parameters) and prior families,
                               the files with their sizes and SHA-256 (every file of a draw
                               store too), the shapes of the model's arguments
    posterior.safetensors      the guide's state dict (and the optimiser's) as tensors
    adapter_config.json        for a posterior over the LoRA weights of one peft model: a
    adapter_model.safetensors  peft adapter holding the posterior mean (the MAP, M, m), so
                               PeftModel.from_pretrained(base, directory) loads the mean model
    chain_<c>/draws.zarr/      draws (instead of the guide's files)

A predictor's directory holds ``manifest.json`` (kind ``members``, its settings and the
structure of its members) and ``posterior.safetensors`` (its state dict).

Nothing is ever unpickled: tensors are safetensors (a JSON header and raw numbers), the
rest is JSON, draws are zarr format 3 of plain numbers. A directory holding anything that
looks like a pickle is refused before anything is read (:class:`UnsafeFileError`); a
malformed manifest, one from a newer format version, a missing or truncated file are
named errors too.

The files verify themselves: :func:`load` hashes every file the manifest lists before it
reads any, and refuses one whose SHA-256 differs (:class:`CorruptFileError`: a copy cut
short or bit-flipped, bytes changed at the same size), a file in a draw store the manifest
does not list, and a version 2 manifest without a file's hash; no switch skips this. It
costs one read of the files: hashing the 151 MB of a 7B LoRA posterior (Llama-2-7B, LoRA
r 8 on q and v, K-FAC, ``benchmarks/persistence.py``'s arithmetic) took 0.47 s to 1.4 s on
one core of the shared 2-core test machine under a load of 18 to 24 (110 to 320 MB/s;
an idle core with SHA instructions hashes above 1 GB/s), against the seconds of reading the
7B base model itself; for MiniLM it is 0.08 s, 0.9 % of the load. The hashes detect
corruption and mix-ups, not a forger, who can rewrite the manifest too. Directories of
format version 1 (before the hashes) load with a warning that they are not verified.

Loading runs the model once, as a guide's first call does, to rebuild what is derived
from it (the sites' shapes, BLoB's flipout hooks, where its weights live) and checks its
latent sites against the saved ones (:class:`SiteMismatchError` lists those that differ,
with both shapes; :class:`SupportMismatchError` those of the same shape whose support or
prior family differs, such as ``sigma ~ Uniform(0, 10)`` where ``HalfNormal`` was fitted,
whose saved unconstrained values would mean other numbers). The run needs the model's
arguments; the manifest keeps their shapes and dtypes (never their values), and the run
uses zeros of those shapes, as the
``dummy_inputs`` of ``transformers`` do. A model that cannot run on them (saving checks)
needs ``model_args`` at load.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import pyro
import torch
from pyro.distributions import constraints
from pyro.poutine.util import site_is_subsample
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from pyro_bdl._checks import function, instance
from pyro_bdl.inference.baselines import Predictor
from pyro_bdl.inference.guide_state import (
    SiteMismatchError,
    as_json,
    check_sites,
    dtype_from_name,
    dtype_name,
)
from pyro_bdl.inference.laplace import LaplaceGuide
from pyro_bdl.inference.sgmcmc.chains import Chains
from pyro_bdl.inference.sgmcmc.checkpoint import read_state
from pyro_bdl.inference.sgmcmc.schedules import Constant, RobbinsMonro
from pyro_bdl.inference.sgmcmc.store import DrawStore, chain_directories
from pyro_bdl.inference.sites import prior_family
from pyro_bdl.inference.vi import (
    IVONSVI,
    BLoBGuide,
    BLoBSVI,
    IVONGuide,
    MeanFieldGuide,
)
from pyro_bdl.lift import recording_calls
from pyro_bdl.posterior import STATE_KEY, as_posterior, decode_json, encode_json

__all__ = [
    "save",
    "load",
    "SavedChains",
    "PosteriorFileError",
    "UnsafeFileError",
    "ManifestError",
    "FormatVersionError",
    "CorruptFileError",
    "SiteMismatchError",
    "SupportMismatchError",
]

FORMAT = "pyro_bdl.posterior"
FORMAT_VERSION = 2
#: The first format whose manifest records each file's SHA-256 and each site's support and
#: prior family (version 1 directories load with a warning that they are not verified).
VERIFIED_FORMAT = 2
MANIFEST = "manifest.json"
TENSORS = "posterior.safetensors"
_GUIDES = {cls.__name__: cls for cls in (LaplaceGuide, MeanFieldGuide, IVONGuide, BLoBGuide)}
_TRAINING = {cls.__name__: cls for cls in (IVONSVI, BLoBSVI)}
_MEMBERS = {"Predictor": Predictor}
_SCHEDULES = {"Constant": Constant, "RobbinsMonro": RobbinsMonro}
# Files that hold (or may hold) pickles: PyTorch's .pt/.bin, pickle, joblib, Lightning.
_PICKLE_SUFFIXES = {".pt", ".pth", ".bin", ".pkl", ".pickle", ".ckpt", ".joblib", ".dill"}


class PosteriorFileError(ValueError):
    """A directory that is not a posterior ``bdl.load`` can read safely."""


class UnsafeFileError(PosteriorFileError):
    """The directory holds a file that looks like a pickle; nothing is read from it."""


class ManifestError(PosteriorFileError):
    """``manifest.json`` is missing, not JSON, or lacks what it must say."""


class FormatVersionError(ManifestError):
    """The directory was written by a newer pyro_bdl, in a format this one cannot read."""


class CorruptFileError(PosteriorFileError):
    """A file the manifest lists is missing, truncated, changed (its SHA-256 differs) or not
    what it should be."""


class SupportMismatchError(SiteMismatchError):
    """The model's latent sites have the saved names and shapes but another support or
    another prior family (``sigma ~ Uniform(0, 10)`` where ``HalfNormal`` was fitted).

    :ivar dict differences: site -> (saved description, the model's description).
    """


# -- save ------------------------------------------------------------------------------------


def save(posterior, directory: str | os.PathLike) -> Path:
    """Write a fitted posterior to ``directory`` (created if needed); :func:`load` reads it.

    Any method's result goes through one interface (:class:`~pyro_bdl.posterior.Posterior`),
    whose ``layout`` says how it is written: a guide's ``state_dict()`` as safetensors, a
    run's draws as one chunked store per chain (the layout of a kernel's checkpoint), a
    predictor's fitted members as safetensors.

    Example::

        guide = LaplaceGuide(lora.model, curvature="kron").fit(train_loader, num_data)
        guide.optimize_prior_precision()
        bdl.save(guide, "posterior")                  # also a peft adapter directory
        ...                                           # another process, another day
        guide = bdl.load("posterior", lora.model)
        probs = guide.predictive(test_batch, num_data)

    :param posterior: a fitted guide (:class:`~pyro_bdl.inference.LaplaceGuide` with any
        curvature, :class:`~pyro_bdl.inference.MeanFieldGuide`,
        :class:`~pyro_bdl.inference.BLoBGuide`, :class:`~pyro_bdl.inference.IVONGuide`),
        a training run to resume (:class:`~pyro_bdl.inference.IVONSVI`,
        :class:`~pyro_bdl.inference.BLoBSVI`: the guide and the optimiser's state),
        draws (a run ``pyro.infer.MCMC`` or :class:`~pyro_bdl.inference.Chains`, a
        :class:`~pyro_bdl.posterior.DrawsPosterior`), or a baseline's
        :class:`~pyro_bdl.inference.baselines.Predictor`.
    :param directory: where to write; the files of an earlier save there are replaced.
        Draws need a directory without chain stores.
    :return: the directory.
    """
    instance("directory", directory, (str, os.PathLike), "a directory path")
    directory = Path(directory)
    training = posterior if getattr(posterior, "layout", None) == "training" else None
    try:
        fitted = as_posterior(posterior.guide if training else posterior, caller="save")
    except TypeError:
        raise TypeError(
            "save: posterior must be a fitted guide (LaplaceGuide, MeanFieldGuide, BLoBGuide, "
            "IVONGuide), an IVONSVI or BLoBSVI to resume, a run MCMC or Chains, or a "
            f"baselines Predictor; got {type(posterior).__name__}"
        ) from None
    return _WRITERS[fitted.layout](fitted, directory, training)


def _save_guide(guide, directory: Path, training=None) -> Path:
    state = guide.state_dict()
    header = decode_json(state.pop(STATE_KEY))
    if header["sites"] is None:
        raise ValueError(
            f"save: the {header['class']} has not been fitted (it has never seen its model); "
            "fit it, or take a training step, first"
        )
    tensors = {"guide/" + key: value for key, value in state.items()}
    manifest = {
        **_header("guide", header["class"]),
        "sites": _described(header["sites"], _site_fns(guide.prototype_trace)),
        "guide": header,
    }
    curvature = header["settings"].get("curvature")
    if isinstance(curvature, Mapping):  # a Laplace guide's structure, named for readers
        manifest["curvature"] = curvature["curvature"]
    if training is not None:
        skeleton, extra = _encode(training.state_dict(), _keep_tensor)
        tensors.update({"training/" + key: value for key, value in extra.items()})
        manifest["training"] = {
            "class": type(training).__name__,
            "settings": _training_settings(training),
            "state": skeleton,
        }
    example, nets = _model_example(guide, header["sites"])
    manifest["example"] = example
    directory.mkdir(parents=True, exist_ok=True)
    _remove_previous(directory)
    _write_tensors(directory / TENSORS, tensors)
    written = [TENSORS, *_write_adapter(directory, guide, nets)]
    manifest["files"] = {name: _file_entry(directory / name) for name in written}
    _write_json(directory / MANIFEST, manifest)
    return directory


def _save_members(predictor, directory: Path, training=None) -> Path:
    """A predictor's fitted members: its state dict as safetensors, its structure as JSON."""
    state = predictor.state_dict()
    header = decode_json(state.pop(STATE_KEY))
    # The sites are those of the members' weights (a guide member's mean stands for it).
    drawn = predictor.draws(0).samples
    manifest = {
        **_header("members", type(predictor).__name__),
        "settings": as_json(predictor.hyperparameters()),
        "sites": {
            name: {"shape": list(value.shape[2:]), "dtype": dtype_name(value.dtype)}
            for name, value in drawn.items()
        },
        "state": header,
    }
    directory.mkdir(parents=True, exist_ok=True)
    _remove_previous(directory)
    _write_tensors(directory / TENSORS, state)
    manifest["files"] = {TENSORS: _file_entry(directory / TENSORS)}
    _write_json(directory / MANIFEST, manifest)
    return directory


def _header(kind: str, method: str) -> dict:
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "library_version": _version(),
        "kind": kind,
        "method": method,
    }


def _model_example(guide, sites: dict) -> tuple[dict | None, list]:
    """The shapes of the model's arguments (if the model runs on zeros of them) and the
    lifted networks it calls."""
    prototype = guide.prototype_trace
    if prototype is None or "_INPUT" not in prototype.nodes:
        return None, []
    args, kwargs = prototype.nodes["_INPUT"]["args"], prototype.nodes["_INPUT"]["kwargs"]
    try:
        example, _ = _encode([list(args), dict(kwargs)], _tensor_shape)
    except TypeError:
        example = None
    if example is not None:
        try:
            trace, nets = _run_model(guide.model, *_placeholders(example, None))
            if _latent_shapes(trace) == {name: entry["shape"] for name, entry in sites.items()}:
                return example, nets
        except Exception:  # noqa: BLE001  a model that cannot run on zeros: no example
            pass
    _, nets = _run_model(guide.model, tuple(args), dict(kwargs))
    return None, nets


def _run_model(model: Callable, args: tuple, kwargs: dict) -> tuple[pyro.poutine.Trace, list]:
    """The trace and the lifted networks of one run, which changes nothing: no gradient, no
    draw of the process's random numbers, no validation of zeros."""
    with (
        torch.no_grad(),
        torch.random.fork_rng(devices=_cuda_devices()),
        pyro.validation_enabled(False),
        recording_calls() as nets,
    ):
        trace = pyro.poutine.block(pyro.poutine.trace(model).get_trace)(*args, **kwargs)
    return trace, nets


def _latent_shapes(trace) -> dict[str, list[int]]:
    return {
        name: list(site["value"].shape)
        for name, site in trace.iter_stochastic_nodes()
        if not site_is_subsample(site)
    }


def _write_adapter(directory: Path, guide, nets: list) -> list[str]:
    """The posterior mean as a peft adapter, when its sites are one peft model's weights;
    the names of the files written."""
    peft = sys.modules.get("peft")  # a peft model exists only if peft was imported
    peft_nets = [net for net in nets if peft is not None and isinstance(net.module, peft.PeftModel)]
    if len(peft_nets) != 1:
        return []
    net = peft_nets[0]
    with net.fixed(guide.median(), strict=False):  # the guide may hold other nets' sites
        net.module.save_pretrained(str(directory))
    return ["adapter_config.json", "adapter_model.safetensors"]


def _save_draws(posterior, directory: Path, training=None) -> Path:
    """Draws as one chunked store per chain (``chain_<c>/draws.zarr``), the layout a
    kernel's checkpoint has; the manifest lists every file of them."""
    drawn = posterior.draws()
    chains = drawn.chain_ids
    taken = [f"chain_{c}" for c in chains if (directory / f"chain_{c}").exists()]
    if taken:
        raise ValueError(
            f"save: {directory} already holds chain stores {taken[:3]}; save draws to a new "
            "directory (a kernel's checkpoint directory is already such a store)"
        )
    num_draws = drawn.num_draws
    for k, chain in enumerate(chains):
        store = DrawStore(directory / f"chain_{chain}" / "draws.zarr", chain)
        for draw in range(num_draws):
            values = {name: value[k, draw] for name, value in drawn.samples.items()}
            stats = {key: float(stat[k, draw]) for key, stat in drawn.sample_stats.items()}
            store.append(values, stats)
            if store.chunk_is_full:
                store.flush()
        store.flush()
    run_keys = ("num_chains", "num_samples", "warmup_steps")
    manifest = {
        **_header("draws", drawn.attrs.get("method", type(posterior).__name__)),
        "settings": as_json({k: v for k, v in drawn.attrs.items() if k not in run_keys}),
        "sites": _described(
            {
                name: {"shape": list(value.shape[2:]), "dtype": dtype_name(value.dtype)}
                for name, value in drawn.samples.items()
            },
            drawn.site_fns,
        ),
        "chains": chains,
        "num_samples": num_draws,
        "warmup_steps": int(drawn.attrs.get("warmup_steps", 0)),
        "files": {
            f"chain_{c}/draws.zarr": _directory_entry(directory / f"chain_{c}" / "draws.zarr")
            for c in chains
        },
    }
    _write_json(directory / MANIFEST, manifest)
    return directory


_WRITERS = {"guide": _save_guide, "draws": _save_draws, "members": _save_members}


# -- load ------------------------------------------------------------------------------------


def load(
    directory: str | os.PathLike,
    model: Callable,
    *,
    model_args: Sequence = (),
    model_kwargs: Mapping | None = None,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
) -> object:
    """Read back what :func:`save` wrote: a guide, a training run or draws, on ``model``.

    A guide comes back ready for ``predictive``, ``Predictive``, ``predict_proba``,
    ``sample_posterior``, ``as_prior``, ``bdl.to_arviz`` and (VI guides) more training; an
    ``IVONSVI`` or ``BLoBSVI`` comes back with its guide and optimiser, its next step the
    one the saved run would have taken; draws come back as
    :class:`~pyro_bdl.persistence.SavedChains`, with the interface of
    :class:`~pyro_bdl.inference.Chains` (from a kernel's checkpoint directory too); a
    predictor comes back as a :class:`~pyro_bdl.inference.baselines.Predictor`.

    The model runs once (on zeros shaped like the arguments it was fitted with, or on
    ``model_args``) to rebuild what derives from it and to check its latent sites against
    the saved ones. Nothing is unpickled.

    Example::

        guide = bdl.load("posterior", lora.model)                  # on the model's device
        guide = bdl.load("posterior", lora.model, device="cpu")    # saved on a GPU
        svi = bdl.load("ivon_run", model)                          # an IVONSVI: resume
        svi.step(batch, num_data)

    :param directory: a directory :func:`save` wrote.
    :param callable model: the Pyro model the posterior was fitted to (the same sites and
        shapes; its network's weights where it is to run).
    :param model_args: the model's arguments for that run (one batch), if the saved
        shapes do not suit it (needed when saving found the model could not run on zeros);
        draws are checked against the model only with them.
    :param dict model_kwargs: keyword arguments likewise.
    :param device: where the posterior's tensors go (default: the device of the model's
        weights, as its run shows; draws: the CPU), and the zeros the model runs on.
    :param dtype: the floating dtype of the posterior's tensors and of those zeros: give
        it to load into a model of another dtype than the saved one (default: the model's
        weights' dtype where they share one, else as saved).
    :raises UnsafeFileError: a file in the directory looks like a pickle.
    :raises ManifestError: no manifest, or a malformed one
        (:class:`~pyro_bdl.persistence.FormatVersionError`: written by a newer pyro_bdl).
    :raises CorruptFileError: a listed file is missing, truncated or changed (its SHA-256
        is not the manifest's).
    :raises SiteMismatchError: the model's latent sites differ from the saved ones
        (:class:`~pyro_bdl.persistence.SupportMismatchError`: in support or prior family).
    """
    instance("directory", directory, (str, os.PathLike), "a directory path")
    function("model", model, "the Pyro model the posterior was fitted to")
    if isinstance(model_args, (str, bytes)) or not isinstance(model_args, Sequence):
        raise TypeError(f"model_args must be a tuple of the model's arguments, got {model_args!r}")
    if model_kwargs is not None:
        instance("model_kwargs", model_kwargs, Mapping, "a dict of keyword arguments or None")
    if device is not None:
        device = torch.device(instance("device", device, (str, torch.device), "a device"))
    if dtype is not None:
        instance("dtype", dtype, torch.dtype, "a floating torch dtype such as torch.float64")
    directory = Path(directory)
    _refuse_pickles(directory)
    manifest = _read_manifest(directory)
    _check_files(directory, manifest)
    _warn_if_unverified(directory, manifest)
    args = (tuple(model_args), dict(model_kwargs or {}))
    given = bool(model_args or model_kwargs)
    return _READERS[manifest["kind"]](directory, manifest, model, args, given, device, dtype)


def _load_guide(directory, manifest, model, args, given, device, dtype):
    header = manifest["guide"]
    guide = _built(_GUIDES[header["class"]]._from_settings, model, header["settings"])
    if not given:
        if manifest.get("example") is None:
            raise ValueError(
                f"load: {directory} was saved from a model that could not run on zeros "
                "shaped like its arguments; pass one batch of them, "
                "bdl.load(directory, model, model_args=(batch, num_data))"
            )
        args = _placeholders(manifest["example"], device, dtype)
    found = _set_up(guide, *args, placeholders=not given)
    check_sites(
        {name: entry["shape"] for name, entry in header["sites"].items()},
        {name: list(value.shape) for name, value in found.items()},
        "the model",
    )
    _check_support(manifest["sites"], _site_fns(guide.prototype_trace))
    device, dtype = _target(found, device, dtype)
    tensors = _read_tensors(directory / TENSORS)
    state = {key: _convert(value, device, dtype) for key, value in _part(tensors, "guide").items()}
    state[STATE_KEY] = encode_json(header)
    guide.load_state_dict(state, assign=True)
    training = manifest.get("training")
    if training is None:
        return guide
    extra = _part(tensors, "training")
    settings = dict(training["settings"])
    if isinstance(settings.get("schedule"), dict):
        settings["schedule"] = _decode_schedule(settings["schedule"])
    svi = _built(_TRAINING[training["class"]], model, guide, **settings)
    svi.load_state_dict(_decode(training["state"], lambda spec: extra[spec["key"]]))
    return svi


def _load_members(directory, manifest, model, args, given, device, dtype):
    if given:
        _check_model(model, args, manifest["sites"])
    tensors = _read_tensors(directory / TENSORS)
    state = {key: _convert(value, device, dtype) for key, value in tensors.items()}
    state[STATE_KEY] = encode_json(manifest["state"])
    return _MEMBERS[manifest["method"]].from_state_dict(model, state)


def _part(tensors: dict[str, torch.Tensor], part: str) -> dict[str, torch.Tensor]:
    """The tensors saved under ``part/`` (the guide's or the training run's)."""
    start = part + "/"
    return {key[len(start) :]: value for key, value in tensors.items() if key.startswith(start)}


def _built(build: Callable, *args, **settings):
    """``build(*args, **settings)``, or a ManifestError if the settings do not fit it."""
    try:
        return build(*args, **settings)
    except (TypeError, ValueError, KeyError) as error:
        raise ManifestError(
            f"load: the manifest's settings do not build what it names ({type(error).__name__}: "
            f"{error})"
        ) from error


def _set_up(guide, args: tuple, kwargs: dict, placeholders: bool) -> dict[str, torch.Tensor]:
    """Run the guide's set-up (the model's prototype trace); its latent site values."""
    try:
        with (
            torch.no_grad(),
            torch.random.fork_rng(devices=_cuda_devices()),
            pyro.validation_enabled(not placeholders),
        ):
            guide._setup_prototype(*args, **kwargs)
    except Exception as error:
        if not placeholders:
            raise
        raise ValueError(
            f"load: the model did not run on zeros shaped like the arguments it was saved "
            f"with ({type(error).__name__}: {error}); pass one batch of its arguments, "
            "bdl.load(directory, model, model_args=(batch, num_data))"
        ) from error
    return {
        name: site["value"]
        for name, site in guide.prototype_trace.iter_stochastic_nodes()
        if not site_is_subsample(site)
    }


def _target(found: dict[str, torch.Tensor], device, dtype) -> tuple:
    """Device and dtype of the loaded state: as asked, else the model's weights'."""
    devices = {value.device for value in found.values()}
    dtypes = {value.dtype for value in found.values() if value.is_floating_point()}
    if device is None and len(devices) == 1:
        device = devices.pop()
    if dtype is None and len(dtypes) == 1:
        dtype = dtypes.pop()
    return device, dtype


def _convert(value: torch.Tensor, device, dtype) -> torch.Tensor:
    if dtype is not None and value.is_floating_point():
        value = value.to(dtype)
    return value if device is None else value.to(device)


def _load_draws(directory, manifest, model, args, given, device, dtype) -> SavedChains:
    if given:
        _check_model(model, args, manifest["sites"])
    return SavedChains(directory, manifest, model, device, dtype)


def _check_model(model, args: tuple, sites: dict) -> None:
    """The model's latent sites, in one run on ``args``, against the saved ones."""
    trace, _ = _run_model(model, *args)
    check_sites(
        {name: entry["shape"] for name, entry in sites.items()}, _latent_shapes(trace), "the model"
    )
    _check_support(sites, _site_fns(trace))


_READERS = {"guide": _load_guide, "draws": _load_draws, "members": _load_members}


class SavedChains(Chains):
    """Draws of an MCMC or :class:`~pyro_bdl.inference.Chains` run, read back by :func:`load`.

    It has the interface of :class:`~pyro_bdl.inference.Chains` (``get_samples``,
    ``diagnostics``, ``chain_ids``), so ``bdl.to_arviz``, ``Predictive(model,
    posterior_samples=...)`` and :func:`~pyro_bdl.predict.predict_proba` take it; the draws
    are read from the directory's stores when first asked for. It has no kernel to run:
    ``kernel`` holds the model and the saved kernel settings.
    """

    def __init__(self, directory: Path, manifest: dict, model: Callable, device, dtype):
        # Not Chains.__init__: there is nothing to run, so no kernel to check.
        self.directory = Path(directory)
        self.kernel = _SavedKernel(model, manifest["method"], manifest["settings"])
        self.num_samples = manifest["num_samples"]
        self.warmup_steps = manifest["warmup_steps"]
        self.num_chains = len(manifest["chains"])
        self.init_params, self.seed, self.disable_progbar = None, None, True
        self._device, self._dtype = device, dtype
        self._read: dict | None = None

    @property
    def _chains(self) -> dict[int, tuple[dict[str, torch.Tensor], dict]]:
        if self._read is None:
            self._read = {}
            for path in chain_directories(self.directory):
                store = DrawStore(path / "draws.zarr", int(path.name.removeprefix("chain_")))
                # A checkpoint's store may hold a few draws its state does not know yet.
                stop = min(len(store), self.num_samples)
                draws = {
                    name: _convert(value, self._device, self._dtype)
                    for name, value in store.read(0, stop).items()
                }
                self._read[store.chain] = (draws, {"sample_stats": store.stats(stop)})
        return self._read

    def run(self, *args, **kwargs) -> None:
        raise TypeError(
            "SavedChains holds saved draws and cannot run; to continue a chain, run its "
            "kernel with checkpoint=<directory> (it resumes from there)"
        )


class _SavedKernel:
    """What ``bdl.to_arviz`` reads of a kernel: its model and its settings."""

    def __init__(self, model: Callable, method: str, settings: dict):
        self.model = model
        self._settings = {**settings, "method": method}
        self.transforms: dict = {}

    def hyperparameters(self) -> dict:
        return dict(self._settings)


# -- the directory -------------------------------------------------------------------------


def _refuse_pickles(directory: Path) -> None:
    """Refuse a directory holding a file that looks like a pickle (read nothing from it)."""
    if not directory.is_dir():
        raise ManifestError(f"load: {directory} is not a directory")
    for path in _files(directory):
        with path.open("rb") as handle:
            head = handle.read(9)
        if path.suffix.lower() in _PICKLE_SUFFIXES or _looks_pickled(head):
            raise UnsafeFileError(
                f"load: {path} looks like a pickle ({path.suffix or head[:2]!r}); pyro_bdl never "
                "unpickles, since unpickling can run any code, and refuses a directory holding "
                "one: remove it, or load from a directory bdl.save wrote"
            )


def _files(directory: Path):
    """Every file under ``directory`` but inside zarr stores (checked when opened)."""
    for root, dirs, files in os.walk(directory):
        dirs[:] = [name for name in dirs if not name.endswith(".zarr")]
        yield from (Path(root) / name for name in files)


def _looks_pickled(head: bytes) -> bool:
    """Whether a file's first 9 bytes are those of a pickle or of ``torch.save``'s zip.

    A pickle opens with PROTO (0x80) and a protocol number, a zip with PK. A safetensors
    file opens with its header's length, which may start with the same two bytes, and then
    its JSON header, ``{``: that is never taken for a pickle.
    """
    magic = (len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5) or head[:4] == b"PK\x03\x04"
    return magic and head[8:9] != b"{"


def _read_manifest(directory: Path) -> dict:
    path = directory / MANIFEST
    if not path.is_file():
        return _checkpoint_manifest(directory)
    try:
        manifest = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ManifestError(f"load: {path} is not valid JSON ({error})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ManifestError(f"load: {path} is not a pyro_bdl posterior manifest")
    version = manifest.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise ManifestError(f"load: {path} has no integer format_version, got {version!r}")
    if version > FORMAT_VERSION:
        raise FormatVersionError(
            f"load: {directory} was written in format version {version} by pyro_bdl "
            f"{manifest.get('library_version')}; this pyro_bdl ({_version()}) reads versions up "
            f"to {FORMAT_VERSION}: upgrade pyro_bdl"
        )
    _require(manifest, "files", dict, path)
    _require(manifest, "sites", dict, path)
    kind = manifest.get("kind")
    if kind == "draws":
        for key, kind_ in (("chains", list), ("settings", dict), ("method", str)):
            _require(manifest, key, kind_, path)
        for key in ("num_samples", "warmup_steps"):
            _require(manifest, key, int, path)
        return manifest
    if kind == "members":
        for key, kind_ in (("settings", dict), ("state", dict), ("method", str)):
            _require(manifest, key, kind_, path)
        if manifest["method"] not in _MEMBERS:
            raise ManifestError(f"load: {path} holds a {manifest['method']!r}, not a Predictor")
        return manifest
    if kind != "guide":
        raise ManifestError(f"load: {path} has kind {kind!r}, not 'guide', 'draws' or 'members'")
    header = _require(manifest, "guide", dict, path)
    for key, kind_ in (("settings", dict), ("sites", dict), ("state", dict)):
        _require(header, key, kind_, path)
    if header.get("class") not in _GUIDES:
        raise ManifestError(
            f"load: {path} holds a {header.get('class')!r}; this pyro_bdl loads {sorted(_GUIDES)}"
        )
    training = manifest.get("training")
    if training is not None and (
        not isinstance(training, dict) or training.get("class") not in _TRAINING
    ):
        raise ManifestError(f"load: {path} has a malformed 'training' entry")
    return manifest


def _checkpoint_manifest(directory: Path) -> dict:
    """What a manifest would say of a kernel's checkpoint directory (draws in the one layout,
    ``chain_<c>/draws.zarr``, beside each chain's ``state.safetensors``), read from the
    chains' saved states; it lists no files, so nothing is verified."""
    try:
        chains = chain_directories(directory)
    except FileNotFoundError:
        raise ManifestError(
            f"load: {directory} has no {MANIFEST}; it was not written by bdl.save"
        ) from None
    states = [read_state(path / "state.safetensors")[1] for path in chains]
    settings = dict(states[0]["settings"])
    sites = settings.pop("sites")
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "checkpoint": True,
        "kind": "draws",
        "method": settings.get("method", "unknown"),
        "settings": {k: v for k, v in settings.items() if k != "warmup_steps"},
        "sites": {name: {"shape": shape} for name, shape in sites.items()},
        "chains": [int(path.name.removeprefix("chain_")) for path in chains],
        "num_samples": min(state["num_draws"] for state in states),
        "warmup_steps": int(settings.get("warmup_steps", 0)),
        "files": {},
    }


def _require(mapping: dict, key: str, kind: type, path: Path):
    value = mapping.get(key)
    if not isinstance(value, kind):
        raise ManifestError(
            f"load: {path} is malformed: {key!r} must be a {kind.__name__}, got {value!r:.60}"
        )
    return value


def _check_files(directory: Path, manifest: dict) -> None:
    """Every file the manifest lists is there, of its size and, from format version 2, of
    its SHA-256 (inside a draw store: every file, and no other)."""
    hashed = manifest["format_version"] >= VERIFIED_FORMAT
    for name, entry in manifest["files"].items():
        path = directory / name
        if not isinstance(entry, dict):
            raise ManifestError(f"load: the manifest's entry for {name!r} is malformed")
        if not entry.get("directory"):
            _check_file(path, entry, hashed)
            continue
        if not path.is_dir():
            raise CorruptFileError(f"load: {path} is missing (the manifest lists it)")
        if not hashed:
            continue
        listed = entry.get("files")
        if not isinstance(listed, dict):
            raise ManifestError(f"load: the manifest's entry for {name!r} lists no files")
        unlisted = sorted(
            str(found.relative_to(path))
            for found in _walk(path)
            if str(found.relative_to(path)) not in listed
        )
        if unlisted:
            raise CorruptFileError(
                f"load: {path} holds files bdl.save did not write ({unlisted[:3]}); copy the "
                "directory again from where it was saved"
            )
        for inner, inner_entry in listed.items():
            if not isinstance(inner_entry, dict) or ".." in Path(inner).parts:
                raise ManifestError(f"load: the manifest's entry for {name}/{inner} is malformed")
            _check_file(path / inner, inner_entry, hashed)


def _check_file(path: Path, entry: dict, hashed: bool) -> None:
    if not path.is_file():
        raise CorruptFileError(f"load: {path} is missing (the manifest lists it)")
    size, expected = path.stat().st_size, entry.get("bytes")
    if size != expected:
        raise CorruptFileError(
            f"load: {path} has {size} bytes, the manifest says {expected}: the file is "
            f"{'truncated' if isinstance(expected, int) and size < expected else 'changed'}"
            "; copy the directory again"
        )
    if not hashed:
        return
    digest = entry.get("sha256")
    if not isinstance(digest, str):
        raise ManifestError(
            f"load: the manifest lists {path.name} without its SHA-256 (format version 2 "
            "records one for every file); it was edited: save the posterior again"
        )
    actual = _sha256(path)
    if actual != digest:
        raise CorruptFileError(
            f"load: {path} changed after bdl.save wrote it: its SHA-256 is {actual[:16]}..., "
            f"the manifest's {digest[:16]}... (same size: bytes inside it differ); nothing was "
            "read from it: copy the directory again from where it was saved"
        )


def _warn_if_unverified(directory: Path, manifest: dict) -> None:
    if manifest.get("checkpoint"):
        warnings.warn(
            f"load: {directory} is a kernel's checkpoint directory, without the manifest "
            "bdl.save writes: its files are not verified against hashes. Save it with "
            "bdl.save(bdl.load(directory, model), new_directory) to record them",
            UserWarning,
            stacklevel=3,
        )
        return
    if manifest["format_version"] < VERIFIED_FORMAT:
        warnings.warn(
            f"load: {directory} was written in format version {manifest['format_version']} "
            f"(pyro_bdl {manifest.get('library_version')}), whose manifest records neither the "
            "files' SHA-256 nor the sites' supports and priors: its files and the model's "
            "priors are not verified. Save it again with this pyro_bdl "
            "(bdl.save(bdl.load(directory, model), directory)) to record them",
            UserWarning,
            stacklevel=3,
        )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):  # 4 MiB at a time
            digest.update(block)
    return digest.hexdigest()


def _file_entry(path: Path) -> dict:
    return {"bytes": path.stat().st_size, "sha256": _sha256(path)}


def _directory_entry(path: Path) -> dict:
    """A draw store: every file in it, with its size and SHA-256."""
    files = {str(found.relative_to(path)): _file_entry(found) for found in _walk(path)}
    return {"directory": True, "files": files}


def _walk(path: Path):
    for root, _, names in os.walk(path):
        yield from sorted(Path(root) / name for name in names)


# -- the model's sites: support and prior --------------------------------------------------


def _site_fns(trace: pyro.poutine.Trace) -> dict:
    """The distribution of every latent site of a trace."""
    return {
        name: site["fn"]
        for name, site in trace.iter_stochastic_nodes()
        if not site_is_subsample(site)
    }


def _described(sites: dict, fns: Mapping) -> dict:
    """The manifest's sites: shape and dtype, and (where the model tells them) support and
    prior family."""
    return {name: {**entry, **_site_model(fns[name])} if name in fns else dict(entry)
            for name, entry in sites.items()}  # fmt: skip


def _site_model(fn) -> dict:
    return {"support": _describe(fn.support), "prior": prior_family(fn)}


def _describe(value):
    """A constraint as JSON: its name and its parameters (bounds, base constraint, ...);
    a tensor parameter by its values (up to 8) or its shape and range."""
    if isinstance(value, constraints.Constraint):
        parameters = {
            key: _describe(entry)
            for key, entry in sorted(vars(value).items())
            if not key.startswith("_")
        }
        return {"name": type(value).__name__.lstrip("_"), **parameters}
    if torch.is_tensor(value):
        value = value.detach().double().cpu()
        if value.numel() <= 8:
            return value.reshape(-1).tolist()
        return {"shape": list(value.shape), "min": value.min().item(), "max": value.max().item()}
    if isinstance(value, (list, tuple)):
        return [_describe(entry) for entry in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return type(value).__name__


def _same(saved, now) -> bool:
    """Descriptions equal, numbers to float32 precision (a model loaded in another dtype)."""
    if isinstance(saved, dict) and isinstance(now, dict):
        return saved.keys() == now.keys() and all(_same(saved[k], now[k]) for k in saved)
    if isinstance(saved, list) and isinstance(now, list):
        return len(saved) == len(now) and all(map(_same, saved, now))
    numbers = (int, float)
    if isinstance(saved, numbers) and isinstance(now, numbers) and not isinstance(saved, bool):
        return math.isclose(saved, now, rel_tol=1e-6, abs_tol=1e-30) or saved == now
    return saved == now


def _shown(entry: dict) -> str:
    def constraint(spec) -> str:
        if not isinstance(spec, dict):
            return str(spec)
        parameters = ", ".join(f"{k}={constraint(v)}" for k, v in spec.items() if k != "name")
        return f"{spec.get('name')}({parameters})" if parameters else str(spec.get("name"))

    return f"support {constraint(entry.get('support'))}, prior {entry.get('prior')}"


def _check_support(saved: dict, fns: Mapping) -> None:
    """Refuse a model whose latent sites have another support or prior family than the
    saved ones (sites the manifest describes; a version 1 manifest describes none)."""
    differences = {}
    for name, entry in saved.items():
        if "support" not in entry or name not in fns:
            continue
        now = _site_model(fns[name])
        if not (_same(entry["support"], now["support"]) and entry.get("prior") == now["prior"]):
            differences[name] = (_shown(entry), _shown(now))
    if differences:
        lines = [f"  {name!r}: saved {a}; the model {b}" for name, (a, b) in differences.items()]
        raise SupportMismatchError(
            f"load: the model's latent sites have the saved names and shapes, but "
            f"{len(differences)} differ in support or prior:\n" + "\n".join(lines) + "\nThe "
            "saved posterior is over the model it was fitted to: load it with that model (its "
            "priors as they were), or fit this one afresh",
            differences,
        )


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        with safe_open(path, framework="pt", device="cpu") as handle:
            return {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
    except (SafetensorError, OSError, ValueError) as error:  # a pickle was refused before
        raise CorruptFileError(
            f"load: {path} is not a readable safetensors file ({error})"
        ) from None


def _write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> int:
    """Write atomically (a new file replacing the old); the size in bytes."""
    seen, plain = set(), {}
    for key, value in tensors.items():
        value = value.detach().cpu().contiguous()
        pointer = (value.untyped_storage().data_ptr(), value.storage_offset())
        # safetensors refuses tensors sharing memory; the guide's state names each once
        plain[key] = value.clone() if pointer in seen and value.numel() else value
        seen.add(pointer)
    partial = path.with_suffix(".tmp")
    save_file(plain, str(partial))
    os.replace(partial, path)
    return path.stat().st_size


def _remove_previous(directory: Path) -> None:
    """Remove the files an earlier save listed (a stale adapter must not outlive its save)."""
    try:
        previous = json.loads((directory / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return
    for name, entry in previous.items() if isinstance(previous, dict) else ():
        path = directory / name
        inside = path.resolve().parent == directory.resolve()  # never a file elsewhere
        if inside and isinstance(entry, dict) and not entry.get("directory") and path.is_file():
            path.unlink()
    (directory / MANIFEST).unlink()


def _write_json(path: Path, value: dict) -> None:
    partial = path.with_suffix(".tmp")
    partial.write_text(json.dumps(value, indent=1, sort_keys=True))
    os.replace(partial, path)


def _version() -> str:
    from pyro_bdl._version import __version__

    return __version__


def _cuda_devices() -> list[int]:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return list(range(torch.cuda.device_count()))
    return []


# -- values as JSON with tensors beside ------------------------------------------------------


def _encode(value, tensor: Callable) -> tuple:
    """``value`` (dicts, lists, tuples, numbers, strings, tensors) as JSON, and its tensors.

    ``tensor(t, tensors)`` gives the JSON standing for a tensor. Raises ``TypeError`` for
    anything else.
    """
    tensors: dict[str, torch.Tensor] = {}

    def encode(item):
        if torch.is_tensor(item):
            return {"tensor": tensor(item, tensors)}
        if item is None or isinstance(item, (bool, int, float, str)):
            return {"value": item}
        if isinstance(item, Mapping):
            return {"dict": [[encode(key), encode(entry)] for key, entry in item.items()]}
        if isinstance(item, tuple):
            return {"tuple": [encode(entry) for entry in item]}
        if isinstance(item, list):
            return {"list": [encode(entry) for entry in item]}
        raise TypeError(f"cannot save a {type(item).__name__}")

    return encode(value), tensors


def _decode(spec, tensor: Callable):
    """The value :func:`_encode` encoded; ``tensor(json)`` rebuilds each tensor."""
    if "tensor" in spec:
        return tensor(spec["tensor"])
    if "value" in spec:
        return spec["value"]
    if "dict" in spec:
        return {_decode(key, tensor): _decode(entry, tensor) for key, entry in spec["dict"]}
    items = [_decode(entry, tensor) for entry in spec.get("list", spec.get("tuple", []))]
    return tuple(items) if "tuple" in spec else items


def _keep_tensor(value: torch.Tensor, tensors: dict) -> dict:
    key = str(len(tensors))
    tensors[key] = value
    return {"key": key}


def _tensor_shape(value: torch.Tensor, tensors: dict) -> dict:
    return {"shape": list(value.shape), "dtype": dtype_name(value.dtype)}


def _placeholders(example: dict, device, dtype=None) -> tuple[tuple, dict]:
    """Zeros shaped like the model's arguments (floating ones in ``dtype`` if given), the
    other arguments as they were."""

    def zeros(spec: dict) -> torch.Tensor:
        saved = dtype_from_name(spec["dtype"])
        chosen = dtype if dtype is not None and saved.is_floating_point else saved
        return torch.zeros(spec["shape"], dtype=chosen, device=device)

    args, kwargs = _decode(example, zeros)
    return tuple(args), kwargs


def _training_settings(training) -> dict:
    settings = training._init_settings()
    schedule = settings.get("schedule")
    if schedule is None or isinstance(schedule, str):
        return as_json(settings)
    if type(schedule) not in _SCHEDULES.values():
        raise NotImplementedError(
            f"save: the {type(training).__name__}'s schedule {schedule!r} is a function of "
            "your own, which cannot be saved without pickling; use a schedule of "
            "pyro_bdl.inference.sgmcmc.schedules, or save the guide alone"
        )
    return as_json({**settings, "schedule": {"class": type(schedule).__name__, **vars(schedule)}})


def _decode_schedule(spec: dict):
    spec = dict(spec)
    return _SCHEDULES[spec.pop("class")](**spec)
