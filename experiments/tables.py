"""Result cells as tables: one row per cell, per (probe, task, split, layer) with seeds aggregated, and
the best layer of each probe chosen on the calibration split (the report, the transfer matrix and the
cross-model view all read cells through these, `report_cell` checking each); a cell's health flag;
Holm-adjusted decisions of a table's family of tests; `publish`, the one writer of every report folder
(old report intact or new report whole)."""
from __future__ import annotations

import ctypes
import logging
import math
import os
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd

from evaluation.cell_metrics import cell_auroc_interval, no_signal
from evaluation.cells import CellError, cell_files, cell_parts, cell_path, read_cell, settings_key, settings_mismatch
from toolkit.disk import remove_stale_temps
from evaluation.selective import holm
from toolkit.disk import fsync_path
from toolkit.errors import ToolkitError, check_name
from toolkit.markdown import markdown_table

log = logging.getLogger(__name__)
METRICS = ("mcc", "wmcc", "acceptance", "aurc", "ece")
NO_SIGNAL = "no_signal"   # cell_flag's word for a cell whose test AUROC interval covers 0.5
ALPHA = 0.05   # every table's significance level: a test is significant when its (raw or Holm) p < ALPHA


def load_cells(results_dir: Path, model: str, datapack: str) -> pd.DataFrame:
    """One row per cell: probe, task, split, layer (<NA> for methods without a layer), seed, n_layers,
    stored_layers (the store's layer list where the cell records it, else None), flag (cell_flag),
    metrics, path; everything is read from the cells themselves (evaluation.cells)."""
    root = Path(results_dir) / check_name(model, "model") / check_name(datapack, "data")
    rows = [cell_row(path, report_cell(path, results_dir)) for path in cell_files(results_dir, root.parent.name, root.name)]
    if not rows:
        raise CellError(f"no result cells under {root}: run `python -m train_probe` first")
    cells = pd.DataFrame(rows)
    cells["layer"] = cells["layer"].astype("Int64")
    return flag_mixed_settings(cells)


def cell_row(path: Path, cell: dict) -> dict:
    """A cell as one row of `load_cells`' table."""
    config, m = cell["config"], cell["metrics"]
    return {"probe": method_of(cell), "task": config["task"]["name"], "split": cell["split"]["kind"],
            "layer": cell["layer"], "seed": config["seed"], "n_layers": cell.get("store", {}).get("n_layers"),
            "stored_layers": cell.get("store", {}).get("layers"), "flag": cell_flag(cell),
            "cal_mcc": cell.get("calibration_metrics", {}).get("mcc_all"),
            **{k: m.get(k) for k in METRICS}, **{f"{k}_ci": m.get(f"{k}_ci") for k in ("mcc", "wmcc")},
            "settings": settings_key(config), "commit": commit_of(cell), "path": str(path)}


MIXED = "mixed_settings"   # cell_flag's word for a cell ranked beside cells of its (probe, task, split) made otherwise


def flag_mixed_settings(cells: pd.DataFrame) -> pd.DataFrame:
    """`cells` with MIXED added to the flag of every cell of a (probe, task, split) whose cells were made with
    more than one setting (evaluation.cells.settings_key: `alpha=0.3` at one layer, the defaults at another),
    and one warning per such group naming the options that differ: their layers are not comparable."""
    cells = cells.copy()
    for (probe, task, split), g in cells.groupby(["probe", "task", "split"], sort=True):
        if g["settings"].nunique() < 2:
            continue
        first, other = (g[g["settings"] == k].iloc[0] for k in g["settings"].unique()[:2])
        differ = settings_mismatch(read_cell(Path(first["path"]))["config"], read_cell(Path(other["path"]))["config"])
        log.warning("%s %s %s: cells made with %d different settings (%s): flagged %s, their layers are not "
                    "comparable; rerun the sweep with one setting (overwrite=true)", probe, task, split,
                    g["settings"].nunique(), "; ".join(differ[:3]) or "other options", MIXED)
        cells.loc[g.index, "flag"] = [";".join(filter(None, [f, MIXED])) for f in g["flag"]]
    return cells


