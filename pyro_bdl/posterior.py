"""One interface every method's result answers: :class:`Posterior`.

A fitted guide (:class:`~pyro_bdl.inference.LaplaceGuide`,
:class:`~pyro_bdl.inference.MeanFieldGuide`, :class:`~pyro_bdl.inference.BLoBGuide`,
:class:`~pyro_bdl.inference.IVONGuide`), the draws of a ``pyro.infer.MCMC`` or
:class:`~pyro_bdl.inference.Chains` run and a baseline's
:class:`~pyro_bdl.inference.baselines.Predictor` (MAP, MLE, MC dropout, deep ensembles,
BBB) answer the same members, so that :func:`bdl.save <pyro_bdl.persistence.save>`,
:func:`bdl.load <pyro_bdl.persistence.load>`, :func:`bdl.to_arviz <pyro_bdl.arviz.to_arviz>`
and :func:`~pyro_bdl.predict.predict_proba` take any of them without asking which it is:

* ``draws(num_samples, *model_args)``: a :class:`PosteriorDraws`, the latent sites' draws
  grouped by chain with their statistics and the method's settings (what ArviZ shows and a
  draw store holds);
* ``sample(num_samples, *model_args)``: the same draws flat, site -> ``(S, *shape)``, as
  ``mcmc.get_samples()`` returns them;
* ``predict_proba(*model_args, num_samples=None)``: class probabilities ``(S, B, C)``, one
  softmax per draw (the Laplace guide: its linearised predictive's draws);
* ``state_dict()`` / ``load_state_dict(state)``: the whole posterior as tensors (and JSON
  encoded in a tensor), as a ``torch.nn.Module`` keeps its own;
* ``hyperparameters()``: the method's name and settings, JSON-serialisable;
* ``layout``: how :func:`~pyro_bdl.persistence.save` lays it out on disk (``"guide"``: the
  state dict as safetensors; ``"draws"``: one chunked draw store per chain, the layout a
  kernel's ``checkpoint`` directory has too; ``"members"``: a predictor's fitted members).

Pyro's ``MCMC`` and the library's ``Chains`` are not changed to answer it:
:func:`as_posterior` wraps a run in a :class:`DrawsPosterior` through Pyro's public
interface (``get_samples(group_by_chain=True)``, ``diagnostics()``), never its private
attributes. The idea is that of ``posteriors``' ``Transform`` (every method one
``init`` / ``update`` pair) and laplace-torch's ``BaseLaplace`` (every structure one
``fit`` / ``__call__``): callers write against the interface, not against the classes.

Example::

    posterior = bdl.posterior.as_posterior(mcmc)       # or a guide, or a Predictor
    probs = posterior.predict_proba(test_batch, num_data)           # (S, B, C)
    bdl.save(posterior, "run")
    idata = bdl.to_arviz(posterior)
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

import numpy as np
import pyro
import torch
from pyro.poutine.util import site_is_subsample

from pyro_bdl._offload import kept_draws
from pyro_bdl.predict import predict_proba as _predict_proba

__all__ = [
    "Posterior",
    "PosteriorDraws",
    "DrawsPosterior",
    "as_posterior",
    "GuidePosterior",
    "guide_draws",
    "predict_proba",
    "encode_json",
    "decode_json",
]

#: The state dict's entry holding a posterior's settings and structure as JSON.
STATE_KEY = "_bdl_state"


@dataclass(frozen=True)
class PosteriorDraws:
    """Draws of a posterior's latent sites, grouped by chain.

    :ivar dict samples: site -> tensor ``(chain, draw, *shape)`` on the CPU.
    :ivar dict sample_stats: statistic -> array ``(chain, draw)`` (a kernel's per-draw
        statistics; empty for a guide or a predictor).
    :ivar list chain_ids: the chains' numbers (``[0]`` for a guide).
    :ivar dict attrs: ``method`` and the method's settings, for ArviZ's attributes.
    :ivar dict approximation: a guide's parameters (its ``approximation_parameters()``),
        ArviZ's ``approximation`` group; empty for draws.
    :ivar dict site_fns: site -> the distribution the model gives it, where known (the
        saved manifest records its support and prior family).
    """

    samples: dict[str, torch.Tensor]
    sample_stats: dict[str, np.ndarray] = field(default_factory=dict)
    chain_ids: list[int] = field(default_factory=lambda: [0])
    attrs: dict[str, Any] = field(default_factory=dict)
    approximation: dict[str, torch.Tensor] = field(default_factory=dict)
    site_fns: dict[str, Any] = field(default_factory=dict)

    @property
    def num_draws(self) -> int:
        """Draws per chain."""
        return int(next(iter(self.samples.values())).shape[1])

    def flat(self) -> dict[str, torch.Tensor]:
        """site -> ``(chain * draw, *shape)``, the chains one after the other."""
        return {name: value.reshape(-1, *value.shape[2:]) for name, value in self.samples.items()}


@runtime_checkable
class Posterior(Protocol):
    """What every method's fitted result answers (see the module's description).

    ``isinstance(x, Posterior)`` checks the members' presence, as for any runtime protocol.
    """

    layout: ClassVar[str]
    model: Callable

    def draws(self, num_samples: int | None = None, *args, **kwargs) -> PosteriorDraws:
        """Draws grouped by chain (``num_samples``: how many, where the posterior draws them
        afresh; a run's kept draws are all of them)."""

    def sample(self, num_samples: int | None = None, *args, **kwargs) -> dict[str, torch.Tensor]:
        """Draws site -> ``(S, *shape)``."""

    def predict_proba(self, *args, num_samples: int | None = None, **kwargs) -> torch.Tensor:
        """Class probabilities ``(S, B, C)`` for the model's arguments ``args``."""

    def state_dict(self) -> dict[str, Any]:
        """The whole posterior as tensors."""

    def load_state_dict(self, state_dict: Mapping[str, Any], *args, **kwargs) -> Any:
        """Restore what :meth:`state_dict` returned."""

    def hyperparameters(self) -> dict[str, Any]:
        """The method's name (``"method"``) and settings, JSON-serialisable."""


class DrawsPosterior:
    """Draws of the latent sites as a :class:`Posterior`: a finished MCMC or Chains run's
    (:meth:`from_run`, or :func:`as_posterior`), or a dict of draws.

    Example::

        posterior = DrawsPosterior(model, mcmc.get_samples())
        probs = posterior.predict_proba(test_batch, num_data)        # (S, B, C)

    :param callable model: the Pyro model the draws are of (None: draws for ArviZ only).
    :param dict samples: site -> draws ``(S, *shape)``, or ``(chain, draw, *shape)`` with
        ``grouped_by_chain=True``; tensors or NumPy arrays (kept on the CPU).
    :param bool grouped_by_chain: whether ``samples`` has the chain dimension.
    :param dict sample_stats: statistic -> ``(chain, draw)`` values.
    :param list chain_ids: the chains' numbers (default ``0 .. chains - 1``).
    :param dict attrs: the method and its settings.
    :param dict site_fns: site -> the model's distribution of it.
    """

    layout = "draws"

    def __init__(
        self,
        model: Callable | None,
        samples: Mapping[str, Any],
        *,
        grouped_by_chain: bool = False,
        sample_stats: Mapping[str, Any] | None = None,
        chain_ids: list[int] | None = None,
        attrs: Mapping[str, Any] | None = None,
        site_fns: Mapping[str, Any] | None = None,
    ):
        self.model = model
        self._samples = {
            name: _cpu_tensor(value) if grouped_by_chain else _cpu_tensor(value).unsqueeze(0)
            for name, value in samples.items()
        }
        num_chains = next(iter(self._samples.values())).shape[0] if self._samples else 0
        self.chain_ids = list(range(num_chains)) if chain_ids is None else list(chain_ids)
        self._stats = {
            key: np.asarray(value, dtype=float) for key, value in (sample_stats or {}).items()
        }
        self._attrs = dict(attrs or {"method": "draws"})
        self._site_fns = dict(site_fns or {})

    @classmethod
    def from_run(cls, run, model: Callable | None = None, caller: str = "as_posterior"):
        """The draws of a finished run with Pyro's ``MCMC`` interface (``MCMC``, ``Chains``,
        a loaded :class:`~pyro_bdl.persistence.SavedChains`), read through its public
        ``get_samples(group_by_chain=True)`` and ``diagnostics()``.

        :param str caller: the public function, named in the errors.
        """
        try:
            samples = run.get_samples(group_by_chain=True)
        except (AttributeError, TypeError):  # Pyro's MCMC before run(): no samples to select
            samples = None
        if not samples:
            raise ValueError(
                f"{caller}: source, the {type(run).__name__}, has no draws yet; call its "
                "run(...) first"
            )
        kernel = run.kernel
        settings = kernel.hyperparameters() if hasattr(kernel, "hyperparameters") else {}
        attrs = {
            **settings,
            "method": settings.get("method", type(kernel).__name__),
            "num_chains": run.num_chains,
            "num_samples": run.num_samples,
            "warmup_steps": run.warmup_steps,
        }
        chain_ids = getattr(run, "chain_ids", None)
        return cls(
            model if model is not None else getattr(kernel, "model", None),
            samples,
            grouped_by_chain=True,
            sample_stats=_sample_stats(
                _diagnostics(run, caller), next(iter(samples.values())).shape[1]
            ),
            chain_ids=chain_ids if chain_ids is not None else None,
            attrs=attrs,
            site_fns=_kernel_site_fns(kernel),
        )

    def draws(self, num_samples: int | None = None, *args, **kwargs) -> PosteriorDraws:
        """The kept draws (all of them: ``num_samples`` and the model's arguments are not
        needed)."""
        return PosteriorDraws(
            samples=dict(self._samples),
            sample_stats=dict(self._stats),
            chain_ids=list(self.chain_ids),
            attrs=dict(self._attrs),
            site_fns=dict(self._site_fns),
        )

    def sample(self, num_samples: int | None = None, *args, **kwargs) -> dict[str, torch.Tensor]:
        """The draws flat, ``(S, *shape)``; ``num_samples`` of them evenly spaced if given."""
        flat = self.draws().flat()
        return {
            name: value[self._thinned(value.shape[0], num_samples)] for name, value in flat.items()
        }

    def predict_proba(self, *args, num_samples: int | None = None, **kwargs) -> torch.Tensor:
        """:func:`~pyro_bdl.predict.predict_proba` of the model under the draws, ``(S, B, C)``."""
        if self.model is None:
            raise ValueError(
                "predict_proba: these draws have no model; build the DrawsPosterior with "
                "model=<the Pyro model>"
            )
        return _predict_proba(self.model, *args, samples=self.sample(num_samples), **kwargs)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The draws (``samples/<site>``) and statistics (``sample_stats/<name>``)."""
        header = {"chain_ids": self.chain_ids, "attrs": self._attrs}
        return {
            STATE_KEY: encode_json(header),
            **{f"samples/{name}": value for name, value in self._samples.items()},
            **{f"sample_stats/{k}": torch.as_tensor(v) for k, v in self._stats.items()},
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        header = decode_json(state_dict[STATE_KEY])
        self.chain_ids, self._attrs = list(header["chain_ids"]), dict(header["attrs"])
        self._samples = {k[8:]: v for k, v in state_dict.items() if k.startswith("samples/")}
        self._stats = {
            k[13:]: np.asarray(v) for k, v in state_dict.items() if k.startswith("sample_stats/")
        }

    def hyperparameters(self) -> dict[str, Any]:
        """The method (``"draws"`` for a dict) and the kernel's settings."""
        return dict(self._attrs)

    @staticmethod
    def _thinned(size: int, num_samples: int | None) -> torch.Tensor | slice:
        if num_samples is None or num_samples >= size:
            return slice(None)
        return torch.linspace(0, size - 1, num_samples).round().long()


class GuidePosterior:
    """Any Pyro guide as a :class:`Posterior` (the library's guides answer it themselves):
    what :func:`as_posterior` makes of a guide of your own with ``approximation_parameters()``
    (and, optionally, ``hyperparameters()``), as ``bdl.to_arviz`` takes it.

    :param callable guide: a fitted Pyro guide.
    """

    layout = "guide"

    def __init__(self, guide: Callable):
        self.guide = guide
        self.model = getattr(guide, "model", None)

    def draws(
        self, num_samples: int | None = None, *args, seed: int | None = None, **kwargs
    ) -> PosteriorDraws:
        """See :func:`guide_draws`."""
        return guide_draws(self.guide, num_samples, args, kwargs, seed)

    def sample(
        self, num_samples: int | None = None, *args, seed: int | None = None, **kwargs
    ) -> dict[str, torch.Tensor]:
        """``num_samples`` draws, site -> ``(num_samples, *shape)``."""
        return self.draws(num_samples, *args, seed=seed, **kwargs).flat()

    def predict_proba(self, *args, num_samples: int | None = None, **kwargs) -> torch.Tensor:
        """The model replayed on ``num_samples`` draws of the guide, ``(S, B, C)``."""
        return _predict_proba(
            self.model, *args, guide=self.guide, num_samples=num_samples, **kwargs
        )

    def state_dict(self) -> dict[str, Any]:
        """The guide's own ``state_dict()``."""
        return self.guide.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any], *args, **kwargs) -> Any:
        """The guide's own ``load_state_dict``."""
        return self.guide.load_state_dict(state_dict, *args, **kwargs)

    def hyperparameters(self) -> dict[str, Any]:
        """The guide's class name and its ``hyperparameters()`` where it has them."""
        own = getattr(self.guide, "hyperparameters", dict)()
        return {"method": type(self.guide).__name__, **own}

    def approximation_parameters(self) -> dict[str, torch.Tensor]:
        """The guide's own."""
        return self.guide.approximation_parameters()


