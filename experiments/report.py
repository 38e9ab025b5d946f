"""`python -m experiments.report model=... data=...`: result cells -> per-layer tables and plots.

Reads every cell under <results_dir>/<model>/<datapack>/ and writes to <reports_dir>/<model>/<datapack>/:

    layers.csv, layers.md   one row per (probe, task, split, layer): MCC, W-MCC, acceptance (mean over
                            seeds) with intervals (one seed: its bootstrap 95 % interval; several seeds:
                            mean +/- the spread across seeds), n_seeds; zero-shot rows have layer "-"
    best.csv, best.md       per (probe, task, split): the layer with the highest calibration-split MCC
                            (never chosen on test) and its test metrics
    mcc_by_layer.png        MCC and W-MCC against layer (top) and relative depth (bottom), one panel per
                            task, one line per probe, zero-shot as horizontal lines
    reliability.png         reliability diagram (test split) of every probe at its best layer, first task, with ECE
    risk_coverage.png       risk-coverage curves of every probe at its best layer (and zero-shot), one panel per task
    aurc_by_layer.png       AURC (lower is better) against layer, one panel per task

The best-layer table also says whether the best probe of each task (by calibration MCC) is
significantly better than the runner-up on test: paired bootstrap of the MCC difference (whole
subject entities resampled), McNemar on the statements both accept (experiments/compare.py).
With several seeds (same split_seed), `<metric>_seed_sd` is the probe's seed-to-seed spread,
apart from the sampling interval `<metric>_boot_lo/_hi` (mean of the seeds' bootstrap bounds).
"""
from __future__ import annotations

import logging
from pathlib import Path

import hydra
import numpy as np
import pandas as pd
from omegaconf import DictConfig

from evaluation.cells import CellError, read_cell
from experiments import plots
from experiments.compare import compare_cells
from extract.errors import check_name, run_entry

log = logging.getLogger(__name__)
METRICS = ("mcc", "wmcc", "acceptance", "aurc", "ece")


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
                     **{k: m.get(k) for k in METRICS}, **{f"{k}_ci": m.get(f"{k}_ci") for k in ("mcc", "wmcc")},
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
            row[k] = pd.to_numeric(g[k]).mean()
            if k in ("mcc", "wmcc"):
                bounds = np.array([ci for ci in g[f"{k}_ci"] if ci is not None], dtype=float).reshape(-1, 2)
                row[f"{k}_boot_lo"], row[f"{k}_boot_hi"] = bounds.mean(0) if len(bounds) else (np.nan, np.nan)
            if len(g) > 1:
                sd = g[k].std(ddof=1)
                row[f"{k}_seed_sd"] = sd
                row[f"{k}_lo"], row[f"{k}_hi"] = row[k] - sd, row[k] + sd
            elif k in ("mcc", "wmcc"):
                row[f"{k}_lo"], row[f"{k}_hi"] = row[f"{k}_boot_lo"], row[f"{k}_boot_hi"]
        out.append(row)
    table = pd.DataFrame(out)
    table["layer"] = table["layer"].astype("Int64")
    return table


def best_layers(table: pd.DataFrame) -> pd.DataFrame:
    """Per (probe, task, split): the layer with the highest calibration MCC (zero-shot rows excluded)."""
    probes = table[table["layer"].notna()]
    idx = probes.groupby(["probe", "task", "split"])["cal_mcc"].idxmax()
    return probes.loc[idx].reset_index(drop=True)


def cell_of(cells: pd.DataFrame, row: pd.Series) -> dict:
    """The first seed's cell of a (probe, task, split, layer) row."""
    keys = ["probe", "task", "split", "layer"]
    match = cells[(cells[keys[:3]] == row[keys[:3]]).all(axis=1) & (cells["layer"] == row["layer"])]
    return read_cell(Path(match.sort_values("seed")["path"].iloc[0]))


def best_vs_runner_up(cells: pd.DataFrame, best: pd.DataFrame, n_boot: int = 500) -> pd.DataFrame:
    """Per (task, split): the best probe (calibration MCC at its best layer) against the runner-up on
    test: MCC difference with its paired bootstrap interval, and McNemar's p on both-accepted rows."""
    out = []
    for (task, split), g in best.groupby(["task", "split"]):
        if len(g) < 2:
            continue
        first, second = (r for _, r in g.sort_values("cal_mcc", ascending=False).head(2).iterrows())
        result = compare_cells(cell_of(cells, first), cell_of(cells, second), n_boot=n_boot)
        out.append({"task": task, "split": split, "best": f"{first['probe']} (layer {int(first['layer'])})",
                    "runner_up": f"{second['probe']} (layer {int(second['layer'])})",
                    "delta_mcc": result["mcc"]["diff"], "delta_mcc_lo": result["mcc"]["ci"][0],
                    "delta_mcc_hi": result["mcc"]["ci"][1], "p_bootstrap": result["mcc"]["p_value"],
                    "p_mcnemar": result["mcnemar"]["p_value"], "bootstrap": result["bootstrap"],
                    "significant": bool(result["mcc"]["ci"][0] > 0)})
    return pd.DataFrame(out)


def write_report(results_dir: Path, reports_dir: Path, model: str, datapack: str) -> Path:
    cells = load_cells(results_dir, model, datapack)
    table = layer_table(cells)
    best = best_layers(table)
    out = Path(reports_dir) / model / datapack
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "layers.csv", index=False)
    best.to_csv(out / "best.csv", index=False)
    versus = best_vs_runner_up(cells, best)
    versus.to_csv(out / "best_vs_runner_up.csv", index=False)
    (out / "layers.md").write_text(_markdown(table))
    (out / "best.md").write_text(_markdown(best) + "\n" + _versus_markdown(versus))
    title = f"{model} / {datapack}"
    plots.metric_by_layer(table, out / "mcc_by_layer.png", title)
    plots.metric_by_layer(table, out / "aurc_by_layer.png", title, metrics=("aurc",))
    if len(best):
        chosen = {(r["probe"], r["task"]): cell_of(cells, r) for _, r in best.iterrows()}
        behaviour = {(r["probe"], r["task"]): cell_of(cells, r) for _, r in table[table["layer"].isna()].iterrows()}
        plots.risk_coverage(chosen, behaviour, out / "risk_coverage.png", title)
        first_task = sorted(best["task"])[0]
        plots.reliability({p: c for (p, t), c in chosen.items() if t == first_task}, out / "reliability.png",
                          f"{title}: {first_task}")
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


def _versus_markdown(versus: pd.DataFrame) -> str:
    lines = ["| task | split | best | runner-up | MCC difference | p (bootstrap) | p (McNemar) | significant |",
             "|---|---|---|---|---|---|---|---|"]
    for _, r in versus.iterrows():
        lines.append(f"| {r['task']} | {r['split']} | {r['best']} | {r['runner_up']} | {r['delta_mcc']:+.3f} "
                     f"[{r['delta_mcc_lo']:+.3f}, {r['delta_mcc_hi']:+.3f}] | {r['p_bootstrap']:.3f} | "
                     f"{r['p_mcnemar']:.3g} | {'yes' if r['significant'] else 'no'} |")
    return "\n".join(lines) + "\n"


def report(cfg: DictConfig) -> Path:
    return write_report(Path(cfg.results_dir), Path(cfg.reports_dir), cfg.model.name, cfg.data.name)


@hydra.main(version_base="1.3", config_path="../conf", config_name="report")
def main(cfg: DictConfig) -> None:
    run_entry(report, cfg, log=log)


if __name__ == "__main__":
    main()
