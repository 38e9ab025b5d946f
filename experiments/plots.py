"""The report's figures (matplotlib, Agg): metrics against layer, risk-coverage curves, reliability.

Every figure is drawn for a paper: axis labels and titles in words (LABELS, words), integer layer ticks
(layer_axis), every interval drawn (interval: a band, or a bar for a single layer), legends outside the
panels, and saved whole (save: constrained layout, bbox_inches="tight")."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from evaluation.metrics import as_probs, ece
from evaluation.selective import cluster_bootstrap_indices, risk_coverage as risk_coverage_curve

DPI = 120
LABELS = {"mcc": "MCC (accepted statements)", "wmcc": "W-MCC (MCC x acceptance)",
          "aurc": "AURC (lower is better)", "acceptance": "acceptance (share of statements accepted)", "ece": "ECE"}
COVERAGE_GRID = np.linspace(0, 1, 101)[1:]


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend (shared by every report module)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def words(name) -> str:
    """A task or datapack name as words: true_vs_all -> "true vs all"."""
    return str(name).replace("_", " ")


def short(metric: str) -> str:
    """A metric's name without its explanation: "W-MCC (MCC x acceptance)" -> "W-MCC"."""
    return LABELS.get(metric, metric).split(" (")[0]


def subplots(rows: int, cols: int, width: float, height: float, layout: str = "constrained", **kw):
    """A figure and its grid [rows, cols] of panels, each width x height inches, laid out so that nothing
    overlaps (layout "compressed": panels of fixed aspect, such as heat-maps)."""
    return pyplot().subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False, layout=layout, **kw)


def save(fig, path: Path, title: str) -> None:
    """Title the figure and save it whole: nothing (legend, labels) cropped."""
    fig.suptitle(title)
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    pyplot().close(fig)


def legend_below(fig, axes, loc: str = "lower center") -> None:
    """One legend under the figure for the distinct labels of all `axes` (loc "outside lower center":
    below the panels of a constrained-layout figure)."""
    labels = {}
    for ax in np.ravel(axes):
        for handle, label in zip(*ax.get_legend_handles_labels()):
            labels.setdefault(label, handle)
    fig.legend(labels.values(), labels.keys(), fontsize=8, loc=loc, ncol=min(len(labels), 6))


def layer_axis(ax, layers) -> None:
    """A layer axis with whole-number ticks only: every layer's tick for one layer, thinned for many."""
    from matplotlib.ticker import MaxNLocator

    layers = sorted({int(k) for k in layers})
    if len(layers) == 1:
        ax.set_xticks(layers)
        ax.set_xlim(layers[0] - 1, layers[0] + 1)
    else:
        ax.xaxis.set_major_locator(MaxNLocator(nbins=8, integer=True, steps=[1, 2, 5, 10]))
    ax.set_xlabel("layer")


def depth_axis(ax) -> None:
    """A relative-depth axis over the whole depth [0, 1], whatever the layers drawn."""
    ax.set_xlim(-0.03, 1.03)
    ax.set_xlabel("relative depth (layer / L)")


def line(ax, x, y, style: str, **kw) -> None:
    """A metric against layer or depth; a single point drawn as a large marker."""
    ax.plot(x, y, style, markersize=7 if len(x) == 1 else 3, **kw)


def no_signal_marks(ax, x, y, flags) -> None:
    """A cross over each point whose flag (experiments.tables.cell_flag) says no_signal: its test AUROC interval
    covers 0.5, so the value drawn there is not evidence of a representation."""
    marked = np.array(["no_signal" in str(f) for f in flags], dtype=bool)
    if marked.any():
        ax.plot(np.asarray(x, dtype=float)[marked], np.asarray(y, dtype=float)[marked], "x", color="k",
                markersize=6, label="no signal (AUROC interval covers 0.5)")


def interval(ax, x, lo, hi, color: str) -> None:
    """An interval [lo, hi] at each x: a band, or a bar where there is one x."""
    x, lo, hi = (np.asarray(v, dtype=float) for v in (x, lo, hi))
    if len(x) == 1:
        ax.vlines(x, lo, hi, color=color, linewidth=5, alpha=0.3)
    else:
        ax.fill_between(x, lo, hi, color=color, alpha=0.12, linewidth=0)


