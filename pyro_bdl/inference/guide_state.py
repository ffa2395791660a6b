"""Every guide's whole approximation in its ``state_dict()``, so any torch checkpoint keeps it.

A guide's ``pyro.param`` parameters (means, scales, IVON's :math:`h`) are in PyTorch's
``state_dict`` already. What is not a parameter (Laplace's MAP, curvature factors and
prior precision, IVON's weight decay, the settings, the latent sites' names and shapes,
and the values of the model's point weights, which live in Pyro's param store) is added
by :class:`GuideState`, one mechanism for every guide of the library:

* ``"_bdl_state"``: the settings and structure as JSON, encoded in a ``uint8`` tensor,
  so that the whole state dict is tensors (``safetensors``, ``torch.load(...,
  weights_only=True)`` and the checkpoints of Lightning, accelerate or Hugging Face's
  ``Trainer`` take it as it is);
* ``"_bdl/<name>"``: the tensors that are not parameters.

``load_state_dict`` checks that the state belongs to a guide of the same class and
settings and that its latent sites have the names and shapes of the guide's (a
:class:`SiteMismatchError` lists the differing ones), then restores everything. Hooking
``_save_to_state_dict`` / ``_load_from_state_dict`` (PyTorch's own extension points)
rather than keeping copies in buffers means the state is read from the guide when it is
saved, never kept twice.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import pyro
import torch
from pyro.poutine.util import site_is_subsample

from pyro_bdl.model_checks import CheckedPrototype
from pyro_bdl.posterior import STATE_KEY, PosteriorDraws, decode_json, encode_json, guide_draws
from pyro_bdl.predict import predict_proba

__all__ = ["GuideState", "SiteMismatchError", "check_sites", "encode_json", "decode_json"]

#: The version of the guide state; a newer one is refused with a named error.
STATE_VERSION = 1
TENSOR_PREFIX = "_bdl/"
_POINT = "point/"


class SiteMismatchError(ValueError):
    """The latent sites of a model differ from those a posterior was saved with.

    :ivar dict differences: site -> (saved shape or None, the model's shape or None).
    """

    def __init__(self, message: str, differences: dict):
        super().__init__(message)
        self.differences = differences


def check_sites(saved: Mapping[str, list], found: Mapping[str, list], what: str) -> None:
    """Raise a :class:`SiteMismatchError` unless ``saved`` and ``found`` (site -> shape) agree.

    :param str what: what ``found`` describes, for the message (e.g. ``"the model"``).
    """
    differences = {}
    for name in dict.fromkeys([*saved, *found]):
        before, now = saved.get(name), found.get(name)
        if before is None or now is None or list(before) != list(now):
            differences[name] = (
                None if before is None else tuple(before),
                None if now is None else tuple(now),
            )
    if differences:
        lines = [
            f"  {name!r}: saved {'absent' if a is None else a}, {what} "
            f"{'absent' if b is None else b}"
            for name, (a, b) in list(differences.items())[:10]
        ]
        more = f"\n  ... and {len(differences) - 10} more" if len(differences) > 10 else ""
        raise SiteMismatchError(
            f"the latent sites of {what} differ from the saved posterior's in "
            f"{len(differences)} site(s):\n" + "\n".join(lines) + more + "\nLoad it with the "
            "model it was fitted to (the same network, adapters, head and priors' shapes)",
            differences,
        )


def as_json(value):
    """``value`` as it reads back from JSON (tuples become lists), for comparisons."""
    return json.loads(json.dumps(value, sort_keys=True))


class GuideState(CheckedPrototype):
    """Mixin of the library's guides: ``state_dict()`` carries the whole approximation.

    A guide class says what its approximation is in three small methods and a flag:

    * ``_init_settings()``: its constructor's arguments that shape the approximation
      (JSON); a state loads only into a guide built with the same;
    * ``_state()``: JSON and tensors of what is not a registered parameter;
    * ``_restore(state, tensors)``: set that state again (after the sites were checked);
    * ``_needs_setup``: whether the guide must have seen the model (its parameters
      exist only after the first call, as for Pyro's autoguides) before it can load.

    The mixin records the model's point weights (``pyro.param`` sites) when the guide
    sets itself up, and keeps their values from Pyro's param store in the state too. The
    set-up checks the model (:class:`~pyro_bdl.model_checks.CheckedPrototype`).
    """

    _needs_setup = True

    def _init_settings(self) -> dict:
        raise NotImplementedError

    def _state(self) -> tuple[dict, dict[str, torch.Tensor]]:
        return {}, {}

    def _restore(self, state: dict, tensors: dict[str, torch.Tensor]) -> None:
        """Set the guide's state; tensors are used as they come (their device and dtype)."""

    @classmethod
    def _from_settings(cls, model, settings: dict):
        """The guide on ``model`` built with the saved :meth:`_init_settings`."""
        return cls(model, **settings)

    # -- the Posterior interface (pyro_bdl.posterior) ------------------------------------

    layout = "guide"  # bdl.save writes the state dict (persistence.py)

    def draws(
        self, num_samples: int | None = None, *args, seed: int | None = None, **kwargs
    ) -> PosteriorDraws:
        """``num_samples`` draws of the latent sites as chain 0, each copied to the CPU as
        it is drawn (the device holds one draw), with the guide's parameters.

        :param int num_samples: how many draws.
        :param args: the model's arguments (the first batch of DataLoaders), for a guide
            that has not seen its model yet.
        :param int seed: seed of the draws (the process's random state is left as it was);
            None draws from it.
        """
        return guide_draws(self, num_samples, args, kwargs, seed)

    def sample(
        self, num_samples: int | None = None, *args, seed: int | None = None, **kwargs
    ) -> dict[str, torch.Tensor]:
        """``num_samples`` draws, site -> ``(num_samples, *shape)`` on the CPU (see
        :meth:`draws`)."""
        return {
            k: v[0] for k, v in self.draws(num_samples, *args, seed=seed, **kwargs).samples.items()
        }

    def predict_proba(self, *args, num_samples: int | None = None, **kwargs) -> torch.Tensor:
        """Class probabilities ``(num_samples, B, C)``: the model replayed on
        ``num_samples`` draws of the guide (:func:`~pyro_bdl.predict.predict_proba`)."""
        if num_samples is None:
            raise ValueError(
                f"{type(self).__name__}.predict_proba: pass num_samples=<draws of the weights>"
            )
        return predict_proba(self.model, *args, guide=self, num_samples=num_samples, **kwargs)

    # -- the model's point weights ------------------------------------------------------

    def _setup_prototype(self, *args, **kwargs) -> None:
        self._point_names: list[str] = []
        super()._setup_prototype(*args, **kwargs)

    def _prototype_hide_fn(self, msg: dict) -> bool:
        if msg["type"] == "param" and msg["name"] not in getattr(self, "_point_names", []):
            self._point_names.append(msg["name"])
        return super()._prototype_hide_fn(msg)

    def _point_values(self) -> dict[str, torch.Tensor]:
        store = pyro.get_param_store()
        names = getattr(self, "_point_names", [])
        return {name: store[name] for name in names if name in store}

    # -- the sites -----------------------------------------------------------------------

    def _site_shapes(self) -> dict[str, dict] | None:
        """Site -> shape and dtype of the latent sites (None before the guide set up)."""
        if self.prototype_trace is None:
            return None
        return {
            name: {"shape": list(site["value"].shape), "dtype": dtype_name(site["value"].dtype)}
            for name, site in self.prototype_trace.iter_stochastic_nodes()
            if not site_is_subsample(site)
        }

    # -- PyTorch's state_dict hooks ------------------------------------------------------

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        sites = self._site_shapes()
        state, tensors = self._state() if sites is not None else ({}, {})
        points = self._point_values() if sites is not None else {}
        header = {
            "version": STATE_VERSION,
            "class": type(self).__name__,
            "settings": self._init_settings(),
            "sites": sites,
            "point_sites": list(points),
            "state": state,
        }
        destination[prefix + STATE_KEY] = encode_json(header)
        tensors = {**tensors, **{_POINT + name: value for name, value in points.items()}}
        for name, value in tensors.items():
            destination[prefix + TENSOR_PREFIX + name] = value if keep_vars else value.detach()

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors
    ) -> None:
        encoded = state_dict.pop(prefix + STATE_KEY, None)
        start = prefix + TENSOR_PREFIX
        tensors = {
            key[len(start) :]: state_dict.pop(key)
            for key in list(state_dict)
            if key.startswith(start)
        }
        if encoded is None:
            missing.append(prefix + STATE_KEY)
        else:
            self._load_header(decode_json(encoded), tensors)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing, unexpected, errors
        )

    def _load_header(self, header: dict, tensors: dict[str, torch.Tensor]) -> None:
        name = type(self).__name__
        version = header.get("version")
        if not isinstance(version, int) or version > STATE_VERSION:
            raise ValueError(
                f"{name}.load_state_dict: the state has version {version!r}; this pyro_bdl "
                f"reads versions up to {STATE_VERSION}: upgrade pyro_bdl to load it"
            )
        if header.get("class") != name:
            raise ValueError(
                f"{name}.load_state_dict: the state is a {header.get('class')}'s; load it "
                f"into a {header.get('class')}"
            )
        settings, mine = as_json(header["settings"]), as_json(self._init_settings())
        if settings != mine:
            differ = {k: (settings.get(k), mine.get(k)) for k in {*settings, *mine}
                      if settings.get(k) != mine.get(k)}  # fmt: skip
            raise ValueError(
                f"{name}.load_state_dict: the state was saved from a guide built with other "
                f"settings (saved, this guide): {differ}; build the guide with the saved ones"
            )
        if header["sites"] is None:
            return  # the state of a guide that never saw its model: nothing to restore
        current = self._site_shapes()
        if current is None and self._needs_setup:
            raise RuntimeError(
                f"{name}.load_state_dict: the guide has not seen its model yet, so its "
                "parameters do not exist; call it once with the model's arguments "
                "(guide(batch, num_data)) before loading, as for Pyro's autoguides, or use "
                "bdl.load(directory, model)"
            )
        if current is not None:
            check_sites(
                {site: entry["shape"] for site, entry in header["sites"].items()},
                {site: entry["shape"] for site, entry in current.items()},
                f"this {name}",
            )
        points = {k[len(_POINT) :]: v for k, v in tensors.items() if k.startswith(_POINT)}
        own = {k: v for k, v in tensors.items() if not k.startswith(_POINT)}
        self._restore(header["state"], own)
        self._point_names = list(header["point_sites"])
        store = pyro.get_param_store()
        for site, value in points.items():
            store[site] = value.detach().clone()
        self._forget_stale_params()

    def _forget_stale_params(self) -> None:
        """Drop the param store's entries under this guide's parameter names.

        A PyroModule takes the param store's value over its own when both exist (a guide
        of the same name trained earlier in the process); after a load its own must win,
        and it registers itself again at its next use.
        """
        store = pyro.get_param_store()
        for path, module in self.named_modules():
            for name in getattr(module, "_pyro_params", {}):
                fullname = ".".join(part for part in (self._pyro_name, path, name) if part)
                if fullname in store:
                    del store[fullname]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """``"float32"`` -> ``torch.float32`` (a ``ValueError`` for anything else)."""
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype
