"""Result cells as tables: one row per cell, per (probe, task, split, layer) with seeds aggregated, and
the best layer of each probe chosen on the calibration split (the report, the transfer matrix and the
cross-model view all read cells through these)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from evaluation.cells import CellError, read_cell
from extract.errors import check_name

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
