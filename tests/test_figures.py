"""Figures a paper can use: whole-number layer ticks (1 layer and 31 layers), legends inside the saved
figure and off the panels, labels in words, intervals on every curve and heat-map cell, bin counts on
reliability diagrams, single-label transfer cells marked. Figures are drawn from small hand-made tables
and cells (Agg backend) and inspected through the figure objects they saved."""
from __future__ import annotations

import re

import numpy as np
import pandas as pd
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.collections import LineCollection

from experiments import plots, transfer
from extract.statements import TRILEMMA

INTEGER = re.compile(r"^[-\u2212]?\d+$")


@pytest.fixture
def saved(monkeypatch):
    """The figures saved while the test runs; read them after the call (drawn again: closing a figure
    took its canvas)."""
    figures, savefig = [], Figure.savefig

    def record(fig, *args, **kw):
        savefig(fig, *args, **kw)
        figures.append(fig)

    monkeypatch.setattr(Figure, "savefig", record)

    def drawn():
        for fig in figures:
            FigureCanvasAgg(fig).draw()
        return figures

    return drawn


def layer_table(layers: list[int], n_layers: int, probes=("linear", "mean_diff")) -> pd.DataFrame:
    rng = np.random.default_rng(0)
    rows = [{"probe": p, "task": t, "split": "entity_disjoint", "layer": k, "n_layers": n_layers,
             "mcc": m, "mcc_lo": m - 0.1, "mcc_hi": m + 0.1, "wmcc": 0.8 * m, "aurc": 0.1}
            for p in probes for t in ("true_vs_all", "multiclass") for k in layers for m in [rng.uniform(0.2, 0.8)]]
    table = pd.DataFrame(rows)
    table["layer"] = table["layer"].astype("Int64")
    return table


def visible_ticks(ax) -> list[str]:
    lo, hi = sorted(ax.get_xlim())
    return [t.get_text() for t in ax.get_xticklabels() if lo <= t.get_position()[0] <= hi and t.get_text()]


def texts(fig) -> list[str]:
    found = [t.get_text() for t in fig.findobj(lambda a: hasattr(a, "get_text"))]
    return [t for t in found if t]


def overlaps(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def assert_legends_whole(fig) -> None:
    """Every legend lies inside the figure and off every panel."""
    renderer = fig.canvas.get_renderer()
    legends = list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend()]
    assert legends
    for legend in legends:
        box = legend.get_window_extent(renderer)
        assert fig.bbox.x0 - 1 <= box.x0 and box.x1 <= fig.bbox.x1 + 1
        assert fig.bbox.y0 - 1 <= box.y0 and box.y1 <= fig.bbox.y1 + 1
        assert not any(overlaps(box, ax.get_window_extent(renderer)) for ax in fig.axes)


@pytest.mark.parametrize("layers,n_layers", [(list(range(31)), 30), ([0, 1, 2], 2), ([1], 1)])
def test_layer_axis_has_whole_number_ticks(saved, tmp_path, layers, n_layers):
    plots.metric_by_layer(layer_table(layers, n_layers), tmp_path / "mcc.png", "toy")
    fig, = saved()
    layer_axes = [ax for ax in fig.axes if ax.get_xlabel() == "layer"]
    assert layer_axes
    for ax in layer_axes:
        ticks = visible_ticks(ax)
        assert ticks and all(INTEGER.match(t) for t in ticks), ticks
        assert len(ticks) <= 10
        if len(layers) == 1:
            assert ticks == ["1"]
    for ax in fig.axes:
        if ax.get_xlabel().startswith("relative depth"):
            assert ax.get_xlim()[0] <= 0 and ax.get_xlim()[1] >= 1   # the whole depth, even for one layer
    assert_legends_whole(fig)


def test_one_layer_is_drawn_as_markers_with_its_interval(saved, tmp_path):
    plots.metric_by_layer(layer_table([1], 1), tmp_path / "mcc.png", "toy")
    fig, = saved()
    ax = fig.axes[0]
    drawn = [line for line in ax.get_lines() if len(line.get_xdata()) == 1]
    assert drawn and all(line.get_markersize() >= 6 for line in drawn)
    bars = [c for c in ax.collections if isinstance(c, LineCollection) and len(c.get_segments()) == 1]
    assert bars, "the interval of a single layer is drawn as a bar"


def test_labels_are_words_and_many_legend_entries_stay_off_the_panels(saved, tmp_path):
    table = layer_table([0, 1, 2], 2, probes=[f"probe{i}" for i in range(9)])
    plots.metric_by_layer(table, tmp_path / "mcc.png", "toy")
    fig, = saved()
    words = texts(fig)
    assert "W-MCC (MCC x acceptance)" in words and "MCC (accepted statements)" in words
    assert not any(re.search(r"\bw?mcc\b|_vs_", t) for t in words), words
    assert_legends_whole(fig)