def commit_of(cell: dict) -> str:
    """The commit a cell was made at, `<sha7>` or `<sha7> (modified)` (its provenance), "unknown" without one."""
    prov = cell.get("provenance") or {}
    sha = prov.get("git_commit")
    return "unknown" if not sha else f"{sha[:7]}{' (modified)' if prov.get('git_dirty') else ''}"


def coverage_gaps(cells: pd.DataFrame) -> list[str]:
    """For each (probe, task, split) swept over layers: the store's layers (the cells' `stored_layers`) it has
    no cell at, as one line each ("linear true_vs_all entity_disjoint: 24 of 31 layers, missing 7-30"): a
    report of a sweep still running or stopped early says what its best layers were chosen from."""
    lines = []
    layered = cells[cells["layer"].notna()]
    for (probe, task, split), g in layered.groupby(["probe", "task", "split"], sort=True):
        stored = next((s for s in g["stored_layers"] if s is not None), None)
        if stored is None:
            continue
        missing = sorted(set(int(k) for k in stored) - set(int(k) for k in g["layer"]))
        if missing:
            lines.append(f"{probe} {task} {split}: {len(stored) - len(missing)} of {len(stored)} layers, missing "
                         f"{layer_ranges(missing)}")
    return lines


def layer_ranges(layers: list[int]) -> str:
    """Sorted layers as ranges: [1, 2, 3, 7] -> "1-3, 7"."""
    runs: list[list[int]] = []
    for k in layers:
        if runs and k == runs[-1][-1] + 1:
            runs[-1].append(k)
        else:
            runs.append([k])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


REQUIRED = ("config.model.name", "config.data.name", "config.task.name", "config.seed", "split.kind", "layer",
            "metrics.mcc", "metrics.wmcc", "metrics.acceptance", "test.rows", "test.y", "test.pred", "test.probs")


def report_cell(path: Path, results_dir=None) -> dict:
    """The cell at `path` (evaluation.cells.read_cell) with the blocks a report reads (REQUIRED), no NaN or
    infinity anywhere (write_cell never writes one: a hand-edited cell) and, given `results_dir`, a path
    that is the one its content names (evaluation.cells.cell_path: model, datapack, method, task, split,
    layer, seed; a cell copied under another folder would be counted as another seed or datapack).
    Anything else is one CellError line naming the file."""
    cell = read_cell(path)
    for key in REQUIRED:
        value = cell
        for part in key.split("."):
            value = value.get(part, KeyError) if isinstance(value, dict) else KeyError
        if value is KeyError:
            raise CellError(f"{path} has no {key}: not a complete result cell; delete it and rerun the command that "
                            "wrote it (e.g. `python -m train_probe ... overwrite=true`)")
    bad = _non_finite(cell)
    if bad:
        raise CellError(f"{path}: {bad} is not a finite number (cells are written without NaN or infinity: the file "
                        "was edited); delete it and rerun the command that wrote it")
    if results_dir is not None:
        config = cell["config"]
        names = {"model": config["model"]["name"], "datapack": config["data"]["name"], "method": method_of(cell),
                 "task": config["task"]["name"], "split": cell["split"]["kind"], "layer": cell["layer"],
                 "seed": config["seed"]}
        try:
            expected = cell_path(results_dir, *names.values())
        except ToolkitError as err:
            raise CellError(f"{path}: {err}") from None
        if expected != Path(path):
            found, wanted = cell_parts(path), cell_parts(expected)
            wrong = [f"{k}={v}" for k, v in names.items() if wanted[k] != found[k]]
            raise CellError(f"{path}: its content says {', '.join(wrong) or 'another path'} (it belongs at {expected}): "
                            "a cell copied or moved by hand is refused, never counted as another seed or datapack; "
                            "move it back or delete it")
    return cell


