import numpy as np
import pytest
import torch

from pyro_bdl import metrics, plots

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_png(path):
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000


@pytest.fixture
def classification():
    generator = torch.Generator().manual_seed(0)
    probs = torch.softmax(3 * torch.randn(200, 4, generator=generator, dtype=torch.float64), -1)
    labels = torch.randint(0, 4, (200,), generator=generator)
    return probs, labels


def test_reliability_diagram_writes_a_png(tmp_path, classification):
    probs, labels = classification
    results = {
        "SGHMC": (probs, labels),
        "MAP": metrics.reliability_curve(probs**2 / (probs**2).sum(-1, keepdim=True), labels),
    }
    path = plots.reliability_diagram(results, tmp_path / "figures" / "rel.png", title="toy")
    assert path == tmp_path / "figures" / "rel.png"
    assert_png(path)


def test_uncertainty_histograms_write_a_png(tmp_path):
    rng = np.random.default_rng(0)
    scores = {
        "total": (rng.normal(size=100), rng.normal(1.0, size=50)),
        "epistemic": (torch.rand(100), torch.rand(80) + 0.5),
    }
    assert_png(plots.plot_uncertainty_histograms(scores, tmp_path / "ood.png"))
    single = {"epistemic": (rng.normal(size=30), rng.normal(size=30))}
    assert_png(plots.plot_uncertainty_histograms(single, tmp_path / "one.png"))


def test_bad_input_is_rejected(tmp_path, classification):
    probs, labels = classification
    with pytest.raises(ValueError, match="results must map at least one method name"):
        plots.reliability_diagram({}, tmp_path / "rel.png")
    with pytest.raises(TypeError, match=r"results\['MAP'\] must be \(probs, labels\)"):
        plots.reliability_diagram({"MAP": probs}, tmp_path / "rel.png")
    with pytest.raises(ValueError, match="path must end in .png"):
        plots.reliability_diagram({"MAP": (probs, labels)}, tmp_path / "rel.pdf")
    with pytest.raises(ValueError, match="labels must be in"):
        plots.reliability_diagram({"MAP": (probs, labels + 4)}, tmp_path / "rel.png")
    with pytest.raises(TypeError, match=r"scores\['eu'\] must be a pair"):
        plots.plot_uncertainty_histograms({"eu": np.ones(3)}, tmp_path / "ood.png")
    with pytest.raises(ValueError, match="two non-empty 1-D arrays"):
        plots.plot_uncertainty_histograms({"eu": (np.ones(3), np.ones((2, 2)))}, tmp_path / "o.png")
    assert not list(tmp_path.glob("*.png"))


def test_reliability_diagram_draws_one_panel_per_method_and_marks_sparse_bins(
    tmp_path, classification, monkeypatch
):
    """Two axes (accuracy, counts) per method; a bin with few predictions is hatched."""
    from matplotlib.figure import Figure

    probs, labels = classification
    drawn = {}
    save = Figure.savefig

    def keep(figure, *args, **kwargs):
        drawn["figure"] = figure
        return save(figure, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    results = {name: (probs, labels) for name in ("MAP", "LA", "BLoB", "ENS", "SGHMC")}
    assert_png(plots.reliability_diagram(results, tmp_path / "rel.png", min_count=10))
    axes = drawn["figure"].axes
    assert len(axes) == 2 * len(results)
    titles = [ax.get_title() for ax in axes[::2]]
    curve = metrics.reliability_curve(probs, labels)
    assert titles[0] == f"MAP\nECE {curve.ece:.3f}, n = 200"
    sparse = int(((curve.count > 0) & (curve.count < 10)).sum())
    assert sparse > 0  # the toy data have sparse bins
    hatched = [patch for patch in axes[0].patches if patch.get_hatch() == "///"]
    assert len(hatched) == sparse


@pytest.mark.parametrize("panels", [1, 2, 3])
def test_the_reliability_legend_is_never_cut_at_the_edge(tmp_path, classification, panels):
    """Issue 35: with one panel (the demo's digits figure) the legend ran past both edges
    of the canvas. Now every edge of the PNG is background: nothing is cut."""
    from matplotlib.image import imread

    results = {f"method {i}": classification for i in range(panels)}
    image = imread(plots.reliability_diagram(results, tmp_path / "rel.png", title="toy"))
    border = np.concatenate([image[:3].ravel(), image[-3:].ravel()])
    border = np.concatenate([border, image[:, :3].ravel(), image[:, -3:].ravel()])
    assert border.min() == 1.0  # white (RGBA), a drawn pixel is darker