def metric_by_layer(table: pd.DataFrame, path: Path, title: str, metrics=("mcc", "wmcc")) -> None:
    """Each metric against layer (relative depth on the top axis), one panel per task, one colour per probe and
    one line style per metric (interval of the first metric drawn when present), methods without a layer
    (zero-shot) as horizontal lines; under it, when the table has `acceptance`, the share of test statements each
    probe accepts (one-label conformal sets) on the same layers: the rows the MCC above is measured on."""
    tasks = sorted(table["task"].unique())
    colours = {p: f"C{i}" for i, p in enumerate(sorted(table.loc[table["layer"].notna(), "probe"].unique()))}
    styles = ("o-", "s--", "^:")
    rows = ("metric", "acceptance") if "acceptance" in table and metrics[0] != "acceptance" else ("metric",)
    fig, axes = subplots(len(rows), len(tasks), 4.2, 3.3 if len(rows) == 1 else 2.6, sharex="col", sharey="row",
                         **({"gridspec_kw": {"height_ratios": (3, 2)}} if len(rows) == 2 else {}))
    n_layers = table["n_layers"].dropna()
    for col, task in enumerate(tasks):
        sub = table[table["task"] == task]
        for row, kind in enumerate(rows):
            ax = axes[row, col]
            drawn = metrics if kind == "metric" else ("acceptance",)
            for probe, g in sub[sub["layer"].notna()].groupby("probe"):
                g, c = g.sort_values("layer"), colours[probe]
                x = g["layer"].astype(float)
                for metric, style in zip(drawn, styles):
                    line(ax, x, g[metric].astype(float), style, color=c,
                         label=probe if metric == metrics[0] else "_nolegend_")
                    if "flag" in g:
                        no_signal_marks(ax, x, g[metric], g["flag"])
                if kind == "metric" and f"{metrics[0]}_lo" in g:
                    interval(ax, x, g[f"{metrics[0]}_lo"], g[f"{metrics[0]}_hi"], c)
            for _, z in sub[sub["layer"].isna()].iterrows():
                if kind == "metric":
                    ax.axhline(z[metrics[0]], color="k", linestyle=":", linewidth=1,
                               label=f"{z['probe']} (no layer), {short(metrics[0])}")
            if kind == "metric" and len(metrics) > 1:   # the line styles' key, in black
                for metric, style in zip(metrics, styles):
                    ax.plot([], [], style, color="k", markersize=3, label=LABELS.get(metric, metric))
            if kind == "metric":
                ax.set_title(words(task))
                if len(n_layers) and n_layers.nunique() == 1:     # one model: its relative depth on top
                    n = float(n_layers.iloc[0])
                    top = ax.secondary_xaxis("top", functions=(lambda k, n=n: k / n, lambda d, n=n: d * n))
                    top.set_xlabel("relative depth (layer / L)", fontsize=8)
            else:
                ax.set_ylim(-0.03, 1.03)
            if row == len(rows) - 1:
                layer_axis(ax, sub["layer"].dropna())
            ax.grid(alpha=0.3)
        axes[0, 0].set_ylabel(" / ".join(LABELS.get(m, m) if len(metrics) == 1 else short(m) for m in metrics))
        if len(rows) == 2:
            axes[1, 0].set_ylabel("acceptance\n(share accepted)")
    legend_below(fig, axes, "outside lower center")
    band = f"; shaded: interval of {short(metrics[0])}" if f"{metrics[0]}_lo" in table else ""
    under = "; under it: acceptance" if len(rows) == 2 else ""
    save(fig, path, f"{title}: {', '.join(short(m) for m in metrics)} by layer{band}{under}; x: no signal")


def risk_band(cell: dict, grid=COVERAGE_GRID) -> np.ndarray:
    """[2, len(grid)] bootstrap interval (the cell's level, n_boot and seed; whole groups when its
    intervals were cluster-bootstrapped) of the risk-coverage curve of a cell's test split, read at each
    coverage of `grid` at the smallest curve point whose coverage is >= it (evaluation.selective's rule)."""
    test, m = cell["test"], cell["metrics"]
    probs, y = as_probs(np.asarray(test["probs"])), np.asarray(test["y"])
    pred, conf = probs.argmax(1), probs.max(1)
    groups = np.asarray(test["groups"]) if m.get("bootstrap") == "cluster" else None
    draws = []
    for rows in cluster_bootstrap_indices(groups, m.get("n_boot", 1000), m.get("seed", 0), n=y.size):
        curve = risk_coverage_curve(y[rows], pred[rows], conf[rows])
        draws.append(np.asarray(curve["risk"])[np.searchsorted(curve["coverage"], grid - 1e-12)])
    level = m.get("ci_level", 0.95)
    return np.percentile(draws, [50 * (1 - level), 50 * (1 + level)], axis=0)


def risk_coverage(chosen: dict, behaviour: dict, path: Path, title: str) -> None:
    """chosen / behaviour: {(method, task): cell}; one panel per task, one curve per method (probes at
    their best layer solid, methods without a layer dashed) with its bootstrap band (risk_band), AURC in
    the legend under each panel."""
    tasks = sorted({t for _, t in chosen} | {t for _, t in behaviour})
    fig, axes = subplots(1, len(tasks), 4.2, 3.6, sharey=True)
    for col, task in enumerate(tasks):
        ax = axes[0, col]
        for cells, style in ((chosen, "-"), (behaviour, "--")):
            for (method, t), cell in sorted(cells.items()):
                m = cell["metrics"]
                curve = m.get("risk_coverage")
                if t != task or not curve or not curve["coverage"]:
                    continue
                layer = "" if cell.get("layer") is None else f", layer {cell['layer']}"
                drawn = ax.step(curve["coverage"], curve["risk"], style, where="pre",
                                label=f"{method}{layer} (AURC {m['aurc']:.3f})")[0]
                lo, hi = risk_band(cell)
                ax.fill_between(COVERAGE_GRID, lo, hi, step="pre", color=drawn.get_color(), alpha=0.15, linewidth=0)
        ax.set_xlim(0, 1.02)
        ax.set_xlabel("coverage (share of statements accepted)")
        ax.set_title(words(task))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2))
    axes[0, 0].set_ylabel("risk (error rate of the accepted)")
    save(fig, path, f"{title}: risk against coverage, shaded: bootstrap 95 % interval")