def guide_draws(
    guide: Callable, num_samples: int | None, args: tuple, kwargs: dict, seed: int | None
) -> PosteriorDraws:
    """``num_samples`` draws of a guide's latent sites as chain 0, each copied to the CPU as
    it is drawn (the device holds one draw), with the guide's parameters
    (``approximation_parameters()``) and settings (``hyperparameters()``).

    :param callable guide: a fitted guide.
    :param int num_samples: how many draws.
    :param tuple args: the model's arguments (DataLoaders: their first batch), for a guide
        that has not seen its model yet.
    :param dict kwargs: keyword arguments likewise.
    :param int seed: seed of the draws (the process's random state is left as it was);
        None draws from it.
    """
    # inference.minibatch is below this module; imported here, as the guides (which import
    # this module) load first.
    from pyro_bdl.inference.minibatch import Minibatches

    if not num_samples:
        raise ValueError(
            f"{type(guide).__name__}: pass num_samples=<number of draws>, which a guide draws "
            "afresh (to_arviz(guide, num_samples=...))"
        )
    args, kwargs = Minibatches(tuple(args), dict(kwargs)).peek()
    with torch.random.fork_rng():  # the caller's random state unchanged
        if seed is not None:
            pyro.set_rng_seed(seed)
        drawn = kept_draws(lambda: _latent_draw(guide, args, kwargs), num_samples)
    return PosteriorDraws(
        samples={name: value.unsqueeze(0) for name, value in drawn.items()},
        attrs={"method": type(guide).__name__, **getattr(guide, "hyperparameters", dict)()},
        approximation={
            name: value.detach().cpu() for name, value in guide.approximation_parameters().items()
        },
        site_fns=_latent_fns(guide) or {},
    )


