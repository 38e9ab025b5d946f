"""Claim (b) of experiments.cross_model: is "neither" separable as its own class, and beyond the controls that
could explain it away (lexical novelty: the statement's text alone; the model's surprisal of it)? Each function
takes one (model, datapack)'s cells and probes' layer table as experiments.cross_model.load_study gives them."""
from __future__ import annotations

import logging

import numpy as np
import pandas as pd

from evaluation.cells import CellError
from evaluation.metrics import ABSTAIN
from evaluation.selective import paired_bootstrap
from experiments.compare import compare_cells
from experiments.tables import best_layers, cell_of, layer_table, with_holm
from extract.statements import FALSE, NEITHER, TRUE

log = logging.getLogger(__name__)
FEATURE_CONTROLS = ("linear+text", "linear+surprisal")   # claim (b)'s controls: methods without a layer


def best_row(table: pd.DataFrame) -> pd.Series:
    """The one (probe, task) table's row with the best calibration MCC; a control's (no layer) one row."""
    return table.iloc[0] if table["layer"].isna().all() else best_layers(table).iloc[0]


def interval_of(prefix: str, value: float, ci) -> dict:
    return {prefix: value, f"{prefix}_lo": ci[0], f"{prefix}_hi": ci[1]}


def neither_shares(y, pred, groups, n_boot: int, seed: int = 0) -> dict:
    """Among the test statements labelled neither: recall (predicted neither), the share abstained on
    (pred -1), and of those misclassified as a real class the share predicted false / true, each with
    its cluster-bootstrap 95 % interval (whole groups resampled; NaN where a resample has none)."""
    y, pred = np.asarray(y), np.asarray(pred)

    def share(hit: tuple, among: tuple | None):
        """stat(rows): share of the neither statements among `rows` predicted one of `hit`, counting only
        those predicted one of `among` (None: all)."""
        def stat(rows):
            p = pred[rows][y[rows] == NEITHER]
            p = p if among is None else p[np.isin(p, among)]
            return np.mean(np.isin(p, hit)) if p.size else np.nan
        return stat

    stats = {"neither_recall": share((NEITHER,), None), "neither_abstained": share((ABSTAIN,), None),
             "misclassified_as_false": share((FALSE,), (FALSE, TRUE)),
             "misclassified_as_true": share((TRUE,), (FALSE, TRUE))}
    nei = pred[y == NEITHER]
    out = {"n_neither": int(nei.size), "n_as_false": int(np.sum(nei == FALSE)), "n_as_true": int(np.sum(nei == TRUE)),
           "n_abstained": int(np.sum(nei == ABSTAIN))}
    for name, stat in stats.items():
        r = paired_bootstrap(stat, y.size, groups=groups, n_boot=n_boot, seed=seed)  # a single statistic's interval
        out.update(interval_of(name, r["diff"], r["ci"]))
    return out


def control_rows(cells: pd.DataFrame, method: str) -> pd.DataFrame:
    """The layer table of a control without a layer (FEATURE_CONTROLS), in the probes' layer-table form."""
    return layer_table(cells[cells["probe"] == method]).assign(depth=np.nan)


def neither_claims(model: str, datapack: str, cells: pd.DataFrame, table: pd.DataFrame, n_boot: int) -> list[dict]:
    """Claim (b) rows of one (model, datapack), one per probe and per control (FEATURE_CONTROLS) with a
    multiclass cell."""
    rows = []
    present = [c for c in FEATURE_CONTROLS if (cells["probe"] == c).any()]
    for probe, g in [*table.groupby("probe"), *((c, control_rows(cells, c)) for c in present)]:
        multi, binary = g[g["task"] == "multiclass"], g[g["task"] == "neither_vs_all"]
        if multi.empty:
            log.info("%s / %s / %s: no multiclass cells, left out of claim (b)", model, datapack, probe)
            continue
        best = best_row(multi)
        test = cell_of(cells, best)["test"]
        groups = np.asarray(test["groups"]) if test.get("groups") is not None else None
        row = {"claim": "b", "model": model, "datapack": datapack, "probe": probe,
               "control": probe in FEATURE_CONTROLS, "layer": None if pd.isna(best["layer"]) else int(best["layer"]),
               "depth": best["depth"], "flag": best["flag"], **neither_shares(test["y"], test["pred"], groups, n_boot)}
        if len(binary):
            b = best_row(binary)
            row.update(neither_vs_all_layer=None if pd.isna(b["layer"]) else int(b["layer"]),
                       **interval_of("neither_vs_all_mcc", b["mcc"], (b["mcc_lo"], b["mcc_hi"])))
        rows.append(row)
    return rows


