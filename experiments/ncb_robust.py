"""Structure-aware and neutral-context probe training against the plain probe under stress (the probe analogue
of SAT, Xu et al. 2601.05905), from the `python -m ncb` outputs of probes fitted with `train_probe
augment=structure_aware | neutral` (probes/augment.py) and of the plain probe of the same task, split, layer and
seed (the NCB folder whose name lacks `+<kind>`).

Pairs: structure_aware - plain, neutral - plain, and structure_aware - neutral (the belief change a misleading
context causes, beyond the shift any context causes). For each pair, on the test targets valid for both probes
(both plain predictions right on the clean statement) scored under a context by both:

    ncb_robust.csv / .md   per (interference, level), and pooled over every misleading context ("all but the
                           control": the templates other than `control`): each probe's drop (1 - accuracy under
                           the context; the clean accuracy of these targets is 1 for both), the difference a - b
                           (negative: a is more robust), the relative change of the drop a / b - 1 (SAT reports
                           about -0.3), each probe's mean shift of P(y) (under the context - clean), 95 %
                           intervals from one cluster bootstrap over subject entities (the same draws for every
                           number of a row), the difference's two-sided bootstrap p raw and Holm-adjusted over
                           the family of every row of the table (tables.with_holm, as the claims page)
    ncb_robust_clean.csv / .md
                           each pair's clean test metrics from their cells: MCC of the plain prediction and
                           AUROC of the raw scores, the paired difference a - b with its cluster-bootstrap
                           interval and p, Holm-adjusted within each estimand's family (every pair's row)
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pandas as pd

from evaluation.cells import CellError, read_cell
from evaluation.metrics import as_probs, auroc, mcc
from evaluation.selective import paired_bootstrap
from experiments.tables import ALPHA, p_text, with_holm, yes_no
from toolkit.errors import check_name
from toolkit.markdown import markdown_table
from probes.schema import AUGMENTS

log = logging.getLogger(__name__)
POOLED = "all but the control"
CLEAN = {"mcc_all": "MCC of the plain (argmax) prediction, all test rows",
         "auroc": "AUROC of the raw scores, all test rows"}


def ncb_folders(results_dir, model: str, datapack: str) -> dict[str, Path]:
    """{NCB method name: its folder} of every probe method with targets.json, inputs.csv and stress.json."""
    folder = Path(results_dir) / check_name(model, "model") / check_name(datapack, "data") / "ncb"
    return {p.name: p for p in sorted(folder.glob("*")) if all((p / f).exists() for f in
            ("targets.json", "inputs.csv", "stress.json"))
            and json.loads((p / "stress.json").read_text())["info"]["kind"] == "probe"}


def pairs(names: list[str]) -> list[tuple[str, str, str]]:
    """(comparison, a, b) of the NCB method names: <probe>+<kind>_... against <probe>_... (the plain probe of the
    same task, split, layer and seed) for each augment kind, and structure_aware against neutral."""
    out, present = [], set(names)
    for name in names:
        for kind in AUGMENTS:
            plain = name.replace(f"+{kind}", "", 1)
            if plain != name and plain in present:
                out.append((f"{kind} - plain", name, plain))
        neutral = name.replace("+structure_aware", "+neutral", 1)
        if neutral != name and neutral in present:
            out.append(("structure_aware - neutral", name, neutral))
    return out


def stress_inputs(folder: Path) -> pd.DataFrame:
    """The valid test targets' stress inputs of one NCB folder: target_row, entity, interference, level,
    correct, shift (p_y under the context - clean p_y), control (the level's template is `control` in the
    templates stress.json records; false where it records none)."""
    targets = json.loads((folder / "targets.json").read_text())
    clean = {t["row"]: t["p_y"] for t in targets if t["valid"] and t["part"] == "test"}
    options = json.loads((folder / "stress.json").read_text()).get("options", {})
    stress = options.get("stress", {}).get("interferences", {})
    frame = pd.read_csv(folder / "inputs.csv", dtype={"level": str})
    frame = frame[frame["target_row"].isin(clean)]
    control = [stress.get(i, {}).get(level) == "control" for i, level in zip(frame["interference"], frame["level"])]
    return frame.assign(shift=frame["p_y"] - frame["target_row"].map(clean), control=control).drop(columns="p_y")


def paired_rows(a: pd.DataFrame, b: pd.DataFrame, n_boot: int, seed: int) -> list[dict]:
    """One row per (interference, level) and one pooled over the misleading contexts: the stress inputs both
    probes scored (stress_inputs of each), each probe's drop, the difference a - b, the relative change
    a / b - 1 and the P(y) shifts, with intervals from the same cluster-bootstrap draws (see the module
    docstring)."""
    both = a.merge(b, on=["target_row", "entity", "interference", "level", "control"], suffixes=("_a", "_b"))
    variants = [((i, level), part) for (i, level), part in both.groupby(["interference", "level"], sort=False)]
    variants.append(((POOLED, ""), both[~both["control"]]))
    rows = []
    for (interference, level), part in variants:
        if part.empty:
            continue
        wrong_a, wrong_b = 1.0 - part["correct_a"].to_numpy(float), 1.0 - part["correct_b"].to_numpy(float)
        row = {"interference": interference, "level": level, "n": len(part), "n_targets": part["target_row"].nunique(),
               "n_entities": part["entity"].nunique()}
        stats = {"drop_a": lambda i: wrong_a[i].mean(), "drop_b": lambda i: wrong_b[i].mean(),
                 "difference": lambda i: wrong_a[i].mean() - wrong_b[i].mean(),
                 "relative": lambda i: _ratio(wrong_a[i].mean(), wrong_b[i].mean()) - 1.0}
        for column, stat in stats.items():
            r = paired_bootstrap(stat, len(part), groups=part["entity"].to_numpy(), n_boot=n_boot, seed=seed)
            row.update({column: r["diff"], f"{column}_lo": r["ci"][0], f"{column}_hi": r["ci"][1]})
            if column == "difference":
                row["difference_p_raw"] = r["p_value"]
        rows.append({**row, "shift_a": part["shift_a"].mean(), "shift_b": part["shift_b"].mean()})
    return rows


def _ratio(x: float, y: float) -> float:
    return x / y if y > 0 else np.nan


def robust_table(results_dir, model: str, datapack: str, n_boot: int = 1000, seed: int = 0) -> pd.DataFrame:
    """ncb_robust.csv's rows (paired_rows of every pair), Holm-adjusted over the whole table."""
    folders = ncb_folders(results_dir, model, datapack)
    rows = []
    for comparison, a, b in pairs(list(folders)):
        for row in paired_rows(stress_inputs(folders[a]), stress_inputs(folders[b]), n_boot, seed):
            rows.append({"comparison": comparison, "a": a, "b": b, **row})
    return with_holm(pd.DataFrame(rows), "difference", [])


