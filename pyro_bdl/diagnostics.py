"""Vectorised, chunked MCMC convergence diagnostics for posteriors with millions of coordinates.

Rank-normalised split R-hat and bulk / tail effective sample size (ESS) of Vehtari et al.
(2021), computed exactly as :mod:`arviz_stats` computes them (its defaults: ``rhat`` with
``method="rank"``, ``ess`` with ``method="bulk"`` and ``method="tail"``), including its
conventions for ties, constant coordinates (R-hat ``nan`` or ``inf``, ESS equal to the number
of draws) and coordinates containing ``nan`` (every diagnostic ``nan``).

We re-implement rather than call :mod:`arviz_stats` because it applies a scalar function to
one coordinate at a time, at about 0.7 ms per coordinate for the three diagnostics (4 chains
of 100 draws): over ten minutes for a network with a million weights. Here every step
(ranking, FFT autocovariance, Geyer's truncation of the autocorrelation sum) is one numpy
operation over a block of ``chunk_size`` coordinates, blocks run in parallel threads, and
memory stays bounded by the blocks in flight: about 35 us of CPU per coordinate, a million
coordinates in under half a minute on two cores (``benchmarks/diagnostics.py``).

For a network, R-hat of the weights is the wrong question (symmetric modes make the same
predictions): :func:`function_space` computes R-hat and ESS of the network's outputs on
fixed probe inputs (:func:`network_outputs`) and the agreement of the chains' predictive
distributions (:func:`agreement`, :func:`total_variation`), as Izmailov et al. (2021).

**References**

[1] Vehtari, A., Gelman, A., Simpson, D., Carpenter, B. and Buerkner, P.-C. (2021).
Rank-normalization, folding, and localization: an improved R-hat for assessing
convergence of MCMC. *Bayesian Analysis* 16(2), 667-718.
[2] Geyer, C. J. (1992). Practical Markov chain Monte Carlo. *Statistical Science* 7(4).
"""

from __future__ import annotations

import itertools
import math
import os
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch
from scipy.fft import irfft, next_fast_len, rfft
from scipy.special import ndtri

from pyro_bdl._checks import instance, integer, one_of, probability

if TYPE_CHECKING:
    # xarray (with pandas) takes a third as long to import as Pyro, and the samplers import
    # this module for its ESS: only summary() imports it, when called.
    import pandas as pd
    import xarray as xr

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_NUM_THREADS",
    "FUNCTION_MAX_RHAT",
    "FunctionSpace",
    "agreement",
    "Diagnostics",
    "diagnose",
    "ess_bulk",
    "ess_tail",
    "function_space",
    "independent_max_rhat",
    "network_outputs",
    "rhat",
    "summary",
    "total_variation",
]

#: Coordinates processed together by one thread: small enough to stay in cache for 4 x 100
#: draws, and about 30 MB per temporary array for 4 x 1,000 draws.
DEFAULT_CHUNK_SIZE = 1024
#: Chunks processed in parallel; numpy and scipy.fft release the GIL, so threads scale.
DEFAULT_NUM_THREADS = min(8, os.cpu_count() or 1)
#: Memory one block of a variable stored on disk may take while ``summary`` streams it.
STREAM_BLOCK_BYTES = 64 * 2**20
_MIN_DRAWS = 4
_BLOM_OFFSET = 3 / 8
# arviz treats a coordinate whose draws span less than this as constant.
_CONSTANT_RESOLUTION = np.finfo(float).resolution
# What ``summary`` reports, in arviz's order and names; r_hat is our rhat.
_SUMMARY_STATS = {
    "mean": "mean",
    "sd": "sd",
    "ess_bulk": "ess_bulk",
    "ess_tail": "ess_tail",
    "rhat": "r_hat",
}
# Statistics defined for any number of draws, unlike the diagnostics.
_MOMENTS = ("mean", "sd")


class Diagnostics(NamedTuple):
    """Rank-normalised split R-hat, bulk ESS and tail ESS, each shaped like the coordinates."""

    rhat: np.ndarray
    ess_bulk: np.ndarray
    ess_tail: np.ndarray


def rhat(
    samples: np.ndarray | torch.Tensor,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    num_threads: int = DEFAULT_NUM_THREADS,
) -> np.ndarray:
    r"""Rank-normalised split R-hat, the larger of the bulk and the folded (tail) R-hat.

    Each chain is split in half (the middle draw of an odd chain is dropped), the draws are
    replaced by normal scores of their pooled ranks :math:`z = \Phi^{-1}((r - 3/8) / (S + 1/4))`,
    and with :math:`M` split chains of :math:`N` draws, :math:`B = N \operatorname{var}_m
    \bar z_m` and :math:`W = \operatorname{mean}_m s^2_m`,

    .. math:: \hat R = \sqrt{(B / W + N - 1) / N}.

    The tail version does the same with :math:`|x - \operatorname{median}(x)|`. Matches
    ``arviz_stats.rhat(..., method="rank")``. A single chain is split in halves too and
    gets an R-hat (Pyro's ``split_gelman_rubin`` does so; arviz_stats returns ``nan``):
    it compares the chain's first half with its second. See [1] in the module docstring.

    Example::

        samples = np.random.default_rng(0).normal(size=(4, 100, 10))
        rhat(samples)  # shape (10,), all close to 1

    :param samples: draws shaped ``(chain, draw, *coords)``; at least 4 draws, otherwise
        the result is ``nan``.
    :type samples: numpy.ndarray or torch.Tensor
    :param int chunk_size: number of coordinates processed at once by each thread.
    :param int num_threads: number of chunks processed in parallel.
    :returns: R-hat shaped ``coords``.
    :rtype: numpy.ndarray
    """
    (values,) = _diagnose(samples, ("rhat",), chunk_size=chunk_size, num_threads=num_threads)
    return values


