"""Summaries of draws per Stan parameter, and the verdict on a run against the reference.

A summary gives, for each parameter (Stan's name, ``beta[1]``), the mean, the sd, the bulk
ESS (:func:`pyro_bdl.diagnostics.ess_bulk`) and the Monte Carlo standard errors of the mean
and of the sd (:func:`arviz_stats.mcse`), over draws shaped ``(chain, draw)``. A run is
**right** when every parameter's mean is within ``MEAN_TOLERANCE`` reference sds of the
reference mean and its sd within ``SD_TOLERANCE`` (relative) of the reference sd (issue 33).
"""

from __future__ import annotations

import math

import arviz_stats
import numpy as np

from pyro_bdl.diagnostics import ess_bulk

__all__ = [
    "MEAN_TOLERANCE",
    "SD_TOLERANCE",
    "agreement",
    "summarise",
]

#: A run's mean may differ from the reference mean by this many reference sds.
MEAN_TOLERANCE = 0.3
#: A run's sd may differ from the reference sd by this fraction of it.
SD_TOLERANCE = 0.25


def summarise(draws: dict[str, np.ndarray]) -> dict[str, dict[str, float]]:
    """Per parameter: ``mean``, ``sd``, ``ess_bulk``, ``mcse_mean``, ``mcse_sd``.

    :param dict draws: Stan parameter name -> draws shaped ``(chain, draw)``.
    """
    summary = {}
    for name, values in draws.items():
        values = np.asarray(values, dtype=np.float64)
        summary[name] = {
            "mean": float(values.mean()),
            "sd": float(values.std(ddof=1)),
            "ess_bulk": float(ess_bulk(values[..., None], num_threads=1)[0]),
            "mcse_mean": float(arviz_stats.mcse(values, method="mean")),
            "mcse_sd": float(arviz_stats.mcse(values, method="sd")),
        }
    return summary


def agreement(
    summary: dict[str, dict[str, float]],
    reference: dict[str, dict[str, float]],
    mean_tolerance: float | dict[str, float] = MEAN_TOLERANCE,
    sd_tolerance: float | dict[str, float] = SD_TOLERANCE,
) -> dict:
    """Compare a run's summary with the reference's, parameter by parameter.

    :return: ``worst_mean`` (the largest ``|mean - reference mean|`` in reference sds) and
        ``worst_mean_at`` (its parameter), ``sd_ratio`` (the smallest and largest ``sd /
        reference sd``), ``worst_sd_at`` (the parameter whose ratio is furthest from 1),
        ``right`` (all within the tolerances).

    :param dict summary: the run's, from :func:`summarise`.
    :param dict reference: the reference's, with the same parameters.
    :param mean_tolerance: allowed ``|mean - reference mean| / reference sd``, one for all
        parameters or one per parameter.
    :param sd_tolerance: allowed ``|sd / reference sd - 1|``, likewise.
    """
    missing = sorted(set(reference) - set(summary))
    if missing:
        raise ValueError(f"summary: no draws of the reference parameters {missing}")
    worst_mean, worst_sd, ratios, right = -1.0, -1.0, [], True
    result = {}
    for name, ref in reference.items():
        ours = summary[name]
        distance = abs(ours["mean"] - ref["mean"]) / ref["sd"]
        ratio = ours["sd"] / ref["sd"]
        if not (math.isfinite(distance) and math.isfinite(ratio)):
            distance = ratio = math.inf
        ratios.append(ratio)
        if distance > worst_mean:
            worst_mean, result["worst_mean_at"] = distance, name
        if abs(ratio - 1) > worst_sd:
            worst_sd, result["worst_sd_at"] = abs(ratio - 1), name
        right &= distance <= _per(mean_tolerance, name) and abs(ratio - 1) <= _per(
            sd_tolerance, name
        )
    result.update(worst_mean=worst_mean, sd_ratio=[min(ratios), max(ratios)], right=bool(right))
    return result


def _per(tolerance: float | dict[str, float], name: str) -> float:
    return tolerance[name] if isinstance(tolerance, dict) else tolerance