def clean_table(results_dir, model: str, datapack: str, n_boot: int = 1000, seed: int = 0) -> pd.DataFrame:
    """ncb_robust_clean.csv's rows: each pair's clean MCC and AUROC from their cells (the cells NCB read;
    pairs whose cells cannot be read are left out with a warning), Holm-adjusted within each estimand."""
    folders = ncb_folders(results_dir, model, datapack)
    rows = []
    for comparison, a, b in pairs(list(folders)):
        try:
            cells = [read_cell(Path(json.loads((folders[m] / "stress.json").read_text())["info"]["cell"]))
                     for m in (a, b)]
        except CellError as err:
            log.warning("%s vs %s: no clean comparison (%s)", a, b, err)
            continue
        for estimand, values in clean_differences(*cells, n_boot, seed).items():
            rows.append({"comparison": comparison, "a": a, "b": b, "estimand": estimand, **values})
    return with_holm(pd.DataFrame(rows), "difference", ["estimand"])


def clean_differences(a: dict, b: dict, n_boot: int, seed: int) -> dict[str, dict]:
    """{estimand of CLEAN: {value_a, value_b, difference, difference_lo, difference_hi, difference_p_raw, n}}
    on the test rows both cells hold (the same split), one cluster bootstrap over their entity groups."""
    ta, tb = a["test"], b["test"]
    if ta["rows"] != tb["rows"] or ta["y"] != tb["y"]:
        raise CellError("the two cells were evaluated on different test rows: pair cells of the same split")
    y, groups = np.asarray(ta["y"], dtype=np.int64), np.asarray(ta["groups"])
    plain = [as_probs(np.asarray(t["probs"])).argmax(1) for t in (ta, tb)]
    scores = [np.asarray(t["scores"], dtype=np.float64) for t in (ta, tb)]
    scores = [s[:, 0] if s.shape[1] == 1 else s for s in scores]
    metrics = {"mcc_all": lambda i, k: mcc(y[i], plain[k][i]), "auroc": lambda i, k: auroc(y[i], scores[k][i])}
    out = {}
    for estimand, metric in metrics.items():
        r = paired_bootstrap(lambda i: metric(i, 0) - metric(i, 1), len(y), groups=groups, n_boot=n_boot, seed=seed)
        everything = np.arange(len(y))
        out[estimand] = {"n": int(len(y)), "value_a": metric(everything, 0), "value_b": metric(everything, 1),
                         "difference": r["diff"], "difference_lo": r["ci"][0], "difference_hi": r["ci"][1],
                         "difference_p_raw": r["p_value"]}
    return out