def _latent_draw(guide: Callable, args: tuple, kwargs: dict) -> dict[str, torch.Tensor]:
    """One draw of the model's latent sites (on the guide's device), the guide's auxiliary
    sites left out."""
    with torch.no_grad():
        trace = pyro.poutine.trace(guide).get_trace(*args, **kwargs)
    latent = _latent_fns(guide)  # None: a guide without a prototype, every site it samples
    return {
        name: site["value"]
        for name, site in trace.nodes.items()
        if site["type"] == "sample"
        and not site["is_observed"]
        and not site_is_subsample(site)
        and (latent is None or name in latent)
    }


def _latent_fns(guide: Callable) -> dict | None:
    """The model's latent sites and their distributions, from the guide's prototype trace
    (None for a guide without one)."""
    prototype = getattr(guide, "prototype_trace", None)
    if prototype is None:
        return None
    return {
        name: site["fn"]
        for name, site in prototype.iter_stochastic_nodes()
        if not site_is_subsample(site)
    }


def as_posterior(source, *, model: Callable | None = None, caller: str = "as_posterior"):
    """``source`` as a :class:`Posterior`: itself when it answers the interface (a guide, a
    predictor, a :class:`DrawsPosterior`), a :class:`DrawsPosterior` of a run with Pyro's
    ``MCMC`` interface (``MCMC``, ``Chains``, ``SavedChains``).

    :param source: the method's result.
    :param callable model: the model of a run's draws (default: the kernel's).
    :param str caller: the public function, named in the errors.
    :raises TypeError: for anything else.
    """
    if isinstance(source, Posterior):
        return source
    if callable(source) and hasattr(source, "approximation_parameters"):
        return GuidePosterior(source)
    if callable(getattr(source, "get_samples", None)) and hasattr(source, "kernel"):
        return DrawsPosterior.from_run(source, model, caller)
    raise TypeError(
        f"{caller}: source must be a method's result (a fitted guide, a run MCMC or Chains, a "
        f"baselines Predictor or a DrawsPosterior), got {type(source).__name__}"
    )