def floor_of_top_label(n_classes: int, n_bins: int) -> float:
    """The left edge of the bin holding 1 / K, the lowest top-label confidence of K classes (0.5 for two)."""
    return np.floor(n_bins / n_classes) / n_bins if n_classes > 1 else 0.0


def reliability(cells: dict, path: Path, title: str, n_bins: int = 10) -> None:
    """cells: {probe: cell}; top-label confidence against accuracy on the test split, bins (lo, hi],
    one column per probe with its ECE; under it the number of statements in each bin."""
    fig, axes = subplots(2, len(cells), 3.6, 1.9, sharex="col", gridspec_kw={"height_ratios": (3, 1)})
    centres = (np.arange(n_bins) + 0.5) / n_bins
    for col, (probe, cell) in enumerate(sorted(cells.items())):
        top, bottom = axes[:, col]
        probs, y = as_probs(np.asarray(cell["test"]["probs"])), np.asarray(cell["test"]["y"])
        conf, correct = probs.max(1), probs.argmax(1) == y
        bins = np.clip(np.ceil(conf * n_bins).astype(int) - 1, 0, n_bins - 1)
        counts = np.bincount(bins, minlength=n_bins)
        filled = counts > 0
        accuracy = np.bincount(bins, weights=correct, minlength=n_bins)[filled] / counts[filled]
        top.plot([0, 1], [0, 1], "k:", linewidth=1, label="perfect calibration")
        top.bar(centres[filled], accuracy, width=1 / n_bins, edgecolor="k", alpha=0.6, label="accuracy in the bin")
        top.set(xlim=(floor_of_top_label(probs.shape[1], n_bins), 1), ylim=(0, 1.05))   # (top-label conf. >= 1/K)
        top.set_title(f"{probe}, layer {cell['layer']}: ECE {ece(y, probs):.3f}", fontsize=9)
        bottom.bar(centres[filled], counts[filled], width=1 / n_bins, color="0.6", edgecolor="k")
        for x, n in zip(centres[filled], counts[filled]):
            bottom.annotate(str(n), (x, n), xytext=(0, 1), textcoords="offset points", ha="center", va="bottom",
                            fontsize=7)
        bottom.set_ylim(0, counts.max() * 1.35)
        bottom.set_xlabel("confidence (top label)")
    axes[0, 0].set_ylabel("accuracy")
    axes[1, 0].set_ylabel("statements")
    legend_below(fig, axes[0], "outside lower center")
    save(fig, path, f"{title}: reliability (test split), statements per bin under it")


def depth_figure(tables: dict[str, pd.DataFrame], colours: dict[str, str], q3: tuple[float, float], path: Path,
                 title: str) -> None:
    """tables: {model: layer table with `depth`}; one panel per (probe row, task column), MCC solid with
    its interval, W-MCC dashed, one colour per model; the depth range `q3` shaded."""
    probes = sorted(set().union(*(t["probe"] for t in tables.values())))
    tasks = sorted(set().union(*(t["task"] for t in tables.values())))
    fig, axes = subplots(len(probes), len(tasks), 3.4, 2.6, sharex=True, sharey=True)
    for i, probe in enumerate(probes):
        for j, task in enumerate(tasks):
            ax = axes[i, j]
            for model, table in tables.items():
                g = table[(table["probe"] == probe) & (table["task"] == task)].sort_values("depth")
                c = colours[model]
                line(ax, g["depth"], g["mcc"], "o-", color=c, label=f"{model}: {LABELS['mcc']}")
                line(ax, g["depth"], g["wmcc"], "s--", color=c, label=f"{model}: {LABELS['wmcc']}")
                for metric in ("mcc", "wmcc"):
                    no_signal_marks(ax, g["depth"], g[metric], g["flag"])
                interval(ax, g["depth"], g["mcc_lo"], g["mcc_hi"], c)
            ax.axvspan(*q3, color="k", alpha=0.06, linewidth=0)
            ax.grid(alpha=0.3)
            ax.set_title(words(task) if i == 0 else "", fontsize=9)
            if j == 0:
                ax.set_ylabel(f"{probe}\n{short('mcc')} / {short('wmcc')}")
            if i == len(probes) - 1:
                depth_axis(ax)
    legend_below(fig, axes, "outside lower center")
    save(fig, path, f"{title}: test MCC (solid, shaded: 95 % interval) and W-MCC (dashed) by relative depth; "
                    "third quarter of depth shaded grey; x: no signal (AUROC interval covers 0.5)")