def write_robust(results_dir, out_dir: Path, model: str, datapack: str) -> list[Path]:
    """ncb_robust.csv / .md and ncb_robust_clean.csv / .md in out_dir where augmented probes have NCB results
    beside their plain probe's; returns their paths ([] when none has)."""
    table = robust_table(results_dir, model, datapack)
    if table.empty:
        return []
    clean = clean_table(results_dir, model, datapack)
    paths = [out_dir / "ncb_robust.csv", out_dir / "ncb_robust.md"]
    table.to_csv(paths[0], index=False)
    paths[1].write_text(robust_markdown(table))
    if not clean.empty:
        paths += [out_dir / "ncb_robust_clean.csv", out_dir / "ncb_robust_clean.md"]
        clean.to_csv(paths[2], index=False)
        paths[3].write_text(clean_markdown(clean))
    return paths


def robust_markdown(table: pd.DataFrame) -> str:
    def interval(r, column, fmt="{:+.3f}"):
        value, lo, hi = r[column], r[f"{column}_lo"], r[f"{column}_hi"]
        if pd.isna(value):
            return "n/a"
        return fmt.format(value) + ("" if pd.isna(lo) else f" [{fmt.format(lo)}, {fmt.format(hi)}]")

    lines = [f"Drop = 1 - accuracy under the context, on the test targets both probes get right clean; a - b < 0: a "
             f"is more robust; relative = drop a / drop b - 1. Paired cluster bootstrap over subject entities (the "
             f"same draws for a row's numbers); p: two-sided bootstrap p of a - b, raw / Holm-adjusted over every "
             f"row of this table (one family); significant = Holm p < {ALPHA}.", "",
             markdown_table(["a", "b", "interference", "level", "n (targets, entities)", "drop a", "drop b", "a - b",
                             "relative", "p / Holm", "significant", "P(y) shift a / b"],
                            [[r["a"], r["b"], r["interference"], r["level"], f"{r['n']} ({r['n_targets']}, {r['n_entities']})",
                              interval(r, "drop_a", "{:.3f}"), interval(r, "drop_b", "{:.3f}"), interval(r, "difference"),
                              interval(r, "relative"), p_text(r, "difference"), yes_no(r["difference_significant_holm"]),
                              f"{r['shift_a']:+.3f} / {r['shift_b']:+.3f}"] for _, r in table.iterrows()])]
    return "\n".join(lines)


def clean_markdown(table: pd.DataFrame) -> str:
    lines = [f"Clean test metrics of each pair's cells; a - b with a paired cluster-bootstrap 95 % interval; p raw / "
             f"Holm-adjusted within each estimand's family (every pair); significant = Holm p < {ALPHA}. "
             + "; ".join(f"{k}: {v}" for k, v in CLEAN.items()) + ".", "",
             markdown_table(["a", "b", "estimand", "n", "a", "b", "a - b", "p / Holm", "significant"],
                            [[r["a"], r["b"], r["estimand"], r["n"], f"{r['value_a']:.3f}", f"{r['value_b']:.3f}",
                              f"{r['difference']:+.3f} [{r['difference_lo']:+.3f}, {r['difference_hi']:+.3f}]",
                              p_text(r, "difference"), yes_no(r["difference_significant_holm"])]
                             for _, r in table.iterrows()])]
    return "\n".join(lines)
