"""The report's figures (matplotlib, Agg): metrics against layer, risk-coverage curves, reliability."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from evaluation.metrics import as_probs, ece


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend (shared by every report module)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def legend_below(fig, axes) -> None:
    """One legend under the figure for the distinct labels of all `axes`."""
    labels = {}
    for ax in np.ravel(axes):
        for handle, label in zip(*ax.get_legend_handles_labels()):
            labels.setdefault(label, handle)
    fig.legend(labels.values(), labels.keys(), fontsize=8, loc="lower center", ncol=min(len(labels), 6))


def metric_by_layer(table: pd.DataFrame, path: Path, title: str, metrics=("mcc", "wmcc")) -> None:
    """Each metric against layer (top row) and relative depth (bottom row), one panel per task, one
    line per probe (bootstrap band for the first metric when present), methods without a layer
    (zero-shot) as horizontal lines."""
    plt = pyplot()
    tasks = sorted(table["task"].unique())
    colours = {p: f"C{i}" for i, p in enumerate(sorted(table.loc[table["layer"].notna(), "probe"].unique()))}
    styles = ("o-", "s--", "^:")
    fig, axes = plt.subplots(2, len(tasks), figsize=(4.2 * len(tasks), 7), squeeze=False, sharey=True)
    for col, task in enumerate(tasks):
        sub = table[table["task"] == task]
        for row, relative in enumerate((False, True)):
            ax = axes[row, col]
            for probe, g in sub[sub["layer"].notna()].groupby("probe"):
                g, c = g.sort_values("layer"), colours[probe]
                layer = g["layer"].astype(float)
                x = layer / g["n_layers"].astype(float) if relative else layer
                for metric, style in zip(metrics, styles):
                    ax.plot(x, g[metric].astype(float), style, markersize=3, color=c, label=f"{probe} {metric}")
                if f"{metrics[0]}_lo" in g:
                    ax.fill_between(x, g[f"{metrics[0]}_lo"].astype(float), g[f"{metrics[0]}_hi"].astype(float),
                                    color=c, alpha=0.12, linewidth=0)
            for _, z in sub[sub["layer"].isna()].iterrows():
                ax.axhline(z[metrics[0]], color="k", linestyle=":", linewidth=1, label=f"{z['probe']} {metrics[0]}")
            ax.set_xlabel("relative depth (layer / L)" if relative else "layer")
            ax.set_title(task if row == 0 else "")
            ax.grid(alpha=0.3)
        if col == 0:
            axes[0, col].set_ylabel(" / ".join(metrics))
    legend_below(fig, axes[0])
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def risk_coverage(chosen: dict, behaviour: dict, path: Path, title: str) -> None:
    """chosen / behaviour: {(method, task): cell}; one panel per task, one curve per method
    (probes at their best layer solid, methods without a layer dashed), AURC in the legend."""
    plt = pyplot()
    tasks = sorted({t for _, t in chosen} | {t for _, t in behaviour})
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.2 * len(tasks), 4), squeeze=False, sharey=True)
    for col, task in enumerate(tasks):
        ax = axes[0, col]
        for cells, style in ((chosen, "-"), (behaviour, "--")):
            for (method, t), cell in sorted(cells.items()):
                if t != task:
                    continue
                m = cell["metrics"]
                curve = m.get("risk_coverage")
                if not curve:
                    continue
                layer = "" if cell.get("layer") is None else f" L{cell['layer']}"
                ax.step(curve["coverage"], curve["risk"], style, where="post",
                        label=f"{method}{layer} (AURC {m['aurc']:.3f})")
        ax.set_xlabel("coverage")
        ax.set_title(task)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0, 0].set_ylabel("risk (error rate of the accepted)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def reliability(cells: dict, path: Path, title: str, n_bins: int = 10) -> None:
    """cells: {probe: cell}; top-label confidence against accuracy on the test split, bins (lo, hi],
    one panel per probe with its ECE."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(cells), figsize=(3.6 * len(cells), 3.8), squeeze=False)
    for ax, (probe, cell) in zip(axes[0], sorted(cells.items())):
        probs, y = as_probs(np.asarray(cell["test"]["probs"])), np.asarray(cell["test"]["y"])
        conf, correct = probs.max(1), probs.argmax(1) == y
        bins = np.clip(np.ceil(conf * n_bins).astype(int) - 1, 0, n_bins - 1)
        counts = np.bincount(bins, minlength=n_bins)
        filled = counts > 0
        accuracy = np.bincount(bins, weights=correct, minlength=n_bins)[filled] / counts[filled]
        ax.plot([0, 1], [0, 1], "k:", linewidth=1)
        ax.bar(((np.arange(n_bins) + 0.5) / n_bins)[filled], accuracy, width=1 / n_bins, edgecolor="k", alpha=0.6)
        ax.set_title(f"{probe} layer {cell['layer']}: ECE {ece(y, probs):.3f}", fontsize=9)
        ax.set_xlabel("confidence (top label)")
    axes[0, 0].set_ylabel("accuracy")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def depth_figure(tables: dict[str, pd.DataFrame], colours: dict[str, str], q3: tuple[float, float], path: Path,
                 title: str) -> None:
    """tables: {model: layer table with `depth`}; one panel per (probe row, task column), MCC solid with
    its interval as a band, W-MCC dashed, one colour per model; the depth range `q3` shaded."""
    plt = pyplot()
    probes = sorted(set().union(*(t["probe"] for t in tables.values())))
    tasks = sorted(set().union(*(t["task"] for t in tables.values())))
    fig, axes = plt.subplots(len(probes), len(tasks), figsize=(3.4 * len(tasks), 2.6 * len(probes) + 1),
                             squeeze=False, sharex=True, sharey=True)
    for i, probe in enumerate(probes):
        for j, task in enumerate(tasks):
            ax = axes[i, j]
            for model, table in tables.items():
                g = table[(table["probe"] == probe) & (table["task"] == task)].sort_values("depth")
                c = colours[model]
                ax.plot(g["depth"], g["mcc"], "o-", markersize=3, color=c, label=f"{model} MCC")
                ax.plot(g["depth"], g["wmcc"], "s--", markersize=3, color=c, label=f"{model} W-MCC")
                ax.fill_between(g["depth"], g["mcc_lo"].astype(float), g["mcc_hi"].astype(float), color=c,
                                alpha=0.12, linewidth=0)
            ax.axvspan(*q3, color="k", alpha=0.06, linewidth=0)
            ax.grid(alpha=0.3)
            ax.set_title(task if i == 0 else "", fontsize=9)
            if j == 0:
                ax.set_ylabel(probe)
            if i == len(probes) - 1:
                ax.set_xlabel("relative depth (layer / L)")
    legend_below(fig, axes)
    fig.suptitle(f"{title}: test MCC (solid) and W-MCC (dashed); Q3 shaded")
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