def cell(n: int, seed: int, layer: int | None = 3) -> dict:
    """A cell's test block and metrics: n statements of 3 labels, probabilities right about 80 % of the time."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, n)
    probs = rng.dirichlet(np.ones(3), n)
    right = rng.random(n) < 0.8
    probs[right, y[right]] += 2
    probs /= probs.sum(1, keepdims=True)
    from evaluation.selective import selective_metrics

    return {"layer": layer, "test": {"y": y.tolist(), "probs": probs.tolist(), "groups": (np.arange(n) // 2).tolist()},
            "metrics": {"n_boot": 200, "seed": 0, "bootstrap": "cluster", "ci_level": 0.95,
                        **selective_metrics(y, probs)}}


def test_risk_coverage_has_a_band_per_curve_and_legends_off_the_panels(saved, tmp_path):
    cells = {("linear", "multiclass"): cell(300, 0), ("mlp", "multiclass"): cell(300, 1),
             ("linear", "true_vs_all"): cell(200, 2)}
    plots.risk_coverage(cells, {("zero_shot", "multiclass"): cell(300, 3, layer=None)}, tmp_path / "rc.png", "toy")
    fig, = saved()
    for ax in fig.axes:
        curves = [line for line in ax.get_lines() if len(line.get_xdata()) > 1]
        assert len(ax.collections) == len(curves) > 0
    assert fig.axes[0].get_xlabel() == "coverage (share of statements accepted)"
    assert_legends_whole(fig)
    one = cells["linear", "multiclass"]
    lo, hi = plots.risk_band(one)
    assert np.all(lo <= hi) and np.any(hi - lo > 0)
    assert lo[-1] <= one["metrics"]["risk_coverage"]["risk"][-1] <= hi[-1]   # all accepted: the error rate


def test_reliability_shows_the_statements_in_each_bin(saved, tmp_path):
    cells = {"linear": cell(250, 0), "mlp": cell(250, 1)}
    plots.reliability(cells, tmp_path / "rel.png", "toy", n_bins=10)
    fig, = saved()
    counts_axes = [ax for ax in fig.axes if ax.get_xlabel()]   # the bottom row, one per probe
    assert len(counts_axes) == len(cells) and counts_axes[0].get_ylabel() == "statements"
    for probe, c in cells.items():
        conf = np.asarray(c["test"]["probs"]).max(1)
        counts = np.bincount(np.clip(np.ceil(conf * 10).astype(int) - 1, 0, 9), minlength=10)
        expected = sorted(counts[counts > 0].tolist())
        ax = counts_axes[sorted(cells).index(probe)]
        assert sorted(round(p.get_height()) for p in ax.patches) == expected
        assert sorted(int(t.get_text()) for t in ax.texts) == expected
    assert_legends_whole(fig)


def test_transfer_heat_map_prints_intervals_and_marks_single_label_cells(saved, tmp_path):
    rows = [{"probe": probe, "task": "multiclass", "train": a, "eval": b, "mcc": 0.0 if one else 0.5,
             "mcc_lo": 0.0 if one else 0.41, "mcc_hi": 0.0 if one else 0.58, "single_label": one}
            for probe in ("linear", "mean_diff") for a in TRILEMMA for b in TRILEMMA
            for one in [a != b and probe == "linear"]]
    transfer.heat_maps(pd.DataFrame(rows), list(TRILEMMA), tmp_path / "transfer.png", "toy, multiclass")
    fig, = saved()
    cells = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert len(cells) == len(rows)
    assert sum("(one label)" in t for t in cells) == sum(r["single_label"] for r in rows)
    assert all("\n[" in t for t in cells)
    assert sum("0.50\n[0.41, 0.58]" in t for t in cells) == sum(not r["single_label"] for r in rows)
    heat = [ax for ax in fig.axes if ax.get_xlabel() == "evaluated on"]
    assert len(heat) == 2 and heat[0].get_ylabel() == "trained on"


def test_acceptance_is_drawn_under_the_mcc_and_depth_is_an_axis_not_a_repeated_row(saved, tmp_path):
    table = layer_table([0, 1, 2, 3], 3)
    table["acceptance"] = np.linspace(0.2, 0.9, len(table))
    plots.metric_by_layer(table, tmp_path / "mcc.png", "toy")
    fig, = saved()
    panels = [ax for ax in fig.axes if ax.get_xlabel() == "layer"]
    assert len(panels) == table["task"].nunique()          # one row of layer axes: the acceptance row's
    bottom = [ax for ax in fig.axes if ax.get_ylabel().startswith("acceptance")]
    assert bottom
    drawn = sorted(round(float(v), 6) for ax in panels for line in ax.get_lines() if len(line.get_xdata()) > 1
                   for v in line.get_ydata())
    assert drawn == sorted(round(float(v), 6) for v in table["acceptance"])
    assert "relative depth (layer / L)" in texts(fig)      # the top axis of the metric row, for one model
    assert not [ax for ax in fig.axes if ax.get_xlabel() == "relative depth (layer / L)" and ax in panels]
    assert_legends_whole(fig)


def test_the_reliability_axis_starts_at_the_lowest_top_label_confidence(saved, tmp_path):
    three = cell(250, 0)
    two = cell(250, 1)
    probs = np.asarray(two["test"]["probs"])[:, :2]
    two["test"]["probs"] = (probs / probs.sum(1, keepdims=True)).tolist()
    two["test"]["y"] = np.minimum(two["test"]["y"], 1).tolist()
    for cells, lo in (({"mlp": three}, 0.3), ({"linear": two}, 0.5)):
        plots.reliability(cells, tmp_path / "rel.png", "toy", n_bins=10)
        fig = saved()[-1]
        assert fig.axes[0].get_xlim()[0] == pytest.approx(lo)
