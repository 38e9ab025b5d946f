"""Result cells as tables: one row per cell, per (probe, task, split, layer) with seeds aggregated, and
the best layer of each probe chosen on the calibration split (the report, the transfer matrix and the
cross-model view all read cells through these); a cell's health flag; Holm-adjusted decisions of a
table's family of tests."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from evaluation.cells import CellError, read_cell
from evaluation.selective import holm
from extract.errors import check_name

METRICS = ("mcc", "wmcc", "acceptance", "aurc", "ece")
ALPHA = 0.05   # every table's significance level: a test is significant when its (raw or Holm) p < ALPHA


def load_cells(results_dir: Path, model: str, datapack: str) -> pd.DataFrame:
    """One row per cell: probe, task, split, layer (<NA> for methods without a layer), seed, n_layers,
    stored_layers (the store's layer list where the cell records it, else None), flag (cell_flag),
    metrics, path; everything is read from the cells themselves (evaluation.cells)."""
    root = Path(results_dir) / check_name(model, "model") / check_name(datapack, "data")
    rows = []
    for path in sorted(root.glob("*/*/*/layer=*/seed=*.json")):
        cell = read_cell(path)
        config, m = cell["config"], cell["metrics"]
        rows.append({"probe": config["probe"]["name"], "task": config["task"]["name"],
                     "split": cell["split"]["kind"], "layer": cell["layer"], "seed": config["seed"],
                     "n_layers": cell.get("store", {}).get("n_layers"),
                     "stored_layers": cell.get("store", {}).get("layers"), "flag": cell_flag(cell),
                     "cal_mcc": cell.get("calibration_metrics", {}).get("mcc_all"),
                     **{k: m.get(k) for k in METRICS}, **{f"{k}_ci": m.get(f"{k}_ci") for k in ("mcc", "wmcc")},
                     "path": str(path)})
    if not rows:
        raise CellError(f"no result cells under {root}: run `python -m train_probe` first")
    cells = pd.DataFrame(rows)
    cells["layer"] = cells["layer"].astype("Int64")
    return cells


def cell_flag(cell: dict) -> str:
    """Why a cell's numbers are not a fitted probe's: its `degenerate_reasons` joined by ";" (e.g.
    "single_label_accepted;C_at_grid_edge:upper"), "degenerate" for a degenerate cell that records no
    reasons, "" for a healthy one."""
    return ";".join(cell.get("degenerate_reasons") or (["degenerate"] if cell.get("degenerate") else []))


def with_holm(table: pd.DataFrame, prefix: str, by: list[str]) -> pd.DataFrame:
    """`table` with `<prefix>_p_holm` (Holm's adjustment of `<prefix>_p_raw` within each family: the rows
    sharing the `by` columns; a row without a p is no test), `<prefix>_significant_raw` (p_raw < ALPHA) and
    `<prefix>_significant_holm` (p_holm < ALPHA); both <NA> where there was no test."""
    columns = [f"{prefix}_p_raw", f"{prefix}_p_holm", f"{prefix}_significant_raw", f"{prefix}_significant_holm"]
    if table.empty:
        return table.reindex(columns=list(dict.fromkeys([*table.columns, *columns])))
    table = table.copy()
    p = pd.to_numeric(table.get(f"{prefix}_p_raw", pd.Series(np.nan, index=table.index)), errors="coerce")
    table[f"{prefix}_p_raw"] = p
    keys = [table[c] for c in by] if by else np.zeros(len(table))
    adjusted = p.groupby(keys, sort=False).transform(lambda x: holm(x.to_numpy()))
    table[f"{prefix}_p_holm"] = adjusted
    for kind, values in (("raw", p), ("holm", adjusted)):
        table[f"{prefix}_significant_{kind}"] = (values < ALPHA).astype("boolean").mask(values.isna())
    return table


def p_text(row: pd.Series, prefix: str) -> str:
    """"<p_raw> / <p_holm>" of a with_holm row's test `prefix`; "-" where there was no test."""
    p = row.get(f"{prefix}_p_raw", np.nan)
    return "-" if pd.isna(p) else f"{p:.3g} / {row[f'{prefix}_p_holm']:.3g}"


def yes_no(decision) -> str:
    """A with_holm decision as "yes" / "no", "-" where there was no test."""
    return "-" if pd.isna(decision) else "yes" if decision else "no"


def layer_table(cells: pd.DataFrame) -> pd.DataFrame:
    """Aggregate seeds: mean of each metric and its interval (bootstrap for one seed, mean +/- sd across seeds)."""
    out = []
    for key, g in cells.groupby(["probe", "task", "split", "layer"], sort=True, dropna=False):
        row = dict(zip(["probe", "task", "split", "layer"], key), n_seeds=len(g), n_layers=g["n_layers"].iloc[0],
                   cal_mcc=g["cal_mcc"].mean(), flag=";".join(dict.fromkeys(f for f in g["flag"] if f)))
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
