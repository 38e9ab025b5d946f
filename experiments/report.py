"""`python -m experiments.report model=... data=...`: result cells -> per-layer tables and plots.

Reads every cell under <results_dir>/<model>/<datapack>/ and writes to <reports_dir>/<model>/<datapack>/:

    layers.csv, layers.md   one row per (probe, task, split, layer): MCC, W-MCC, acceptance (mean over
                            seeds) with intervals (one seed: its bootstrap 95 % interval; several seeds:
                            mean +/- the spread across seeds), n_seeds; zero-shot rows have layer "-"
    best.csv, best.md       per (probe, task, split): the layer with the highest calibration-split MCC
                            (never chosen on test) and its test metrics
    mcc_by_layer.png        MCC and W-MCC against layer (top) and relative depth (bottom), one panel per
                            task, one line per probe, zero-shot as horizontal lines
    reliability.png         reliability diagram (test split) of the best probe of the first task
"""
from __future__ import annotations

import logging
from pathlib import Path

import hydra
import numpy as np
import pandas as pd
from omegaconf import DictConfig

from evaluation.cells import CellError, read_cell
from evaluation.metrics import as_probs
from extract.errors import check_name, run_entry

log = logging.getLogger(__name__)
METRICS = ("mcc", "wmcc", "acceptance")


def load_cells(results_dir: Path, model: str, datapack: str) -> pd.DataFrame:
    """One row per cell: probe, task, split, layer (<NA> for methods without a layer), seed,
    n_layers, metrics, path; everything is read from the cells themselves (evaluation.cells)."""
    root = Path(results_dir) / check_name(model, "model") / check_name(datapack, "data")
    rows = []
    for path in sorted(root.glob("*/*/*/layer=*/seed=*.json")):
        cell = read_cell(path)
        config, m = cell["config"], cell["metrics"]
        rows.append({"probe": config["probe"]["name"], "task": config["task"]["name"],
                     "split": cell["split"]["kind"], "layer": cell["layer"], "seed": config["seed"],
                     "n_layers": cell.get("store", {}).get("n_layers"),
                     "cal_mcc": cell.get("calibration_metrics", {}).get("mcc_all"),
                     **{k: m[k] for k in METRICS}, **{f"{k}_ci": m.get(f"{k}_ci") for k in ("mcc", "wmcc")},
                     "path": str(path)})
    if not rows:
        raise CellError(f"no result cells under {root}: run `python -m train_probe` first")
    cells = pd.DataFrame(rows)
    cells["layer"] = cells["layer"].astype("Int64")
    return cells


def layer_table(cells: pd.DataFrame) -> pd.DataFrame:
    """Aggregate seeds: mean of each metric and its interval (bootstrap for one seed, mean +/- sd across seeds)."""
    out = []
    for key, g in cells.groupby(["probe", "task", "split", "layer"], sort=True, dropna=False):
        row = dict(zip(["probe", "task", "split", "layer"], key), n_seeds=len(g), n_layers=g["n_layers"].iloc[0],
                   cal_mcc=g["cal_mcc"].mean())
        for k in METRICS:
            row[k] = g[k].mean()
            if len(g) > 1:
                sd = g[k].std(ddof=1)
                row[f"{k}_lo"], row[f"{k}_hi"] = row[k] - sd, row[k] + sd
            elif k in ("mcc", "wmcc"):
                row[f"{k}_lo"], row[f"{k}_hi"] = g[f"{k}_ci"].iloc[0]
        out.append(row)
    table = pd.DataFrame(out)
    table["layer"] = table["layer"].astype("Int64")
    return table


def best_layers(table: pd.DataFrame) -> pd.DataFrame:
    """Per (probe, task, split): the layer with the highest calibration MCC (zero-shot rows excluded)."""
    probes = table[table["layer"].notna()]
    idx = probes.groupby(["probe", "task", "split"])["cal_mcc"].idxmax()
    return probes.loc[idx].reset_index(drop=True)


def write_report(results_dir: Path, reports_dir: Path, model: str, datapack: str) -> Path:
    cells = load_cells(results_dir, model, datapack)
    table = layer_table(cells)
    best = best_layers(table)
    out = Path(reports_dir) / model / datapack
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "layers.csv", index=False)
    best.to_csv(out / "best.csv", index=False)
    (out / "layers.md").write_text(_markdown(table))
    (out / "best.md").write_text(_markdown(best))
    _plot_layers(table, out / "mcc_by_layer.png", f"{model} / {datapack}")
    if len(best):
        top = best.sort_values(["task", "cal_mcc"], ascending=[True, False]).iloc[0]
        _plot_reliability(cells, top, out / "reliability.png")
    log.info("report written to %s (%d cells)", out, len(cells))
    return out