def ess_bulk(
    samples: np.ndarray | torch.Tensor,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    num_threads: int = DEFAULT_NUM_THREADS,
) -> np.ndarray:
    r"""Bulk effective sample size: the ESS of the rank-normalised split chains.

    With :math:`\hat\rho_t` the autocorrelation at lag :math:`t` pooled over chains
    (autocovariances by FFT), :math:`S` draws in all and Geyer's initial monotone sequence
    truncating the sum at the first pair :math:`\hat\rho_{2K} + \hat\rho_{2K+1}` that is not
    positive,

    .. math:: \mathrm{ESS} = S / \hat\tau, \quad \hat\tau = -1 + 2 \sum_{t \le 2K - 1}
              \hat\rho_t + \hat\rho_{2K}, \quad \hat\tau \ge 1 / \log_{10} S.

    Matches ``arviz_stats.ess(..., method="bulk")``. See [1, 2] in the module docstring.

    Example::

        samples = np.random.default_rng(0).normal(size=(4, 100, 10))
        ess_bulk(samples)  # shape (10,), near 400 for independent draws

    :param samples: draws shaped ``(chain, draw, *coords)``; at least 4 draws, otherwise the
        result is ``nan``.
    :type samples: numpy.ndarray or torch.Tensor
    :param int chunk_size: number of coordinates processed at once by each thread.
    :param int num_threads: number of chunks processed in parallel.
    :returns: bulk ESS shaped ``coords``.
    :rtype: numpy.ndarray
    """
    (values,) = _diagnose(samples, ("ess_bulk",), chunk_size=chunk_size, num_threads=num_threads)
    return values


def ess_tail(
    samples: np.ndarray | torch.Tensor,
    prob: float | tuple[float, float] | None = None,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    num_threads: int = DEFAULT_NUM_THREADS,
) -> np.ndarray:
    r"""Tail effective sample size: the smaller ESS of two quantile indicators.

    .. math:: \mathrm{ESS}_\text{tail} = \min\big(\mathrm{ESS}(\mathbb 1[x \le q_{lo}]),
              \mathrm{ESS}(\mathbb 1[x \le q_{hi}])\big)

    with :math:`q` the pooled sample quantiles (numpy's ``"linear"`` method) and the ESS of
    the split indicator chains as in :func:`ess_bulk`. Matches
    ``arviz_stats.ess(..., method="tail")`` with its default ``prob``. See [1].

    Example::

        samples = np.random.default_rng(0).normal(size=(4, 100, 10))
        ess_tail(samples)  # shape (10,)

    :param samples: draws shaped ``(chain, draw, *coords)``; at least 4 draws.
    :type samples: numpy.ndarray or torch.Tensor
    :param prob: a probability ``p`` for the quantiles ``(1 - p, p)``, or the pair of
        quantile levels ``(lo, hi)``; by default ``arviz_base.rcParams["stats.ci_prob"]``
        (0.89), as arviz.
    :type prob: float or tuple
    :param int chunk_size: number of coordinates processed at once by each thread.
    :param int num_threads: number of chunks processed in parallel.
    :returns: tail ESS shaped ``coords``.
    :rtype: numpy.ndarray
    """
    (values,) = _diagnose(
        samples, ("ess_tail",), prob, chunk_size=chunk_size, num_threads=num_threads
    )
    return values


def diagnose(
    samples: np.ndarray | torch.Tensor,
    prob: float | tuple[float, float] | None = None,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    num_threads: int = DEFAULT_NUM_THREADS,
) -> Diagnostics:
    """:func:`rhat`, :func:`ess_bulk` and :func:`ess_tail` in one pass over the draws.

    Cheaper than the three calls: R-hat and the bulk ESS share one ranking of each chunk.

    Example::

        samples = np.random.default_rng(0).normal(size=(4, 100, 1000))
        d = diagnose(samples)
        bad = (d.rhat > 1.01) | (d.ess_bulk < 400)

    :param samples: draws shaped ``(chain, draw, *coords)``.
    :type samples: numpy.ndarray or torch.Tensor
    :param prob: tail probability, as in :func:`ess_tail`.
    :type prob: float or tuple
    :param int chunk_size: number of coordinates processed at once by each thread.
    :param int num_threads: number of chunks processed in parallel.
    :rtype: Diagnostics
    """
    return Diagnostics(
        *_diagnose(
            samples, Diagnostics._fields, prob, chunk_size=chunk_size, num_threads=num_threads
        )
    )


