"""PNG figures for the experiments: reliability diagrams and out-of-distribution histograms.

Figures are drawn on a bare :class:`matplotlib.figure.Figure` rendered by Agg, never through
``pyplot``: nothing is displayed, no global backend is switched, and nothing stays open.

Example::

    reliability_diagram({"SGHMC": (probs, labels), "MAP": (map_probs, labels)}, "rel.png")
    plot_uncertainty_histograms({"epistemic": (eu_in, eu_ood)}, "ood.png")
"""

from __future__ import annotations

import os
from collections.abc import ItemsView, Mapping
from pathlib import Path

import numpy as np
import torch
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import NullLocator

from pyro_bdl.metrics import ReliabilityCurve, auroc, reliability_curve

__all__ = ["plot_uncertainty_histograms", "reliability_diagram"]

_PANEL_SIZE = 4.0  # inches per panel side
_DPI = 120


def reliability_diagram(
    results: Mapping[str, tuple | ReliabilityCurve],
    path: str | os.PathLike,
    title: str | None = None,
    num_bins: int = 15,
    min_count: int = 10,
) -> Path:
    """Draw one reliability panel per method: accuracy against confidence, bin by bin.

    Each panel shows the accuracy of every confidence bin as a bar beside the diagonal of
    perfect calibration, the method's ECE and number of predictions in its title, and
    below it how many predictions fall in each bin (log scale). Bins with fewer than
    ``min_count`` predictions are drawn hatched and pale: their accuracy is too noisy to
    read. The panels share their axes, so methods compare at a glance.

    Example::

        reliability_diagram(
            {"SGHMC": (probs, labels), "MAP": reliability_curve(map_probs, labels)},
            "figures/reliability.png",
            title="IMDB",
        )

    :param results: method name to ``(probs, labels)`` (see :func:`pyro_bdl.metrics.ece`) or
        to a precomputed :class:`~pyro_bdl.metrics.ReliabilityCurve`.
    :type results: dict
    :param path: where to write the PNG (parent folders are created).
    :type path: str or os.PathLike
    :param str title: figure title.
    :param int num_bins: confidence bins for entries given as ``(probs, labels)``.
    :param int min_count: bins with fewer predictions are drawn as unreliable.
    :returns: the path written.
    :rtype: pathlib.Path
    """
    curves = {
        name: _as_curve(name, value, num_bins)
        for name, value in _nonempty(results, "results", "(probs, labels) or a ReliabilityCurve")
    }
    path = _png_path(path)
    columns = min(len(curves), 3 if len(curves) <= 6 else 4)
    rows = -(-len(curves) // columns)
    fig = Figure(
        figsize=(0.8 * _PANEL_SIZE * columns, 1.1 * _PANEL_SIZE * rows),
        dpi=_DPI,
        layout="constrained",
    )
    grid = fig.add_gridspec(2 * rows, columns, height_ratios=(3, 1) * rows)
    for index, (name, curve) in enumerate(curves.items()):
        row, column = divmod(index, columns)
        curve_ax = fig.add_subplot(grid[2 * row, column])
        count_ax = fig.add_subplot(grid[2 * row + 1, column], sharex=curve_ax)
        _reliability_panel(curve_ax, count_ax, name, curve, min_count)
        if column:
            curve_ax.tick_params(labelleft=False)
        else:
            curve_ax.set_ylabel("accuracy")
            count_ax.set_ylabel("count")
    if title:
        fig.suptitle(title)
    # One legend row across three or more panels, one entry a row under fewer; the saved
    # canvas grows to whatever the legend needs, so no label is ever cut at the edge.
    legend = _reliability_legend(min_count)
    fig.legend(handles=legend, loc="outside lower center", ncols=3 if columns >= 3 else 1)
    fig.savefig(path, format="png", bbox_inches="tight", pad_inches=0.1)
    return path


_BAR_COLOUR = "tab:blue"


def _reliability_legend(min_count: int) -> list:
    return [
        Line2D([], [], color="grey", linestyle="--", linewidth=1, label="calibrated"),
        Patch(
            color=_BAR_COLOUR, label=f"accuracy of a confidence bin (>= {min_count} predictions)"
        ),
        Patch(
            facecolor="none",
            edgecolor=_BAR_COLOUR,
            hatch="///",
            alpha=0.5,
            label=f"bin with < {min_count} predictions",
        ),
    ]


def _reliability_panel(curve_ax, count_ax, name, curve, min_count) -> None:
    edges = curve.bin_edges.numpy()
    left, width = edges[:-1], np.diff(edges)
    count = curve.count.numpy()
    accuracy = np.nan_to_num(curve.accuracy.numpy())
    solid, sparse = count >= min_count, (count > 0) & (count < min_count)
    colour = _BAR_COLOUR
    curve_ax.plot([0, 1], [0, 1], color="grey", linestyle="--", linewidth=1)
    curve_ax.bar(
        left[solid],
        accuracy[solid],
        width[solid],
        align="edge",
        color=colour,
        edgecolor="white",
    )
    curve_ax.bar(
        left[sparse],
        accuracy[sparse],
        width[sparse],
        align="edge",
        facecolor="none",
        edgecolor=colour,
        hatch="///",
        alpha=0.5,
    )
    total = int(count.sum())
    curve_ax.set(xlim=(0, 1), ylim=(0, 1), title=f"{name}\nECE {curve.ece:.3f}, n = {total}")
    curve_ax.title.set_fontsize("medium")
    curve_ax.tick_params(labelbottom=False)
    count_ax.bar(left[count > 0], count[count > 0], width[count > 0], align="edge", color=colour)
    count_ax.axhline(min_count, color="grey", linewidth=0.8, linestyle=":")
    count_ax.set(yscale="log", xlabel="confidence", ylim=(0.8, max(2.0, total) * 1.5))
    count_ax.yaxis.set_minor_locator(NullLocator())  # log-scale minor ticks: seconds of layout


def plot_uncertainty_histograms(
    scores: Mapping[str, tuple],
    path: str | os.PathLike,
    bins: int = 30,
    labels: tuple[str, str] = ("in-distribution", "out-of-distribution"),
) -> Path:
    """Histogram an uncertainty score on in- and out-of-distribution inputs, one panel each.

    Each panel title gives the AUROC of the score for detecting out-of-distribution inputs
    (:func:`pyro_bdl.metrics.auroc` with those inputs as positives).

    Example::

        u_in = uncertainty_decomposition(probs_in)
        u_ood = uncertainty_decomposition(probs_ood)
        plot_uncertainty_histograms(
            {"total": (u_in.total, u_ood.total), "epistemic": (u_in.epistemic, u_ood.epistemic)},
            "figures/ood.png",
        )

    :param scores: panel name to ``(in_dist_scores, ood_scores)``, each one-dimensional.
    :type scores: dict
    :param path: where to write the PNG (parent folders are created).
    :type path: str or os.PathLike
    :param int bins: histogram bins per panel, shared by both distributions.
    :param tuple labels: legend labels of the two distributions.
    :returns: the path written.
    :rtype: pathlib.Path
    """
    panels = [
        (name, *_as_score_pair(name, value))
        for name, value in _nonempty(scores, "scores", "(in_dist_scores, ood_scores)")
    ]
    path = _png_path(path)
    fig = Figure(
        figsize=(_PANEL_SIZE * len(panels), 0.75 * _PANEL_SIZE), dpi=_DPI, layout="constrained"
    )
    axes = np.atleast_1d(fig.subplots(1, len(panels)))
    for ax, (name, in_dist, ood) in zip(axes, panels, strict=True):
        both = np.concatenate([in_dist, ood])
        area = auroc(both, np.concatenate([np.zeros(len(in_dist)), np.ones(len(ood))]))
        edges = np.histogram_bin_edges(both, bins=bins)
        for values, label in zip((in_dist, ood), labels, strict=True):
            ax.hist(values, bins=edges, alpha=0.6, density=True, label=label)
        ax.set(title=f"{name}: AUROC {area:.3f}", xlabel=name, ylabel="density")
    axes[0].legend(fontsize="small")
    fig.savefig(path, format="png")
    return path


def _nonempty(mapping: Mapping, name: str, expected: str) -> ItemsView:
    if not isinstance(mapping, Mapping) or not mapping:
        raise ValueError(f"{name} must map at least one method name to {expected}, got {mapping!r}")
    return mapping.items()


def _png_path(path: str | os.PathLike) -> Path:
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise ValueError(f"path must end in .png, got {str(path)!r}")
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _as_curve(name: str, value: tuple | ReliabilityCurve, num_bins: int) -> ReliabilityCurve:
    if isinstance(value, ReliabilityCurve):
        return value
    if isinstance(value, tuple) and len(value) == 2:
        return reliability_curve(*value, num_bins=num_bins)
    raise TypeError(
        f"results[{name!r}] must be (probs, labels) or a ReliabilityCurve, "
        f"got {type(value).__name__}"
    )


def _as_score_pair(name: str, value: tuple) -> tuple[np.ndarray, np.ndarray]:
    if not (isinstance(value, tuple) and len(value) == 2):
        raise TypeError(
            f"scores[{name!r}] must be a pair (in_dist_scores, ood_scores), "
            f"got {type(value).__name__}"
        )
    pair = tuple(
        np.asarray(v.detach().cpu() if isinstance(v, torch.Tensor) else v, dtype=np.float64)
        for v in value
    )
    if any(v.ndim != 1 or v.size == 0 for v in pair):
        raise ValueError(
            f"scores[{name!r}] must hold two non-empty 1-D arrays, got shapes "
            f"{[v.shape for v in pair]}"
        )
    return pair
