"""Export draws to ArviZ: an ``xarray.DataTree`` with ArviZ's groups and conventions.

:func:`to_arviz` accepts a finished ``pyro.infer.MCMC`` run with a pyro_bdl kernel,
a :class:`~pyro_bdl.inference.sgmcmc.chains.Chains` run, a fitted guide, or a dict of
draws. The result has ``posterior`` (chain, draw, *dims), ``sample_stats``, and on
request ``log_likelihood`` (pointwise, computed draw by draw so memory stays that of
one forward pass), ``posterior_predictive`` and ``observed_data``; a guide adds the
parameters of its approximation as the group ``approximation``. A network's outputs on a
fixed probe batch of inputs, the draws judged in function space
(:func:`pyro_bdl.diagnostics.function_space`), are the group ``function_space``: computed
on the ``probe`` given, or those an SGMCMC kernel followed during its run. ``arviz_stats``
(``summary``, ``rhat``, ``ess``, ``loo``) and ``arviz_plots`` read it, and
``to_netcdf`` round-trips it.

Networks have millions of weights and ArviZ's diagnostics cost about a millisecond per
scalar; ``var_names`` and ``max_coords_per_var`` keep a reproducible subset, and
:mod:`pyro_bdl.diagnostics` computes R-hat and ESS vectorised over all of them.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Callable, Mapping, Sequence

import arviz_base
import numpy as np
import pyro
import torch
import xarray as xr
from pyro.poutine.util import site_is_subsample

from pyro_bdl._checks import function, instance, integer
from pyro_bdl._version import __version__
from pyro_bdl.diagnostics import network_outputs
from pyro_bdl.inference.minibatch import Minibatches
from pyro_bdl.inference.sgmcmc.checkpoint import read_state
from pyro_bdl.inference.sgmcmc.store import chain_directories, open_tree
from pyro_bdl.posterior import DrawsPosterior, as_posterior
from pyro_bdl.predict import condition_on_sites

__all__ = ["to_arviz"]

_STAT_NAMES = {"potential_energy": "lp"}


def to_arviz(
    source,
    *,
    num_samples: int | None = None,
    model: Callable | None = None,
    model_args: Sequence = (),
    model_kwargs: Mapping | None = None,
    log_likelihood: bool = False,
    posterior_predictive: bool = False,
    var_names: Sequence[str] | None = None,
    max_coords_per_var: int | None = None,
    seed: int = 0,
    dims: Mapping[str, Sequence[str]] | None = None,
    coords: Mapping[str, Sequence] | None = None,
    grouped_by_chain: bool = False,
    probe: Sequence | None = None,
) -> xr.DataTree:
    """Convert draws of a Bayesian network's weights into an ArviZ ``DataTree``.

    Example::

        idata = bdl.to_arviz(mcmc, model=model, model_args=(test_loader, n_train),
                             log_likelihood=True, max_coords_per_var=100)
        arviz_stats.summary(idata)

    :param source: a run ``pyro.infer.MCMC`` (with an SGMCMC kernel of pyro_bdl or any
        other), a :class:`~pyro_bdl.inference.sgmcmc.chains.Chains`, a fitted guide
        (needs ``num_samples``), a dict of draws shaped ``(draw, *shape)`` as
        ``mcmc.get_samples()`` returns them (one chain), or ``(chain, draw, *shape)`` with
        ``grouped_by_chain=True``, as ``mcmc.get_samples(group_by_chain=True)``, or the
        path of a kernel's ``checkpoint`` directory (or one chain's): its chains' draw
        stores are opened lazily (dask-backed, merged by chain) with the groups
        ``posterior`` and ``sample_stats``, so :func:`pyro_bdl.diagnostics.summary`
        streams them from disk.
    :param int num_samples: draws to take from a guide (stored as chain 0), each copied to
        the CPU as it is drawn: the device holds one draw, whatever ``num_samples``.
    :param callable model: the Pyro model, for ``log_likelihood`` and
        ``posterior_predictive`` (default: the kernel's model).
    :param model_args: the model's arguments for those groups; DataLoaders are iterated
        once, batch by batch. For a guide, also the arguments its sampling needs.
    :param dict model_kwargs: keyword arguments, likewise.
    :param bool log_likelihood: add pointwise log likelihoods of the observed sites.
    :param bool posterior_predictive: add posterior predictive draws of the observed
        sites, and ``observed_data``.
    :param var_names: keep only these latent sites.
    :param int max_coords_per_var: keep at most this many entries of each site, chosen
        at random (reproducibly, from ``seed`` and the site name); the kept flat indices
        are the coordinate ``<site>_index``.
    :param int seed: seed of that choice and of guide sampling.
    :param dict dims: named dimensions per site (ArviZ ``dims``).
    :param dict coords: coordinate values for those dimensions.
    :param bool grouped_by_chain: whether a dict source has a leading chain dimension
        (Pyro's ``group_by_chain=True``); never guessed from the shapes.
    :param tuple probe: the model's arguments on a batch of probe inputs (e.g.
        ``((x_test[:64], None), num_data)``): adds the group ``function_space`` with the
        class probabilities ``probs`` ``(chain, draw, probe, class)`` of every draw
        (:func:`pyro_bdl.diagnostics.network_outputs`). Without it, an MCMC or Chains run
        of an SGMCMC kernel on a lifted network gets the outputs its kernel followed on
        its own probe batch (``probs``, or ``outputs`` for a likelihood's means or a
        choice of a large output).
    :return: an ``xarray.DataTree``.
    """
    # Every keyword, checked at the call (locals() holds just the arguments here).
    model_kwargs = _check_arguments(**{k: v for k, v in locals().items() if k != "source"})
    if isinstance(var_names, str):
        var_names = [var_names]
    if isinstance(source, (str, os.PathLike)):
        return _open_store(
            source,
            var_names,
            {
                "log_likelihood": log_likelihood,
                "posterior_predictive": posterior_predictive,
                "max_coords_per_var": max_coords_per_var is not None,
                "probe": probe is not None,
                "num_samples": num_samples is not None,
                "model": model is not None,
            },
        )
    samples, stats, attrs, approximation, model, chain_ids = _read_source(
        source, num_samples, model, model_args, model_kwargs, seed, grouped_by_chain
    )
    if var_names is not None:
        unknown = sorted(set(var_names) - set(samples))
        if unknown:
            raise ValueError(f"var_names: {unknown} are not sites of the draws {sorted(samples)}")
    if (log_likelihood or posterior_predictive) and model is None:
        raise ValueError("log_likelihood / posterior_predictive need model=<the Pyro model>")
    groups = {}
    kept = {name: samples[name] for name in (var_names or samples)}
    posterior, posterior_dims, posterior_coords = _subset_coords(kept, max_coords_per_var, seed)
    groups["posterior"] = _dataset(
        posterior, {**posterior_dims, **(dims or {})}, {**posterior_coords, **(coords or {})}
    )
    if stats:
        groups["sample_stats"] = _dataset(stats, {}, {})
    if log_likelihood or posterior_predictive:
        pointwise = _pointwise(model, samples, model_args, model_kwargs, posterior_predictive)
        if log_likelihood:
            groups["log_likelihood"] = _dataset(pointwise["log_likelihood"], {}, {})
        if posterior_predictive:
            groups["posterior_predictive"] = _dataset(pointwise["posterior_predictive"], {}, {})
            observed = {k: v[np.newaxis, np.newaxis] for k, v in pointwise["observed"].items()}
            groups["observed_data"] = _dataset(observed, {}, {}).squeeze(
                ("chain", "draw"), drop=True
            )
    outputs = _function_space_outputs(source, samples, model, probe)
    if outputs is not None:
        groups["function_space"] = _dataset(*outputs)
    if approximation:
        groups["approximation"] = xr.Dataset(
            {name: (_plain_dims(name, value.shape), value) for name, value in approximation.items()}
        )
    if chain_ids != list(range(len(chain_ids))):  # a torchrun rank other than 0: some chains
        groups = {
            name: group.assign_coords(chain=chain_ids) if "chain" in group.dims else group
            for name, group in groups.items()
        }
    return _tree(groups, attrs)


def _function_space_outputs(source, samples, model, probe) -> tuple | None:
    """``(data, dims, coords)`` of the ``function_space`` group, or None: the outputs on
    ``probe``, else those the source's SGMCMC kernel followed for all its chains."""
    if probe is not None:
        if model is None:
            raise ValueError("probe needs model=<the Pyro model> (it returns the logits)")
        probs = network_outputs(model, *probe, samples=samples)
        return {"probs": probs}, {"probs": ["probe", "class"]}, {}
    # an MCMC or Chains run of an SGMCMC kernel on a lifted network
    monitor = getattr(getattr(source, "kernel", None), "function_monitor", None)
    if monitor is None:
        return None
    outputs = monitor.outputs()
    shape = next(iter(samples.values())).shape[:2]
    if outputs is None or outputs.shape[:2] != shape:
        return None  # chains run elsewhere (Pyro's worker processes, other ranks)
    if outputs.ndim == 3:
        return {"outputs": outputs}, {"outputs": ["output"]}, {}
    name = "probs" if monitor.probabilities else "outputs"
    dims = ["probe", *(["class"] if monitor.probabilities else [])]
    dims += [f"{name}_dim_{i}" for i in range(outputs.ndim - 2 - len(dims))]
    return {name: outputs}, {name: dims}, {}


def _tree(groups: Mapping[str, xr.Dataset], attrs: Mapping) -> xr.DataTree:
    """The DataTree of ``groups``, every group carrying the run's attributes."""
    tree = xr.DataTree.from_dict(groups)
    tree.attrs.update(
        _netcdf_attrs(
            {
                **attrs,
                "inference_library": "pyro_bdl",
                "inference_library_version": __version__,
            }
        )
    )
    for group in groups:
        tree[group].attrs.update(tree.attrs)
    return tree


# -- a checkpoint's draw stores, opened lazily ------------------------------------------


def _open_store(path, var_names: Sequence[str] | None, unsupported: Mapping[str, bool]):
    """The stored chains under a checkpoint directory as a dask-backed DataTree."""
    asked = [name for name, value in unsupported.items() if value]
    if asked:
        raise ValueError(
            f"to_arviz(path): {asked} need the draws in memory; a store is opened lazily "
            "with its posterior and sample_stats only (load a subset and pass the dict)"
        )
    # A chain's saved state says how many of its written draws are final (a run killed
    # between writing draws and its state leaves a few more); without one, take them all.
    states = {
        directory: read_state(directory / "state.safetensors")[1]
        for directory in chain_directories(path)
        if (directory / "state.safetensors").exists()
    }
    stored = open_tree(path, {d: state["num_draws"] for d, state in states.items()})
    posterior = stored["posterior"].to_dataset()
    if var_names is not None:
        unknown = sorted(set(var_names) - set(posterior.data_vars))
        if unknown:
            raise ValueError(
                f"var_names: {unknown} are not sites of the draws {sorted(posterior.data_vars)}"
            )
        posterior = posterior[list(var_names)]
    stats = stored["sample_stats"].to_dataset()
    for key, name in _STAT_NAMES.items():
        if key in stats:  # ArviZ's lp is the log density, the negated potential energy
            stats = stats.rename({key: name})
            stats[name] = -stats[name]
    settings = next(iter(states.values()), {}).get("settings", {})
    attrs = {
        **{key: value for key, value in settings.items() if key != "sites"},
        "num_chains": posterior.sizes["chain"],
        "num_samples": posterior.sizes["draw"],
    }
    return _tree({"posterior": posterior, "sample_stats": stats}, attrs)


# -- reading the source -----------------------------------------------------------------


def _read_source(source, num_samples, model, model_args, model_kwargs, seed, grouped_by_chain):
    """(samples, sample_stats, attrs, approximation, model, chain_ids) of any method's result,
    through the :class:`~pyro_bdl.posterior.Posterior` interface (a dict of draws becomes a
    :class:`~pyro_bdl.posterior.DrawsPosterior`)."""
    if isinstance(source, Mapping):  # raw draws, checked here, where their errors are named
        source = DrawsPosterior(
            model, _checked_draws(source, grouped_by_chain), grouped_by_chain=True
        )
    posterior = as_posterior(source, model=model, caller="to_arviz")
    drawn = posterior.draws(num_samples, *model_args, seed=seed, **model_kwargs)
    stats = {
        _STAT_NAMES.get(key, key): (-1 if key == "potential_energy" else 1) * np.asarray(value)
        for key, value in drawn.sample_stats.items()
    }
    approximation = {name: value.numpy() for name, value in drawn.approximation.items()}
    return (
        _numpy(drawn.samples),
        stats,
        drawn.attrs,
        approximation,
        model or getattr(posterior, "model", None),
        drawn.chain_ids,
    )


def _check_arguments(
    *,
    num_samples,
    model,
    model_args,
    model_kwargs,
    log_likelihood,
    posterior_predictive,
    var_names,
    max_coords_per_var,
    seed,
    dims,
    coords,
    grouped_by_chain,
    probe,
) -> dict:
    """Every keyword of :func:`to_arviz` checked at the call; the model's kwargs as a dict."""
    if probe is not None and (isinstance(probe, (str, bytes)) or not isinstance(probe, Sequence)):
        raise TypeError(
            "probe must be a tuple of the model's arguments on a batch of inputs, got "
            f"{type(probe).__name__}"
        )
    if num_samples is not None:
        integer("num_samples", num_samples, low=1)
    if model is not None:
        function("model", model, "a callable Pyro model or None")
    if isinstance(model_args, (str, bytes)) or not isinstance(model_args, Sequence):
        raise TypeError(
            f"model_args must be a tuple of the model's arguments, got {type(model_args).__name__}"
        )
    if model_kwargs is not None:
        instance("model_kwargs", model_kwargs, Mapping, "a dict of keyword arguments or None")
    for name, value in (
        ("log_likelihood", log_likelihood),
        ("posterior_predictive", posterior_predictive),
        ("grouped_by_chain", grouped_by_chain),
    ):
        instance(name, value, bool, "True or False")
    if var_names is not None and not isinstance(var_names, str):
        if not isinstance(var_names, Sequence) or not all(isinstance(v, str) for v in var_names):
            raise TypeError(f"var_names must be a list of site names (str), got {var_names!r}")
        if not var_names:
            raise ValueError("var_names must name at least one site, got an empty list")
    if max_coords_per_var is not None:
        integer("max_coords_per_var", max_coords_per_var, low=1)
    integer("seed", seed, low=0)
    for name, value in (("dims", dims), ("coords", coords)):
        if value is not None:
            instance(name, value, Mapping, "a dict (or None)")
    for site, names in (dims or {}).items():
        if isinstance(names, str) or not all(isinstance(n, str) for n in names):
            raise TypeError(
                f"dims[{site!r}] must be a list of dimension names (str), got {names!r}"
            )
    return dict(model_kwargs or {})


def _checked_draws(source: Mapping, grouped_by_chain: bool) -> dict[str, np.ndarray]:
    """A dict of draws as numpy arrays ``(chain, draw, *shape)``, its shapes checked."""
    if not source:
        raise ValueError("to_arviz: source, the dict of draws, is empty")
    for name, value in source.items():
        if not isinstance(name, str):
            raise TypeError(
                f"to_arviz: the keys of source, a dict of draws, must be site names, got {name!r}"
            )
        if not (torch.is_tensor(value) or isinstance(value, np.ndarray)):
            raise TypeError(
                f"to_arviz: source[{name!r}] must be a tensor or numpy array of draws, got "
                f"{type(value).__name__}"
            )
    samples = _numpy(source)
    leading = 2 if grouped_by_chain else 1
    layout = "(chain, draw, ...)" if grouped_by_chain else "(draw, ...)"
    for name, value in samples.items():
        if value.ndim < leading or 0 in value.shape[:leading]:
            raise ValueError(
                f"to_arviz: source[{name!r}] has shape {value.shape}; a dict of draws is "
                f"{layout}"
                + (
                    ""
                    if grouped_by_chain
                    else " (pass grouped_by_chain=True for (chain, draw, ...))"
                )
            )
        if not np.issubdtype(value.dtype, np.number) and value.dtype != bool:
            raise TypeError(f"to_arviz: source[{name!r}] has dtype {value.dtype}, not numbers")
    sizes = {name: value.shape[:leading] for name, value in samples.items()}
    if len(set(sizes.values())) > 1:
        raise ValueError(
            f"to_arviz: the sites of source have different numbers of draws {layout[:-6]}): {sizes}"
        )
    if not grouped_by_chain:
        samples = {name: value[np.newaxis] for name, value in samples.items()}
    return samples


def _numpy(samples: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {
        name: value.detach().cpu().numpy() if torch.is_tensor(value) else np.asarray(value)
        for name, value in samples.items()
    }


# -- building datasets ------------------------------------------------------------------


def _subset_coords(samples, max_coords_per_var, seed):
    """Keep at most ``max_coords_per_var`` entries per site, reproducibly."""
    if max_coords_per_var is None:
        return samples, {}, {}
    kept, dims, coords = {}, {}, {}
    for name, value in samples.items():
        size = int(np.prod(value.shape[2:], dtype=int))
        if size <= max_coords_per_var:
            kept[name] = value
            continue
        # The seed mixes in a stable hash of the name (Python's hash() is salted).
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        index = np.sort(rng.choice(size, max_coords_per_var, replace=False))
        kept[name] = value.reshape(*value.shape[:2], size)[..., index]
        dims[name] = [f"{name}_index"]
        coords[f"{name}_index"] = index
    return kept, dims, coords


def _dataset(data, dims, coords) -> xr.Dataset:
    return arviz_base.dict_to_dataset(
        data, dims=dims, coords=coords, sample_dims=["chain", "draw"], check_conventions=False
    )


def _plain_dims(name: str, shape: tuple) -> list[str]:
    return [f"{name}_dim_{i}" for i in range(len(shape))]


def _netcdf_attrs(attrs: Mapping) -> dict:
    """Attributes netCDF can store: numbers and strings (others as JSON strings)."""
    stored = {}
    for key, value in attrs.items():
        if isinstance(value, (bool, np.bool_)):
            stored[key] = int(value)
        elif isinstance(value, (int, float, str, np.integer, np.floating)):
            stored[key] = value
        else:
            stored[key] = json.dumps(value, default=str)
    return stored


# -- pointwise log likelihood and predictions -------------------------------------------


def _pointwise(model, samples, model_args, model_kwargs, predict: bool) -> dict:
    """Per-draw, per-example log likelihood and predictive draws of observed sites."""
    num_chains, num_draws = next(iter(samples.values())).shape[:2]
    batches = list(Minibatches(tuple(model_args), model_kwargs).one_pass())
    log_lik, predictive, observed = {}, {}, {}
    for chain in range(num_chains):
        for draw in range(num_draws):
            values = {name: torch.as_tensor(v[chain, draw]) for name, v in samples.items()}
            per_batch = [_observed_sites(model, values, a, k, predict) for a, k in batches]
            for name in per_batch[0]:
                log_prob, predicted, obs = (
                    np.concatenate([b[name][i] for b in per_batch]) for i in range(3)
                )
                log_lik.setdefault(name, np.empty((num_chains, num_draws, *log_prob.shape)))
                log_lik[name][chain, draw] = log_prob
                if predict:
                    predictive.setdefault(
                        name, np.empty((num_chains, num_draws, *predicted.shape), predicted.dtype)
                    )
                    predictive[name][chain, draw] = predicted
                    observed[name] = obs
    if not log_lik:
        raise ValueError(
            "log_likelihood / posterior_predictive: the model observes nothing when called "
            "with these model_args and model_kwargs; pass the observations (e.g. the labels) "
            "in model_args"
        )
    return {"log_likelihood": log_lik, "posterior_predictive": predictive, "observed": observed}


def _observed_sites(model, values, args, kwargs, predict: bool) -> dict:
    """Observed site -> (per-example log likelihood, predicted value, observed value)."""
    # uncondition inside condition: the observed sites are sampled (the prediction,
    # keeping the observation in infer["obs"]) while the latent sites stay at the draw.
    # The draws are on the CPU; condition_on_sites moves each to its site's device.
    runnable = pyro.poutine.uncondition(model) if predict else model
    with torch.no_grad():
        trace = pyro.poutine.trace(condition_on_sites(runnable, values)).get_trace(*args, **kwargs)
    sites = {}
    for name, site in trace.nodes.items():
        if site["type"] != "sample" or name in values or site_is_subsample(site):
            continue
        observed = site["infer"].get("obs") if predict else site["value"]
        if observed is None or not (site["is_observed"] or predict):
            continue
        # The site's distribution already sums non-batch dimensions (bdl.observe's
        # to_event), so its log_prob is per example, unscaled by N / B.
        log_prob = site["fn"].log_prob(observed)
        sites[name] = (
            log_prob.cpu().numpy(),
            site["value"].cpu().numpy(),
            observed.cpu().numpy(),
        )
    return sites