def neither_recall_difference(a: dict, b: dict, n_boot: int) -> dict:
    """Paired cluster-bootstrap difference of two multiclass cells' recall of "neither" on the same test rows
    (evaluation.selective.paired_bootstrap: {"diff", "ci", "p_value", ...})."""
    ta, tb = a["test"], b["test"]
    if ta["rows"] != tb["rows"]:
        raise CellError("two multiclass cells of one datapack and split were evaluated on different test rows")
    y, pa, pb = (np.asarray(v) for v in (ta["y"], ta["pred"], tb["pred"]))
    groups = np.asarray(ta["groups"]) if ta.get("groups") is not None else None

    def difference(rows):
        neither = rows[y[rows] == NEITHER]
        return np.mean(pa[neither] == NEITHER) - np.mean(pb[neither] == NEITHER) if neither.size else np.nan

    return paired_bootstrap(difference, y.size, groups=groups, n_boot=n_boot)


def control_claims(model: str, datapack: str, cells: pd.DataFrame, table: pd.DataFrame, n_boot: int) -> list[dict]:
    """Claim (b) against its controls: each probe (random_direction aside) at its best calibration layer against
    each FEATURE_CONTROLS cell, on the same test rows: the neither_vs_all MCC without abstention (compare_cells'
    mcc_all) and the multiclass recall of "neither" (neither_recall_difference), probe - control."""
    best = {(r["probe"], r["task"]): r for _, r in best_layers(table).iterrows()}
    rows = []
    for control in (c for c in FEATURE_CONTROLS if (cells["probe"] == c).any()):
        ctable = control_rows(cells, control)
        for probe in sorted({p for p, _ in best} - {"random_direction"}):
            row = {"claim": "b_control", "model": model, "datapack": datapack, "probe": probe, "control": control}
            for task, prefix in (("neither_vs_all", "delta_mcc_all"), ("multiclass", "delta_recall")):
                theirs = ctable[ctable["task"] == task]
                if (probe, task) not in best or theirs.empty:
                    continue
                mine, other = cell_of(cells, best[probe, task]), cell_of(cells, theirs.iloc[0])
                r = (compare_cells(mine, other, n_boot=n_boot)["mcc_all"] if task == "neither_vs_all" else
                     neither_recall_difference(mine, other, n_boot))
                row.update({f"{task}_layer": int(best[probe, task]["layer"]), f"{prefix}_p_raw": r["p_value"],
                            **interval_of(prefix, r["diff"], r["ci"])})
            rows.append(row)
    return rows


def control_verdicts(versus: pd.DataFrame) -> pd.DataFrame:
    """Claim (b)'s comparisons with Holm over the whole family of each difference (every model, datapack, probe
    and control) and a verdict per row and difference (`verdict_<difference>`, after Holm: "beyond the control",
    "below the control" or "not distinguishable")."""
    for prefix in ("delta_mcc_all", "delta_recall"):
        if versus.empty or f"{prefix}_p_raw" not in versus:
            continue
        versus = with_holm(versus, prefix, [])
        versus[f"verdict_{prefix}"] = [
            "-" if pd.isna(sig) else "not distinguishable" if not sig else
            "beyond the control" if d > 0 else "below the control"
            for d, sig in zip(versus[prefix], versus[f"{prefix}_significant_holm"])]
    return versus


def neither_verdicts(versus: pd.DataFrame) -> list[dict]:
    """Claim (b)'s verdict per (model, datapack): "separable beyond lexical novelty" when some probe's
    neither_vs_all MCC is significantly above every control's (after Holm), else "not distinguishable from lexical
    novelty on this datapack"; with the probes that are, and the controls compared."""
    rows = []
    for (model, datapack), g in (versus.groupby(["model", "datapack"], sort=False)
                                 if "verdict_delta_mcc_all" in versus else ()):
        beyond = [p for p, h in g.groupby("probe")
                  if len(h) == len(FEATURE_CONTROLS) and (h["verdict_delta_mcc_all"] == "beyond the control").all()]
        rows.append({"claim": "b_verdict", "model": model, "datapack": datapack,
                     "controls": "; ".join(sorted(g["control"].unique())), "probes_beyond": "; ".join(beyond),
                     "verdict": ("separable beyond lexical novelty" if beyond else
                                 "not distinguishable from lexical novelty on this datapack")})
    return rows