def encode_json(value) -> torch.Tensor:
    """``value`` as JSON in a ``uint8`` tensor (a state dict of tensors only)."""
    data = json.dumps(value, sort_keys=True).encode()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def decode_json(tensor: torch.Tensor):
    """The value :func:`encode_json` encoded."""
    if not torch.is_tensor(tensor) or tensor.dtype != torch.uint8 or tensor.dim() != 1:
        raise ValueError(
            f"a guide's {STATE_KEY!r} entry must be a 1-d uint8 tensor (JSON), got "
            f"{type(tensor).__name__}"
        )
    try:
        return json.loads(bytes(tensor.cpu().tolist()).decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"a guide's {STATE_KEY!r} entry is not valid JSON ({error})") from None


def _cpu_tensor(value) -> torch.Tensor:
    if torch.is_tensor(value):
        return value.detach().cpu()
    return torch.as_tensor(np.asarray(value))


def _diagnostics(run, caller: str) -> Mapping:
    """A run's public ``diagnostics()``; empty, with a warning, where it cannot be computed
    (Pyro's ``MCMC.diagnostics`` takes split R-hat, which needs 4 draws per chain)."""
    try:
        return run.diagnostics()
    except (AssertionError, RuntimeError, ValueError) as error:
        warnings.warn(
            f"{caller}: {type(run).__name__}.diagnostics() failed ({type(error).__name__}"
            f"{': ' + str(error) if str(error) else ''}; Pyro's needs at least 4 draws per "
            "chain), so the draws' sample statistics (lp, step size, ...) are left out; keep "
            "4 or more draws per chain to have them",
            UserWarning,
            stacklevel=3,
        )
        return {}