def summary(
    idata: xr.DataTree | xr.Dataset,
    var_names: Sequence[str] | None = None,
    *,
    group: str = "posterior",
    prob: float | tuple[float, float] | None = None,
    fmt: str = "xarray",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    num_threads: int = DEFAULT_NUM_THREADS,
) -> xr.Dataset | pd.DataFrame:
    """Posterior mean, sd, bulk / tail ESS and R-hat of every coordinate, at scale.

    The scalable counterpart of ``arviz_stats.summary(idata, kind="all")`` restricted to
    ``mean``, ``sd`` (``ddof=0``), ``ess_bulk``, ``ess_tail`` and ``r_hat``, with the same
    values. Use it on posteriors with millions of weights. A posterior opened lazily from
    disk (``bdl.to_arviz(checkpoint_dir)``, dask-backed) is streamed: one block of
    coordinates over all chains and draws (at most ``STREAM_BLOCK_BYTES``) is read at a
    time, so draws larger than memory are summarised in bounded memory.

    Example::

        import arviz_base
        idata = arviz_base.from_dict({"posterior": {"w": np.random.randn(4, 100, 256, 128)}})
        stats = summary(idata)
        stats["w"].sel(summary="r_hat").max()

    :param idata: an ArviZ ``DataTree`` (for instance from :func:`pyro_bdl.to_arviz`) or the
        ``Dataset`` of one group, with ``chain`` and ``draw`` dimensions.
    :type idata: xarray.DataTree or xarray.Dataset
    :param var_names: variables to summarise; all of the group's variables by default.
    :type var_names: list of str or None
    :param str group: the group of a ``DataTree`` to summarise.
    :param prob: tail probability, as in :func:`ess_tail`.
    :type prob: float or tuple
    :param str fmt: ``"xarray"`` (default): a ``Dataset`` in which each variable gains a leading
        ``summary`` dimension labelled ``mean, sd, ess_bulk, ess_tail, r_hat``; ``"dataframe"``:
        a ``pandas.DataFrame`` with one row per coordinate, as ``arviz_stats.summary`` prints
        (building its row labels costs far more than the diagnostics on large posteriors).
    :param int chunk_size: number of coordinates processed at once by each thread.
    :param int num_threads: number of chunks processed in parallel.
    :rtype: xarray.Dataset or pandas.DataFrame
    """
    import xarray as xr

    one_of("fmt", fmt, ("xarray", "dataframe"))
    instance("group", group, str, "the name of a group (str)")
    dataset = _select_variables(_group_dataset(idata, group), var_names)
    result = xr.Dataset(
        {
            name: _summarise_variable(array, prob, chunk_size, num_threads)
            for name, array in dataset.data_vars.items()
        }
    )
    if fmt == "dataframe":
        from arviz_base import dataset_to_dataframe

        return dataset_to_dataframe(result, sample_dims=["summary"]).T
    return result


# ---------------------------------------------------------------------------------------------
# Input handling and chunking


def _as_draws(samples: np.ndarray | torch.Tensor) -> np.ndarray:
    """A numpy view (no float64 copy of the whole posterior) of ``samples``, validated."""
    if not isinstance(samples, (torch.Tensor, np.ndarray)):
        raise TypeError(
            "samples must be a numpy array or torch tensor shaped (chain, draw, *coords), got "
            f"{type(samples).__name__}"
        )
    if isinstance(samples, torch.Tensor):
        samples = samples.detach().cpu()
        if samples.dtype == torch.bfloat16:  # numpy has no bfloat16
            samples = samples.float()
        samples = samples.numpy()
    samples = np.asarray(samples)
    if samples.ndim < 2:
        raise ValueError(
            "samples must be shaped (chain, draw, *coords); add a chain dimension with "
            f"samples[None] for a single chain, got shape {samples.shape}"
        )
    if not (np.issubdtype(samples.dtype, np.number) or samples.dtype == bool):
        raise TypeError(f"samples must be numeric, got dtype {samples.dtype}")
    if np.iscomplexobj(samples):
        raise TypeError(f"samples must be real, got dtype {samples.dtype}")
    if 0 in samples.shape[:2]:
        raise ValueError(f"samples has no draws: shape {samples.shape} (chain, draw, ...)")
    return samples


def _diagnose(
    samples: np.ndarray | torch.Tensor,
    wanted: Sequence[str],
    prob: float | tuple[float, float] | None = None,
    *,
    chunk_size: int,
    num_threads: int,
) -> np.ndarray:
    """The ``wanted`` statistics of every coordinate, stacked: ``(len(wanted), *coords)``.

    ``wanted`` names come from ``rhat``, ``ess_bulk``, ``ess_tail``, ``mean`` and ``sd``.
    Chunks of float64 blocks ``(coords, chain, draw)`` are cut from ``samples`` inside the
    worker threads (numpy and scipy.fft release the GIL), so at most ``num_threads`` chunks
    are in memory. As in arviz, a coordinate with a ``nan`` draw gets ``nan``, and too few
    chains or draws give ``nan`` diagnostics.
    """
    chunk_size = integer("chunk_size", chunk_size, low=1)
    num_threads = integer("num_threads", num_threads, low=1)
    # arviz_base (for the default tail probability) loads xarray: only when asked for.
    levels = _tail_levels(prob) if "ess_tail" in wanted else None
    draws = _as_draws(samples)
    num_chains, num_draws, *coord_shape = draws.shape
    flat = draws.reshape(num_chains, num_draws, -1)
    out = np.full((len(wanted), flat.shape[-1]), np.nan)
    if num_draws < _MIN_DRAWS:
        _warn_too_short(num_chains, num_draws)
    computed = [name for name in wanted if name in _MOMENTS or num_draws >= _MIN_DRAWS]
    rows = [list(wanted).index(name) for name in computed]

    def fill(start: int) -> None:
        block = np.ascontiguousarray(
            flat[:, :, start : start + chunk_size].transpose(2, 0, 1), dtype=np.float64
        )
        # errstate is thread-local; constant coordinates legitimately divide 0 by 0.
        with np.errstate(divide="ignore", invalid="ignore"):
            values = _diagnose_chunk(block, computed, levels)
        has_nan = np.isnan(block).any(axis=(1, 2))
        out[rows, start : start + block.shape[0]] = np.where(has_nan, np.nan, values)

    starts = range(0, flat.shape[-1], chunk_size) if computed else range(0)
    if num_threads == 1 or len(starts) <= 1:
        for start in starts:
            fill(start)
    else:
        with ThreadPoolExecutor(num_threads) as pool:
            list(pool.map(fill, starts))  # list() re-raises a worker's exception
    return out.reshape(len(wanted), *coord_shape)