def _markdown(table: pd.DataFrame) -> str:
    def fmt(r, k):
        lo, hi = r.get(f"{k}_lo"), r.get(f"{k}_hi")
        return f"{r[k]:.3f}" if lo is None or pd.isna(lo) else f"{r[k]:.3f} [{lo:.3f}, {hi:.3f}]"

    lines = ["| probe | task | split | layer | MCC | W-MCC | acceptance | cal. MCC | seeds |",
             "|---|---|---|---|---|---|---|---|---|"]
    for _, r in table.iterrows():
        layer = "none" if pd.isna(r["layer"]) else int(r["layer"])
        cal = "" if pd.isna(r["cal_mcc"]) else f"{r['cal_mcc']:.3f}"
        lines.append(f"| {r['probe']} | {r['task']} | {r['split']} | {layer} | {fmt(r, 'mcc')} | {fmt(r, 'wmcc')} | "
                     f"{r['acceptance']:.3f} | {cal} | {r['n_seeds']} |")
    return "\n".join(lines) + "\n"


def _plot_layers(table: pd.DataFrame, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted(table["task"].unique())
    colours = {probe: f"C{i}" for i, probe in enumerate(sorted(table.loc[table["layer"].notna(), "probe"].unique()))}
    fig, axes = plt.subplots(2, len(tasks), figsize=(4.2 * len(tasks), 7), squeeze=False, sharey=True)
    for col, task in enumerate(tasks):
        sub = table[table["task"] == task]
        for row, relative in enumerate((False, True)):
            ax = axes[row, col]
            for probe, g in sub[sub["layer"].notna()].groupby("probe"):
                g, c = g.sort_values("layer"), colours[probe]
                layer = g["layer"].astype(float)
                x = layer / g["n_layers"].astype(float) if relative else layer
                ax.plot(x, g["mcc"], "o-", markersize=3, color=c, label=f"{probe} MCC")
                ax.plot(x, g["wmcc"], "s--", markersize=3, color=c, label=f"{probe} W-MCC")
                if "mcc_lo" in g:
                    ax.fill_between(x, g["mcc_lo"], g["mcc_hi"], color=c, alpha=0.12, linewidth=0)
            for _, z in sub[sub["layer"].isna()].iterrows():
                ax.axhline(z["mcc"], color="k", linestyle=":", linewidth=1, label=f"{z['probe']} MCC")
            ax.set_xlabel("relative depth (layer / L)" if relative else "layer")
            ax.set_title(task if row == 0 else "")
            ax.grid(alpha=0.3)
        axes[0, col].set_ylabel("MCC / W-MCC") if col == 0 else None
    labels = {}
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            labels.setdefault(label, handle)
    fig.legend(labels.values(), labels.keys(), fontsize=8, loc="lower center", ncol=min(len(labels), 6))
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_reliability(cells: pd.DataFrame, best: pd.Series, path: Path, n_bins: int = 10) -> None:
    """Top-label confidence against accuracy on the test split, pooled over the seeds of the best cell."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ["probe", "task", "split", "layer"]
    chosen = cells[(cells[keys] == best[keys]).all(axis=1)]
    conf, correct = [], []
    for p in chosen["path"]:
        test = read_cell(Path(p))["test"]
        probs = as_probs(np.asarray(test["probs"]))
        conf.append(probs.max(1))
        correct.append(probs.argmax(1) == np.asarray(test["y"]))
    conf, correct = np.concatenate(conf), np.concatenate(correct)
    bins = np.clip(np.ceil(conf * n_bins).astype(int) - 1, 0, n_bins - 1)
    centres = (np.arange(n_bins) + 0.5) / n_bins
    filled = np.bincount(bins, minlength=n_bins) > 0
    accuracy = np.bincount(bins, weights=correct, minlength=n_bins)[filled] / np.bincount(bins, minlength=n_bins)[filled]
    fig, ax = plt.subplots(figsize=(4.5, 4.5))
    ax.plot([0, 1], [0, 1], "k:", linewidth=1)
    ax.bar(centres[filled], accuracy, width=1 / n_bins, edgecolor="k", alpha=0.6)
    ax.set_xlabel("confidence (top label)")
    ax.set_ylabel("accuracy")
    ax.set_title(f"{best['probe']} {best['task']} layer {int(best['layer'])}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(cfg: DictConfig) -> Path:
    return write_report(Path(cfg.results_dir), Path(cfg.reports_dir), cfg.model.name, cfg.data.name)


@hydra.main(version_base="1.3", config_path="../conf", config_name="report")
def main(cfg: DictConfig) -> None:
    run_entry(report, cfg, log=log)


if __name__ == "__main__":
    main()