def _sample_stats(diagnostics: Mapping, num_draws: int) -> dict[str, np.ndarray]:
    """A run's per-draw statistics ``(chain, draw)`` from its public ``diagnostics()``,
    where every chain has them for every draw (``{"sample_stats": {"chain 0": {...}}}``)."""
    per_chain = diagnostics.get("sample_stats") if isinstance(diagnostics, Mapping) else None
    if not isinstance(per_chain, Mapping) or not per_chain:
        return {}
    chains = list(per_chain.values())
    if any(not isinstance(stats, Mapping) for stats in chains):
        return {}
    keys = [
        key
        for key in chains[0]
        if all(key in stats and len(stats[key]) == num_draws for stats in chains)
    ]
    return {key: np.asarray([stats[key] for stats in chains], dtype=float) for key in keys}


def _kernel_site_fns(kernel) -> dict:
    """The distributions of the latent sites a kernel samples, where it says them publicly
    (an SGMCMC kernel's ``target``); none for other kernels."""
    sites = getattr(getattr(kernel, "target", None), "sites", None)
    if isinstance(sites, Mapping):
        return {name: site["fn"] for name, site in sites.items()}
    return {}


def predict_proba(posterior, *args, num_samples: int | None = None, **kwargs) -> torch.Tensor:
    """Class probabilities ``(S, B, C)`` of any method's result for the model's arguments:
    ``as_posterior(posterior).predict_proba(*args, num_samples=num_samples)``.

    Example::

        probs = bdl.predict_proba(mcmc, test_batch, num_data)            # every kept draw
        probs = bdl.predict_proba(guide, test_batch, num_data, num_samples=20)

    :param posterior: a fitted guide, a run MCMC or Chains, a baselines Predictor, a
        :class:`DrawsPosterior`.
    :param args: the model's arguments.
    :param int num_samples: draws (a guide's, a predictor's guide members'); a run's kept
        draws are thinned evenly to this many.
    :return: probabilities ``(S, B, C)``.
    """
    found = as_posterior(posterior, caller="predict_proba")
    return found.predict_proba(*args, num_samples=num_samples, **kwargs)