def _warn_too_short(num_chains: int, num_draws: int) -> None:
    warnings.warn(
        f"samples has {num_chains} chain(s) of {num_draws} draws; the diagnostics need at "
        f"least {_MIN_DRAWS} draws and are nan",
        stacklevel=4,
    )


def _tail_levels(prob: float | tuple[float, float] | None) -> tuple[float, float]:
    """Quantile levels of the tail ESS, ordered as arviz orders them."""
    if prob is None:
        from arviz_base import rcParams

        prob = rcParams["stats.ci_prob"]
    if isinstance(prob, (str, bytes)) or (isinstance(prob, Sequence) and len(prob) != 2):
        raise TypeError(
            "prob must be a probability p in (0, 1] or a pair of quantile levels in [0, 1], "
            f"got {prob!r}"
        )
    if isinstance(prob, Sequence):
        return probability("prob[0]", prob[0]), probability("prob[1]", prob[1])
    prob = probability("prob", prob, open_low=True)
    low, high = sorted((prob, 1 - prob))
    return low, high


# ---------------------------------------------------------------------------------------------
# Per-chunk numerics; every array is (coords, chain, draw) in float64


def _diagnose_chunk(
    x: np.ndarray, wanted: Sequence[str], levels: tuple[float, float]
) -> np.ndarray:
    """The ``wanted`` statistics of one chunk, sharing the ranking and the sort."""
    results = {"mean": x.mean(axis=(1, 2))} if "mean" in wanted else {}
    if "sd" in wanted:
        results["sd"] = x.std(axis=(1, 2))  # ddof=0, as arviz's summary
    split = _split_chains(x)
    ordered = None
    if "rhat" in wanted or "ess_bulk" in wanted:
        z_bulk, ordered = _z_scale(split)
        if "rhat" in wanted:
            results["rhat"] = _rank_rhat(split, z_bulk, ordered)
        if "ess_bulk" in wanted:
            results["ess_bulk"] = _ess(z_bulk)
    if "ess_tail" in wanted:
        # The quantiles are of all draws; the split draws are the same multiset unless a
        # middle draw was dropped.
        if ordered is None or x.shape[-1] % 2:
            ordered = np.sort(x.reshape(x.shape[0], -1), axis=-1)
        results["ess_tail"] = _ess_tail(split, ordered, levels)
    return np.stack([results[name] for name in wanted])


def _split_chains(x: np.ndarray) -> np.ndarray:
    """Halve each chain (dropping the middle draw of an odd chain): (c, 2 * chain, draw // 2)."""
    half = x.shape[-1] // 2
    return np.concatenate((x[..., :half], x[..., x.shape[-1] - half :]), axis=1)