def method_of(cell: dict) -> str:
    """The method a cell's folder is named after: its `method.name` (a probe name, with +in_sample /
    +reference for the non-default procedures; zero-shot methods), else its probe's name (older cells)."""
    return (cell.get("method") or {}).get("name") or cell["config"]["probe"]["name"]


def _non_finite(value, key: str = "") -> str | None:
    """The dotted key of the first NaN / infinite float in a JSON value, None when there is none."""
    if isinstance(value, float):
        return None if math.isfinite(value) else key or "a value"
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        if value and all(isinstance(v, (int, str, bool)) or v is None for v in value):
            return None        # the common long lists (rows, labels, predictions): nothing to check
        try:                   # the long lists of numbers (scores, probabilities [N, K]): one vectorised check
            if np.isfinite(np.asarray(value, dtype=np.float64)).all():
                return None
        except (ValueError, TypeError):
            pass               # (ragged or mixed: walked below)
        items = ((f"[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    for k, v in items:
        found = _non_finite(v, f"{key}{k}" if str(k).startswith("[") or not key else f"{key}.{k}")
        if found:
            return found
    return None


def cell_flag(cell: dict) -> str:
    """Why a cell's numbers are not a fitted probe's, or are no evidence: its `degenerate_reasons` (e.g.
    "single_label_accepted;C_at_grid_edge:upper"), "degenerate" for a degenerate cell that records no
    reasons, then "no_signal" where its test AUROC interval covers 0.5 (evaluation.cell_metrics.no_signal:
    its MCC on accepted rows is not read as a finding), joined by ";"; "" for a healthy one."""
    reasons = list(cell.get("degenerate_reasons") or (["degenerate"] if cell.get("degenerate") else []))
    if "metrics" in cell and "test" in cell and no_signal(cell_auroc_interval(cell)):
        reasons.append(NO_SIGNAL)
    return ";".join(reasons)


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


def holm_resolution_warning(n_boot: int, family: int) -> str | None:
    """The line to print when `n_boot` resamples cannot support Holm over a family of `family` tests: no
    bootstrap p is below 2 / (n_boot + 1) (evaluation.selective.bootstrap_p), so Holm's smallest adjusted
    p is family * 2 / (n_boot + 1); None when that is below ALPHA (or there is no family)."""
    if family < 1 or 2 * family / (n_boot + 1) < ALPHA:
        return None
    return (f"n_boot={n_boot}: no bootstrap p is below {2 / (n_boot + 1):.2g}, so Holm over a family of {family} "
            f"comparisons can call nothing significant; rerun with n_boot >= {int(2 * family / ALPHA)}")


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


def results_table(paths: list[Path]) -> str:
    """What a train_probe run found, as lm-evaluation-harness prints its results: per (probe, task, split) of
    the cells at `paths`, the best layer (best_layers: highest calibration MCC) with its test MCC [95 %
    interval], W-MCC, acceptance and flag, and how many layers the run had."""
    cells = pd.DataFrame([cell_row(Path(p), report_cell(Path(p))) for p in paths])
    cells["layer"] = cells["layer"].astype("Int64")
    table = layer_table(cells)
    layered, unlayered = table[table["layer"].notna()], table[table["layer"].isna()]
    best = pd.concat([best_layers(layered), unlayered]) if len(layered) else unlayered
    counts = cells.groupby(["probe", "task", "split"]).size()

    def num(x):
        return "-" if x is None or pd.isna(x) else f"{x:.3f}"

    lines = [[r.probe, r.task, r.split, counts[(r.probe, r.task, r.split)], "none" if pd.isna(r.layer) else int(r.layer),
              num(r.cal_mcc), f"{num(r.mcc)} [{num(r.mcc_lo)}, {num(r.mcc_hi)}]", num(r.wmcc), num(r.acceptance),
              r.flag or ""] for r in best.sort_values(["probe", "task", "split"]).itertuples()]
    return markdown_table(["probe", "task", "split", "layers", "best layer", "cal. MCC", "test MCC [95 %]", "W-MCC",
                           "acceptance", "flag"], lines)


def best_layers(table: pd.DataFrame) -> pd.DataFrame:
    """Per (probe, task, split): the layer with the highest calibration MCC (zero-shot rows excluded)."""
    probes = table[table["layer"].notna()]
    idx = probes.groupby(["probe", "task", "split"])["cal_mcc"].idxmax()
    return probes.loc[idx].reset_index(drop=True)


def cell_of(cells: pd.DataFrame, row: pd.Series) -> dict:
    """The first seed's cell of a (probe, task, split, layer) row."""
    keys = ["probe", "task", "split", "layer"]
    same_layer = cells["layer"].isna() if pd.isna(row["layer"]) else (cells["layer"] == row["layer"]).fillna(False)
    match = cells[(cells[keys[:3]] == row[keys[:3]]).all(axis=1) & same_layer]
    return report_cell(Path(match.sort_values("seed")["path"].iloc[0]))


class ReportError(ToolkitError):
    """A report that cannot be written (no space, no permission); the previous report is unchanged."""


_STAGING = f".tmp-report-{socket.gethostname()}-"   # + pid + random: a report being written


def publish(out: Path, build: Callable[[Path], None], whole_folder: bool = True) -> Path:
    """Write a report atomically: `build(folder)` writes every file of the report into a fresh staging
    folder beside `out` (same file system: a full disk fails here, before anything of the old report is
    touched), every file is fsynced, then the staging folder takes `out`'s place in one rename
    (renameat2 RENAME_EXCHANGE; where the file system lacks it, the old folder is renamed aside first)
    and the old report is deleted. `whole_folder=False` (files that share their folder with other
    reports: the transfer matrix in <reports_dir>/<model>/): each staged file is renamed over its
    namesake, once all were written. On any failure the staging folder (and folders this call created)
    is removed, so the old report is intact or the new one whole; an OSError is one ReportError line."""
    out = Path(out)
    created = [p for p in (out, *out.parents) if not p.exists()][::-1]
    staging = None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(out.parent, _STAGING)
        staging = Path(tempfile.mkdtemp(prefix=f"{_STAGING}{os.getpid()}-", dir=out.parent))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(staging, 0o777 & ~umask)
        build(staging)
        _fsync_tree(staging)
        if whole_folder:
            _swap_in(staging, out)
        else:
            out.mkdir(exist_ok=True)
            for file in sorted(staging.iterdir()):
                os.replace(file, out / file.name)
            fsync_path(out)
        created = []
        return out
    except OSError as err:
        raise ReportError(f"cannot write the report {out} ({err.strerror or err}): free space there or choose "
                          "another folder for it (the option that names it); the previous report, if any, is unchanged") from None
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        for folder in reversed(created):   # a failed first report leaves no empty folders either
            try:
                folder.rmdir()
            except OSError:
                pass


def _swap_in(staging: Path, out: Path) -> None:
    """Put `staging` at `out`; afterwards `staging` names the old report (deleted by the caller) or nothing."""
    if not out.exists():
        os.rename(staging, out)
    elif not _exchange(staging, out):
        aside = Path(tempfile.mkdtemp(prefix=f"{_STAGING}{os.getpid()}-", dir=out.parent))
        os.rename(out, aside / "old")
        os.rename(staging, out)
        os.rename(aside, staging)
    fsync_path(out.parent)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    errno = ctypes.get_errno()
    if errno in (22, 38, 95):   # EINVAL, ENOSYS, EOPNOTSUPP: the file system cannot exchange
        return False
    raise OSError(errno, os.strerror(errno), str(b))


def _fsync_tree(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            fsync_path(path)
    fsync_path(folder)