def _z_scale(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Normal scores of the ranks pooled over chains and draws (Blom's offset 3/8).

    Also returns each coordinate's draws sorted, a by-product that the median and the
    quantiles reuse.
    """
    doubled_ranks, ordered = _doubled_average_ranks(x.reshape(x.shape[0], -1))
    size = ordered.shape[-1]
    # Ranks are multiples of 1/2, so the normal scores come from a table of 2 * size + 1
    # values instead of an ndtri per draw; the table entries are arviz's expression exactly.
    ranks = np.arange(2 * size + 1) / 2
    scores = ndtri((ranks - _BLOM_OFFSET) / (size - 2 * _BLOM_OFFSET + 1))
    z = scores[doubled_ranks]
    # nan sorts last; like scipy's rankdata(nan_policy="omit") it gets no score. (Input
    # coordinates with nan are discarded anyway; this is for |inf - inf| when folding.)
    if np.isnan(ordered[:, -1]).any():
        z[np.isnan(x.reshape(z.shape))] = np.nan
    return z.reshape(x.shape), ordered


def _doubled_average_ranks(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Twice the 1-based ranks along the last axis, ties sharing their average, and ``x`` sorted.

    Equal to ``2 * scipy.stats.rankdata(x, method="average", axis=-1)`` (integers), several
    times faster.
    """
    num_rows, size = x.shape
    order = np.argsort(x, axis=-1)
    ordered = np.sort(x, axis=-1)  # equals x[order], and is much faster than gathering
    row_offsets = size * np.arange(num_rows)[:, None]
    starts_group = np.ones(x.shape, dtype=bool)
    starts_group[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    if starts_group.all():
        doubled = np.broadcast_to(2 * np.arange(size) + 2, x.shape)
    else:
        # A group of ties (which never spans two rows) at flat positions first..last gets
        # the average rank (first + last) / 2 + 1 relative to its row.
        flat_starts = starts_group.ravel()
        first = np.flatnonzero(flat_starts)
        last = np.append(first[1:], flat_starts.size) - 1
        group = np.cumsum(flat_starts) - 1
        doubled = (first + last)[group].reshape(x.shape) - 2 * row_offsets + 2
    ranks = np.empty(x.size, dtype=np.intp)
    ranks[(order + row_offsets).ravel()] = doubled.ravel()
    return ranks.reshape(x.shape), ordered


def _sorted_quantile(ordered: np.ndarray, level: float) -> np.ndarray:
    """numpy's ``"linear"`` quantile of each row of an already sorted array."""
    size = ordered.shape[-1]
    virtual = (size - 1) * level
    below = min(int(np.floor(virtual)), size - 1)
    above = min(below + 1, size - 1)
    gamma = virtual - below
    a, b = ordered[:, below], ordered[:, above]
    # numpy's _lerp: interpolate from the nearer end so that gamma = 1 returns b exactly.
    return b - (b - a) * (1 - gamma) if gamma >= 0.5 else a + (b - a) * gamma


def _rank_rhat(split: np.ndarray, z_bulk: np.ndarray, ordered: np.ndarray) -> np.ndarray:
    """max(bulk, tail) R-hat of the split draws, given their z-scores and sorted values."""
    middle = ordered.shape[-1] // 2  # split chains always hold an even number of draws
    median = (ordered[:, middle - 1] + ordered[:, middle]) / 2
    bulk = _split_rhat(z_bulk)
    tail = _split_rhat(_z_scale(np.abs(split - median[:, None, None]))[0])
    # arviz takes the builtin max(bulk, tail), which keeps ``bulk`` unless ``tail > bulk``
    # (so a nan tail never hides a finite or infinite bulk value).
    return np.where(tail > bulk, tail, bulk)


def _ess_tail(split: np.ndarray, ordered: np.ndarray, levels: tuple[float, float]) -> np.ndarray:
    """min of the ESS of the split indicators ``x <= q``, at the two quantile levels."""
    low, high = (_ess(split <= _sorted_quantile(ordered, level)[:, None, None]) for level in levels)
    # arviz takes the builtin min(low, high), which keeps ``low`` unless ``high < low``.
    return np.where(high < low, high, low)


def _split_rhat(z: np.ndarray) -> np.ndarray:
    """Potential scale reduction of chains ``z``, shaped (coords, chain, draw)."""
    num_draws = z.shape[-1]
    between = num_draws * np.var(z.mean(axis=-1), axis=-1, ddof=1)
    within = np.var(z, axis=-1, ddof=1).mean(axis=-1)
    return np.sqrt((between / within + num_draws - 1) / num_draws)


def _ess(y: np.ndarray) -> np.ndarray:
    """Effective sample size of chains ``y`` (coords, chain, draw), Geyer-truncated."""
    y = y.astype(np.float64, copy=False)
    _, num_chains, num_draws = y.shape
    size = num_chains * num_draws
    acov = _mean_autocov(y)
    mean_var = acov[:, 0] * num_draws / (num_draws - 1.0)
    var_plus = mean_var * (num_draws - 1.0) / num_draws
    if num_chains > 1:
        var_plus = var_plus + np.var(y.mean(axis=-1), axis=-1, ddof=1)
    rho = 1.0 - (mean_var[:, None] - acov) / var_plus[:, None]
    rho[:, 0] = 1.0
    tau = _geyer_tau(rho)
    min_tau = 1 / np.log10(size)
    ess = size / np.where(min_tau > tau, min_tau, tau)
    ess = np.where(np.isnan(rho).any(axis=-1), np.nan, ess)
    constant = np.ptp(y, axis=(1, 2)) < _CONSTANT_RESOLUTION
    return np.where(constant, float(size), ess)


def _mean_autocov(y: np.ndarray) -> np.ndarray:
    """Autocovariance at every lag by FFT, averaged over chains: (coords, draw)."""
    num_draws = y.shape[-1]
    fft_len = next_fast_len(2 * num_draws)
    spectrum = rfft(y - y.mean(axis=-1, keepdims=True), n=fft_len, axis=-1)
    # The inverse FFT is linear, so average the power spectra over chains before inverting.
    power = (spectrum.real**2 + spectrum.imag**2).mean(axis=1)
    return irfft(power, n=fft_len, axis=-1)[:, :num_draws] / num_draws


def _geyer_tau(rho: np.ndarray) -> np.ndarray:
    r"""Integrated autocorrelation time from autocorrelations ``rho`` (coords, lag).

    Geyer's initial positive sequence stops at the first pair :math:`P_k = \rho_{2k} +
    \rho_{2k+1} \le 0` (or at the arviz lag limit), the initial monotone sequence replaces the
    pair sums kept by their running minimum, and arviz adds the even lag of the stopping pair:
    :math:`\tau = -1 + 2 \sum_{k < K} \min_{j \le k} P_j + \rho_{2K}` where ``rho_2K`` counts
    only if positive or if :math:`P_K \ge 0`.
    """
    num_coords, num_lags = rho.shape
    max_pairs = max(0, (num_lags - 3) // 2)
    even = rho[:, 0 : 2 * max_pairs + 1 : 2]
    pairs = even + rho[:, 1 : 2 * max_pairs + 2 : 2]
    if max_pairs == 0:
        stop = np.zeros(num_coords, dtype=np.intp)
    else:
        positive = pairs[:, :max_pairs] > 0
        stop = np.where(positive.all(axis=-1), max_pairs, np.argmin(positive, axis=-1))
    kept = np.arange(max_pairs) < stop[:, None]
    monotone = np.minimum.accumulate(np.where(kept, pairs[:, :max_pairs], np.inf), axis=-1)
    pair_sum = np.where(kept, monotone, 0.0).sum(axis=-1)
    rows = np.arange(num_coords)
    even_last, pair_last = even[rows, stop], pairs[rows, stop]
    last = np.where((even_last > 0) | (pair_last >= 0), even_last, 0.0)
    return -1.0 + 2.0 * pair_sum + last


# ---------------------------------------------------------------------------------------------
# DataTree plumbing for ``summary``


def _group_dataset(idata: xr.DataTree | xr.Dataset, group: str) -> xr.Dataset:
    import xarray as xr

    if isinstance(idata, xr.Dataset):
        return idata
    if not isinstance(idata, xr.DataTree):
        raise TypeError(
            f"idata must be an xarray.DataTree or Dataset (see pyro_bdl.to_arviz), got "
            f"{type(idata).__name__}"
        )
    if group not in idata.children:
        raise ValueError(
            f"idata has no group {group!r}; pass group= one of {sorted(idata.children)}"
        )
    return idata[group].to_dataset()


def _select_variables(dataset: xr.Dataset, var_names: Sequence[str] | None) -> xr.Dataset:
    if var_names is None:
        return dataset
    if isinstance(var_names, str):
        var_names = [var_names]
    if not isinstance(var_names, Sequence) or not all(isinstance(n, str) for n in var_names):
        raise TypeError(f"var_names must be a variable name or a list of them, got {var_names!r}")
    if not var_names:
        raise ValueError("var_names must name at least one variable, got an empty list")
    missing = [name for name in var_names if name not in dataset.data_vars]
    if missing:
        raise ValueError(
            f"var_names {missing} are not in the group; choose from {sorted(dataset.data_vars)}"
        )
    return dataset[list(var_names)]


def _summarise_variable(
    array: xr.DataArray, prob: float | tuple[float, float] | None, chunk_size: int, num_threads: int
) -> xr.DataArray:
    import xarray as xr

    if "chain" not in array.dims or "draw" not in array.dims:
        raise ValueError(
            f"variable {array.name!r} needs 'chain' and 'draw' dimensions, got {array.dims}"
        )
    array = array.transpose("chain", "draw", ...)
    wanted = tuple(_SUMMARY_STATS)
    if array.chunks is None:
        # Moments go through the chunks too: np.std of a whole float32 posterior would
        # allocate a float64 copy of it.
        stats = _diagnose(
            array.values, wanted, prob, chunk_size=chunk_size, num_threads=num_threads
        )
    else:
        stats = _diagnose_streamed(array.data, wanted, prob, chunk_size, num_threads)
    coord_dims = array.dims[2:]
    coords = {dim: array.coords[dim] for dim in coord_dims if dim in array.coords}
    return xr.DataArray(
        stats,
        dims=("summary", *coord_dims),
        coords={"summary": list(_SUMMARY_STATS.values()), **coords},
    )


# ---------------------------------------------------------------------------------------------
# Streaming a variable stored on disk (a dask-backed DataArray, e.g. ``bdl.to_arviz(path)``)


def _diagnose_streamed(
    data, wanted: Sequence[str], prob, chunk_size: int, num_threads: int
) -> np.ndarray:
    """:func:`_diagnose` of a dask array ``(chain, draw, *coords)``, a block of coordinates
    (all chains and draws) at a time, so memory stays at ``STREAM_BLOCK_BYTES`` plus the
    result, however large the posterior."""
    num_chains, num_draws, *coord_shape = data.shape
    out = np.empty((len(wanted), *coord_shape))
    entries = max(1, STREAM_BLOCK_BYTES // (num_chains * num_draws * data.dtype.itemsize))
    for block in _coordinate_blocks(coord_shape, [c[0] for c in data.chunks[2:]], entries):
        values = np.asarray(data[(slice(None), slice(None), *block)])
        out[(slice(None), *block)] = _diagnose(
            values, wanted, prob, chunk_size=chunk_size, num_threads=num_threads
        )
    return out


def _coordinate_blocks(
    shape: Sequence[int], chunks: Sequence[int], entries: int
) -> list[tuple[slice, ...]]:
    """Index blocks covering ``shape``, each of at most ``entries`` coordinates (or one
    index of every axis), cut at multiples of the stored ``chunks`` where they fit.

    Trailing axes are taken whole while they fit; the first that does not is stepped by
    the largest multiple of its chunk that fits, and the axes before it one index at a time.
    """
    steps = list(shape)
    budget = entries
    for axis in reversed(range(len(shape))):
        if shape[axis] <= budget:
            budget //= max(1, shape[axis])
            continue
        aligned = budget // chunks[axis] * chunks[axis]
        steps[axis] = max(1, aligned or budget)
        steps[:axis] = [1] * axis
        break
    ranges = [
        [slice(start, min(start + step, size)) for start in range(0, size, step)] or [slice(0, 0)]
        for size, step in zip(shape, steps)
    ]
    return list(itertools.product(*ranges))


# ---------------------------------------------------------------------------------------------
# Function space: the network's outputs on fixed inputs, not its weights


#: Split R-hat of the outputs above this says the predictive has not converged. The largest
#: of many R-hats exceeds Vehtari et al.'s 1.01 by chance alone (for 640 outputs of four
#: chains of 100 independent draws it averages 1.03); 1.1 is the threshold of Gelman et
#: al. (2013) that Izmailov et al. (2021) apply to the predictions of networks.
FUNCTION_MAX_RHAT = 1.1


class FunctionSpace(NamedTuple):
    """Convergence of a network's draws judged on its outputs (Izmailov et al. 2021).

    :ivar numpy.ndarray rhat: split R-hat of every output, shaped ``(probe, *output)``
        (``nan`` for an output that no draw changes, such as a probability that is 1.0
        in every draw).
    :ivar numpy.ndarray ess_bulk: bulk ESS of every output, likewise.
    :ivar float agreement: mean top-1 agreement of the chains' predictive distributions,
        over pairs of chains (:func:`agreement`); ``nan`` for one chain or for outputs
        that are not class probabilities.
    :ivar float total_variation: mean total-variation distance between the chains'
        predictive distributions (:func:`total_variation`); likewise.
    :ivar float independent_max_rhat: the largest split R-hat that independent draws of
        the same number of chains and draws reach over as many outputs
        (:func:`independent_max_rhat`); ``nan`` with fewer than 4 draws per chain.
    """

    rhat: np.ndarray
    ess_bulk: np.ndarray
    agreement: float
    total_variation: float
    independent_max_rhat: float

    @property
    def judgeable(self) -> bool:
        """Whether :attr:`max_rhat` can tell a chain that has not converged from independent
        draws: the largest split R-hat over the outputs of independent draws of the same
        shape is at most ``FUNCTION_MAX_RHAT``. With few draws it is not: over 1,500 outputs
        one chain of 10 independent draws has split R-hat 2.15 somewhere, the largest value
        10 draws can give (some output's halves are ranked apart by chance)."""
        return not self.independent_max_rhat > FUNCTION_MAX_RHAT

    @property
    def max_rhat(self) -> float:
        """The largest R-hat over the outputs: 1.0 if no output changes, ``nan`` with
        fewer than 4 draws per chain (R-hat is not defined)."""
        if np.isnan(self.ess_bulk).all():
            return math.nan
        return float(np.nanmax(self.rhat, initial=1.0))

    @property
    def min_ess(self) -> float:
        """The smallest bulk ESS over the outputs (``nan`` with fewer than 4 draws)."""
        if np.isnan(self.ess_bulk).all():
            return math.nan
        return float(np.nanmin(self.ess_bulk))

    def converged(self, max_rhat: float = FUNCTION_MAX_RHAT, min_ess: float = 100) -> bool:
        """Whether every output has R-hat at most ``max_rhat`` and bulk ESS at least
        ``min_ess``."""
        return self.max_rhat <= max_rhat and self.min_ess >= min_ess


def function_space(outputs: np.ndarray | torch.Tensor, *, probabilities: bool = True):
    r"""Split R-hat and bulk ESS of a network's outputs, and the agreement of its chains.

    A network's posterior is symmetric: permuting the hidden units of a layer, or flipping
    the signs of a tanh unit's weights in and out, gives other weights and the same
    function. Chains that sit in two such modes have weight-space R-hat far above 1
    and make the same predictions. What a user needs to have converged is the predictive
    distribution, so Izmailov et al. (2021) judge convergence in function space: R-hat of
    the predictions on fixed inputs over chains, and how much the chains' predictive
    distributions agree. Compute ``outputs`` with :func:`network_outputs` on a probe set
    of a few dozen inputs (test or training inputs).

    **References**

    Izmailov, P., Vikram, S., Hoffman, M. D. and Wilson, A. G. (2021). What are Bayesian
    neural network posteriors really like? *ICML*.

    Example::

        probs = network_outputs(model, (x_probe, None), num_data,
                                samples=mcmc.get_samples(group_by_chain=True))
        fs = function_space(probs)      # probs: (chain, draw, probe, class)
        fs.max_rhat, fs.min_ess, fs.agreement, fs.total_variation

    :param outputs: the outputs shaped ``(chain, draw, probe, *output)``: class
        probabilities (the default), or any real outputs (logits, a regression's mean)
        with ``probabilities=False``.
    :type outputs: numpy.ndarray or torch.Tensor
    :param bool probabilities: whether the last axis holds class probabilities; only then
        are :func:`agreement` and :func:`total_variation` defined (else ``nan``).
    :rtype: FunctionSpace
    """
    instance("probabilities", probabilities, bool, "True or False")
    draws = _as_draws(outputs)
    if draws.ndim < 3:
        raise ValueError(
            "outputs must be shaped (chain, draw, probe, *output), got shape "
            f"{draws.shape}; network_outputs returns that shape"
        )
    r_hat, ess = _diagnose(draws, ("rhat", "ess_bulk"), chunk_size=DEFAULT_CHUNK_SIZE,
                           num_threads=1)  # fmt: skip
    # An output no draw changes has converged; arviz's nan / inf for it is not a signal.
    fixed = (draws == draws[:1, :1]).all(axis=(0, 1))
    r_hat = np.where(fixed, np.nan, r_hat)
    agree = tv = np.nan
    if probabilities and draws.shape[0] > 1:
        agree, tv = agreement(draws), total_variation(draws)
    return FunctionSpace(r_hat, ess, agree, tv, independent_max_rhat(draws.shape))


#: Simulations of :func:`independent_max_rhat`.
_INDEPENDENT_REPEATS = 3


def independent_max_rhat(shape: tuple[int, ...], repeats: int = _INDEPENDENT_REPEATS) -> float:
    """The largest split R-hat over the outputs of independent draws shaped ``shape``
    (``(chain, draw, *outputs)``): the largest of ``repeats`` seeded simulations of standard
    normal draws (``nan`` with fewer than 4 draws per chain).

    R-hat of one output is a statistic with a spread; the largest over many outputs is
    above 1 even for a sampler that has converged, the more so the fewer the draws and the
    more the outputs (a multiple comparison). Outputs of a network are correlated, so
    independent ones give the largest such value: a ``max_rhat`` below it is no evidence
    against convergence.

    Example::

        independent_max_rhat((1, 10, 1500))   # 2.15: 10 draws cannot judge 1,500 outputs

    :param tuple shape: ``(chain, draw, *outputs)``.
    :param int repeats: simulations, seeded.
    :rtype: float
    """
    num_chains, num_draws, *outputs = shape
    if num_draws < _MIN_DRAWS:
        return math.nan
    generator = np.random.default_rng(0)
    size = (num_chains, num_draws, math.prod(outputs))
    largest = 1.0
    for _ in range(repeats):
        draws = generator.standard_normal(size)
        (r_hat,) = _diagnose(draws, ("rhat",), chunk_size=DEFAULT_CHUNK_SIZE, num_threads=1)
        largest = max(largest, float(np.nanmax(r_hat)))
    return largest


def agreement(probs: np.ndarray | torch.Tensor) -> float:
    r"""Top-1 agreement of the chains' predictive distributions (Izmailov et al. 2021).

    Each chain's predictive is the mean of its draws' class probabilities; two chains
    agree on an input when their predictives' most probable classes are the same. The
    result is the fraction of inputs on which they agree, averaged over pairs of chains:

    .. math:: \frac{2}{K (K - 1)} \sum_{i < j} \frac{1}{n} \sum_{x} \mathbb 1\big[
              \arg\max_c \bar p_i(c \mid x) = \arg\max_c \bar p_j(c \mid x)\big].

    1 when every chain would predict the same labels.

    Example::

        agreement(network_outputs(model, probe, num_data, samples=grouped))

    :param probs: class probabilities ``(chain, draw, probe, class)``, two chains or more.
    :type probs: numpy.ndarray or torch.Tensor
    :rtype: float
    """
    top = _chain_predictives(probs, "agreement").argmax(axis=-1)
    return _mean_over_pairs(lambda i, j: (top[i] == top[j]).mean(), len(top))


def total_variation(probs: np.ndarray | torch.Tensor) -> float:
    r"""Mean total-variation distance between the chains' predictive distributions.

    With :math:`\bar p_i(\cdot \mid x)` chain :math:`i`'s mean class probabilities,

    .. math:: \frac{2}{K (K - 1)} \sum_{i < j} \frac{1}{n} \sum_{x} \frac{1}{2}
              \sum_c \big|\bar p_i(c \mid x) - \bar p_j(c \mid x)\big|,

    0 when the chains predict the same distributions, 1 when they put their mass on
    different classes (Izmailov et al. 2021).

    Example::

        total_variation(network_outputs(model, probe, num_data, samples=grouped))

    :param probs: class probabilities ``(chain, draw, probe, class)``, two chains or more.
    :type probs: numpy.ndarray or torch.Tensor
    :rtype: float
    """
    mean = _chain_predictives(probs, "total_variation")
    return _mean_over_pairs(lambda i, j: 0.5 * np.abs(mean[i] - mean[j]).sum(-1).mean(), len(mean))


def network_outputs(model, *args, samples, **kwargs) -> np.ndarray:
    """A classifier's class probabilities on fixed inputs under every draw, by chain.

    The model runs once per draw with its latent sites set to the draw (as
    :func:`pyro_bdl.predict.predict_proba`, whose checks it shares), and the softmax of
    the logits it returns is kept: the array :func:`function_space` reads.

    Example::

        probs = network_outputs(model, (x_test[:64], None), num_data,
                                samples=mcmc.get_samples(group_by_chain=True))
        probs.shape  # (chain, draw, 64, classes)

    :param callable model: a Pyro model returning logits shaped ``(batch, classes)``.
    :param args: the model's arguments for the probe inputs (a batch, not a DataLoader).
    :param samples: the draws grouped by chain: a dict ``site -> (chain, draw, *shape)``
        (``mcmc.get_samples(group_by_chain=True)``, ``Chains.get_samples(group_by_chain=True)``)
        or an ArviZ tree or posterior with ``chain`` and ``draw`` dimensions
        (:func:`pyro_bdl.to_arviz`).
    :param kwargs: the model's keyword arguments.
    :return: probabilities ``(chain, draw, batch, classes)``, float64.
    :rtype: numpy.ndarray
    """
    from pyro_bdl._offload import _is_xarray, _posterior_group
    from pyro_bdl.predict import predict_proba

    posterior = _posterior_group(samples)
    if _is_xarray(posterior):
        shape = (posterior.sizes.get("chain", 0), posterior.sizes.get("draw", 0))
        flat = posterior  # predict_proba reads it chain by chain
    elif isinstance(samples, dict) and samples:
        values = {name: torch.as_tensor(np.asarray(v) if not torch.is_tensor(v) else v)
                  for name, v in samples.items()}  # fmt: skip
        shapes = {tuple(v.shape[:2]) for v in values.values()}
        if any(v.dim() < 2 for v in values.values()) or len(shapes) > 1:
            raise ValueError(
                "samples must be grouped by chain, each site (chain, draw, *shape) as "
                "mcmc.get_samples(group_by_chain=True) returns them; got shapes "
                f"{ {name: tuple(v.shape) for name, v in values.items()} }"
            )
        (shape,) = shapes
        flat = {name: v.reshape(-1, *v.shape[2:]) for name, v in values.items()}
    else:
        raise TypeError(
            "samples must be draws grouped by chain (a dict site -> (chain, draw, *shape), "
            f"or an ArviZ posterior), got {type(samples).__name__}"
        )
    probs = predict_proba(model, *args, samples=flat, **kwargs)
    return probs.detach().cpu().double().numpy().reshape(*shape, *probs.shape[1:])


def _chain_predictives(probs: np.ndarray | torch.Tensor, caller: str) -> np.ndarray:
    """Each chain's mean class probabilities ``(chain, probe, class)``, checked."""
    draws = _as_draws(probs)
    if draws.ndim != 4 or draws.shape[0] < 2:
        raise ValueError(
            f"{caller}: probs must be class probabilities shaped (chain, draw, probe, class) "
            f"with two chains or more, got shape {draws.shape}"
        )
    sums = draws.sum(axis=-1)
    if (draws < 0).any() or not np.allclose(sums, 1.0, atol=1e-3):
        raise ValueError(
            f"{caller}: probs must be class probabilities (non-negative, summing to 1 over "
            f"the last axis; sums range {sums.min():.3g} to {sums.max():.3g}); apply a "
            "softmax to logits first, or use network_outputs"
        )
    return draws.mean(axis=1, dtype=np.float64)


def _mean_over_pairs(score, num_chains: int) -> float:
    pairs = itertools.combinations(range(num_chains), 2)
    return float(np.mean([score(i, j) for i, j in pairs]))
