"""`python -m experiments.cross_model models=[...] datapacks=[...]`: the paper's claims, tested across models.

Reads the layer-sweep cells of every (model, datapack) under <results_dir>/<model>/<datapack>/ (one split:
`split=entity_disjoint` (default), `reference` or `question_disjoint`, as train_probe's `split=`; a missing
model / datapack is logged and skipped) and writes to <reports_dir>/cross_model/, whole or not at all:

    depth_<datapack>.png    test MCC (solid, bootstrap band) and W-MCC (dashed) against relative depth
                            (layer / the model's n_layers), one colour per model, one panel per (probe, task)
    claims.csv              the three tables below in one file, told apart by the column `claim`
    claims.md               a provenance line (commit, date, command, machine) and what was swept, then the same
                            as markdown, one section per claim

and, given `page_dir=` (docs/results/claims for the committed results page), the same files there: rerunning the
command on the same cells rewrites them identically but for the provenance line.

Every layer is chosen on the calibration split (experiments.report.best_layers); test intervals are
95 % cluster-bootstrap intervals (whole subject entities resampled); differences are paired
(experiments.compare.compare_cells, whose ESTIMANDS name what each difference measures) with a
two-sided bootstrap p (`<difference>_p_raw`), Holm-adjusted over the claim's family
(`<difference>_p_holm`); significant = p < 0.05 (`_significant_raw` / `_significant_holm`).
`flag`: why a cell's numbers are not a fitted probe's (experiments.tables.cell_flag; empty when healthy).

    (a) depth     per (model, datapack, probe, task): relative depth and quarter of the best layer, the test
                  MCC at each quarter's best layer (Q1 [0, .25], Q2 (.25, .5], Q3 (.5, .75], Q4 (.75, 1]),
                  `peak_in_q3`, and the MCC difference Q3's best layer - the best layer outside Q3;
                  `layers_swept` of `n_stored_layers`: only a probe swept at every stored layer
                  (`full_sweep`) enters the depth claim (samil, fitted at one chosen layer, does not);
                  `a_summary`: per model, over the full sweeps, in how many combinations the peak lies in
                  Q3 and in how many Q3's best layer is significantly better / worse than the best layer
                  outside Q3 (raw and Holm over all the model's Q3-vs-rest comparisons), and which
                  combinations were excluded
                  beside each row its floors: the first stored layer's MCC, and the probe refitted on shuffled
                  training labels at its best layer (`<probe>+shuffled`, mean / min / max over the permutations)
    (b) neither   per (model, datapack, probe and control): the multiclass cell at its best layer: recall of
                  "neither", the share of neither statements abstained on, and of those misclassified the share
                  predicted false / true; neither_vs_all MCC at its best layer. The controls (FEATURE_CONTROLS:
                  linear+text, TF-IDF of the statement and no model; linear+surprisal, the model's mean / max NLL)
                  against each probe on the same test rows (`b_control`): neither_vs_all MCC without abstention
                  and multiclass neither recall, probe - control, Holm over the whole family of each difference;
                  `b_verdict` per (model, datapack): "separable beyond lexical novelty" when some probe beats every
                  control significantly, else "not distinguishable from lexical novelty on this datapack"
    (c) samil     per (model, datapack, task): samil and samil_reference (the reference code's procedure) -
                  linear / mlp / mean_diff, each at its best layer (`at` "best layers") and the rival at the
                  samil's layer ("same layer"): differences of MCC on accepted rows, W-MCC, MCC without
                  abstention and AUROC, and a verdict per metric, raw and Holm over all the model's comparisons
                  of that metric; `c_summary`: per model, the verdicts counted
"""
from __future__ import annotations

from toolkit.config import answer_help
from experiments.schema import CrossModelSchema

answer_help(__name__, "cross_model", CrossModelSchema)   # before the imports below: --help is quick

import logging
from pathlib import Path

import numpy as np
import pandas as pd
from omegaconf import DictConfig

from evaluation.cells import CellError
from toolkit.provenance import host, page_command, page_stamp
from experiments import plots
from experiments.claims_neither import (best_row, control_claims, control_verdicts, interval_of, neither_claims,
                                       neither_verdicts)
from experiments.claims_page import C_METRICS, claims_markdown, coverage_markdown
from experiments.compare import compare_cells
from experiments.tables import (best_layers, cell_of, holm_resolution_warning, layer_table, load_cells, publish,
                                with_holm)
from toolkit.errors import check_count, check_name, check_writable
from toolkit.entry import entry_main
from toolkit.schema import typed_options

log = logging.getLogger(__name__)
QUARTER_EDGES = (0.25, 0.5, 0.75)
SINGLE_INSTANCE = ("linear", "mlp", "mean_diff")
MIL_PROBES = ("samil", "samil_reference")   # claim (c): ours and the reference code's procedure
BASELINES = ("ttpd", "spca", "ccs")          # the reference's baselines, compared like claim (c)'s sAwMILs
CONTROLS = ("text", "surprisal", "shuffled")   # controls with their own cells (random_direction is swept as a probe)


def depth_quarter(depth) -> np.ndarray:
    """Quarter (1..4) of relative depths in [0, 1]: Q1 [0, .25], Q2 (.25, .5], Q3 (.5, .75], Q4 (.75, 1]."""
    return np.searchsorted(QUARTER_EDGES, np.asarray(depth, dtype=float), side="left") + 1


def control_of(method: str) -> str | None:
    """The control a method's cells are (CONTROLS: "text", "surprisal" or "shuffled", from the method suffix
    probes.pipeline.method_name gives them), None for a probe (random_direction is swept as a probe)."""
    suffixes = method.split("+")[1:]
    return next((c for c in CONTROLS if c in suffixes), None)


def load_study(results_dir: Path, models: list[str], datapacks: list[str],
               split: str = "entity_disjoint") -> dict[tuple[str, str], tuple[pd.DataFrame, pd.DataFrame]]:
    """{(model, datapack): (cells, layer table)} of the cells of `split`: the probes' (methods without a layer
    left out) and the controls' (control_of; kept in `cells`, out of the table); the table gains `depth` (layer / n_layers), `quarter`, and per (probe, task) `layers_swept`,
    `n_stored_layers` and `full_sweep` (swept at every stored layer, see `stored_layers`). Missing ones
    are logged and skipped."""
    study = {}
    for model in models:
        for datapack in datapacks:
            root = Path(results_dir) / check_name(model, "models") / check_name(datapack, "datapacks")
            if not root.is_dir():
                log.info("no cells for %s / %s under %s: skipped", model, datapack, root)
                continue
            cells = load_cells(results_dir, model, datapack)
            cells = cells[cells["split"] == split].reset_index(drop=True)
            controls = cells["probe"].map(control_of).notna()
            cells = cells[controls | cells["layer"].notna()].reset_index(drop=True)
            probes = cells[cells["probe"].map(control_of).isna()]
            if probes.empty:
                log.info("no %s probe cells for %s / %s: skipped", split, model, datapack)
                continue
            if probes["n_layers"].isna().any():
                raise CellError(f"cells under {root} record no store.n_layers, so their relative depth is unknown: "
                                "rerun `python -m train_probe` on them with overwrite=true")
            table = layer_table(probes)
            table["depth"] = table["layer"].astype(float) / table["n_layers"].astype(float)
            table["quarter"] = depth_quarter(table["depth"])
            stored = stored_layers(probes)
            layers = table.groupby(["probe", "task"])["layer"]
            table["layers_swept"] = layers.transform("nunique")
            table["n_stored_layers"] = len(stored)
            table["full_sweep"] = layers.transform(lambda k: stored <= set(k.astype(int))).astype(bool)
            study[model, datapack] = cells, table
    if not study:
        raise CellError(f"no result cells for models {models} and datapacks {datapacks} under {results_dir}: "
                        "run the layer sweeps first (`python -m train_probe experiment=layer_sweep`)")
    return study


def stored_layers(cells: pd.DataFrame) -> set[int]:
    """The layers of the store behind one (model, datapack)'s cells: as the cells record it (their store's
    `layers`), else every layer at which any of the cells was fitted (the widest sweeps')."""
    recorded = [set(k) for k in cells["stored_layers"] if isinstance(k, (list, tuple))]
    return set().union(*recorded) if recorded else set(cells["layer"].dropna().astype(int))


def depth_claims(model: str, datapack: str, cells: pd.DataFrame, table: pd.DataFrame, n_boot: int) -> list[dict]:
    """Claim (a) rows of one (model, datapack), one per (probe, task); see the module docstring."""
    rows = []
    for (probe, task), g in table.groupby(["probe", "task"]):
        best = best_row(g)
        row = {"claim": "a", "model": model, "datapack": datapack, "probe": probe, "task": task,
               "n_layers": int(best["n_layers"]), "layers_swept": int(best["layers_swept"]),
               "n_stored_layers": int(best["n_stored_layers"]), "full_sweep": bool(best["full_sweep"]),
               "layer": int(best["layer"]), "depth": best["depth"], "quarter": int(best["quarter"]),
               "peak_in_q3": bool(best["quarter"] == 3), "flag": best["flag"],
               **interval_of("mcc", best["mcc"], (best["mcc_lo"], best["mcc_hi"])),
               **interval_of("q3_vs_rest_mcc", np.nan, (np.nan, np.nan)), "q3_vs_rest_mcc_p_raw": np.nan,
               **floors(cells, g, probe, task, int(best["layer"]))}
        for q in range(1, 5):
            inside = g[g["quarter"] == q]
            if len(inside):
                b = best_row(inside)
                row.update({f"q{q}_layer": int(b["layer"]),
                            **interval_of(f"q{q}_mcc", b["mcc"], (b["mcc_lo"], b["mcc_hi"]))})
        inside, outside = g[g["quarter"] == 3], g[g["quarter"] != 3]
        if not best["full_sweep"]:
            log.info("%s / %s / %s / %s: swept at %d of %d stored layers, left out of claim (a)", model, datapack,
                     probe, task, best["layers_swept"], best["n_stored_layers"])
        elif len(inside) and len(outside):
            q3, rest = best_row(inside), best_row(outside)
            result = compare_cells(cell_of(cells, q3), cell_of(cells, rest), n_boot=n_boot)["mcc"]
            row.update(outside_layer=int(rest["layer"]), q3_vs_rest_mcc_p_raw=result["p_value"],
                       **interval_of("q3_vs_rest_mcc", result["diff"], result["ci"]))
        rows.append(row)
    return rows


def floors(cells: pd.DataFrame, g: pd.DataFrame, probe: str, task: str, layer: int) -> dict:
    """A depth row's floors: `first_layer` (the first stored layer swept, layer 0 where it was stored) and its
    test MCC; `shuffled_mcc`, the mean test MCC of the probe refitted on permuted training labels at its best
    layer (`<probe>+shuffled` cells, one per permutation seed; `shuffled_mcc_lo` / `_hi` their min and max,
    `n_permutations`; NaN and 0 where none was fitted)."""
    first = g.loc[g["layer"].astype(int).idxmin()]
    null = cells[(cells["probe"] == f"{probe}+shuffled") & (cells["task"] == task) & (cells["layer"] == layer)]
    mcc = pd.to_numeric(null["mcc"]).to_numpy(dtype=float)
    return {"first_layer": int(first["layer"]), "first_layer_mcc": first["mcc"], "n_permutations": len(mcc),
            **interval_of("shuffled_mcc", *((mcc.mean(), (mcc.min(), mcc.max())) if len(mcc) else
                                          (np.nan, (np.nan, np.nan))))}


def depth_summary(depth: pd.DataFrame) -> list[dict]:
    """Per model, over its full sweeps (probes swept at every stored layer): how often the peak lies in Q3,
    and how often Q3's best layer is significantly better / worse on test than the best layer outside Q3
    (`depth` after with_holm: raw and Holm); the combinations left out, with their layers swept."""
    rows = []
    for model, g in depth.groupby("model", sort=False):
        swept, left_out = g[g["full_sweep"]], g[~g["full_sweep"]]
        tested = swept.dropna(subset=["q3_vs_rest_mcc_p_raw"])
        row = {"claim": "a_summary", "model": model, "n_combinations": len(swept),
               "n_peak_in_q3": int(swept["peak_in_q3"].sum()), "n_tested": len(tested),
               "median_q3_vs_rest_mcc": float(tested["q3_vs_rest_mcc"].median()) if len(tested) else np.nan,
               "n_excluded": len(left_out),
               "excluded": "; ".join(f"{r.datapack} / {r.probe} / {r.task} ({r.layers_swept} of {r.n_stored_layers} "
                                     "layers)" for r in left_out.itertuples())}
        row.update(directions(tested, "q3_vs_rest_mcc", "q3"))
        rows.append(row)
    return rows


def directions(tested: pd.DataFrame, prefix: str, name: str) -> dict:
    """{n_<name>_better_raw, n_<name>_worse_raw, .._holm}: rows of `tested` (after with_holm) whose
    difference `prefix` is significant and above / below 0."""
    out = {}
    for kind in ("raw", "holm"):
        significant = tested[f"{prefix}_significant_{kind}"].fillna(False).astype(bool)
        out[f"n_{name}_better_{kind}"] = int((significant & (tested[prefix] > 0)).sum())
        out[f"n_{name}_worse_{kind}"] = int((significant & (tested[prefix] < 0)).sum())
    return out


def verdict(diff: float, significant) -> str:
    """samil - other: better / worse when the difference is significant and above / below 0, else no
    significant difference; undefined where there was no test (significant <NA>)."""
    if pd.isna(significant):
        return "undefined"
    return "no significant difference" if not significant else "samil better" if diff > 0 else "samil worse"


def samil_claims(model: str, datapack: str, cells: pd.DataFrame, table: pd.DataFrame, n_boot: int,
                 challengers: tuple[str, ...] = MIL_PROBES, claim: str = "c") -> list[dict]:
    """Claim (c) rows of one (model, datapack): each of `challengers` (MIL_PROBES: ours, the reference's procedure;
    or BASELINES, rows of `claim` "baselines") against each single-instance probe, per task, at each probe's own
    best calibration layer (`at`: "best layers") and with the rival at the challenger's layer ("same layer")."""
    best = {(r["probe"], r["task"]): r for _, r in best_layers(table).iterrows()}
    rows = []
    for task in sorted(table["task"].unique()):
        for mil in challengers:
            if (mil, task) not in best:
                log.info("%s / %s / %s: no %s cells, left out of claim (c)", model, datapack, task, mil)
                continue
            samil = best[mil, task]
            for other in (p for p in SINGLE_INSTANCE if (p, task) in best):
                same = table[(table["probe"] == other) & (table["task"] == task) & (table["layer"] == samil["layer"])]
                for at, rival in (("best layers", best[other, task]), ("same layer", same.iloc[0] if len(same) else None)):
                    if rival is None:
                        continue
                    result = compare_cells(cell_of(cells, samil), cell_of(cells, rival), n_boot=n_boot)
                    row = {"claim": claim, "model": model, "datapack": datapack, "task": task, "samil": mil,
                           "versus": other, "at": at, "samil_layer": int(samil["layer"]),
                           "other_layer": int(rival["layer"]), "samil_flag": samil["flag"],
                           "other_flag": rival["flag"], "p_mcnemar": result["mcnemar"]["p_value"],
                           "bootstrap": result["bootstrap"]}
                    for metric in C_METRICS:
                        r = result[metric]
                        row.update(interval_of(f"delta_{metric}", r["diff"], r["ci"]),
                                   **{f"delta_{metric}_p_raw": r["p_value"]})
                    rows.append(row)
    return rows


def samil_verdicts(samil: pd.DataFrame) -> pd.DataFrame:
    """Claim (c) rows with Holm over each model's comparisons of one metric, and `verdict_<metric>_raw` /
    `_holm` from the two decisions."""
    if samil.empty:
        return samil
    for metric in C_METRICS:
        prefix = f"delta_{metric}"
        samil = with_holm(samil, prefix, ["model"])
        for kind in ("raw", "holm"):
            samil[f"verdict_{metric}_{kind}"] = [verdict(d, s) for d, s in
                                                 zip(samil[prefix], samil[f"{prefix}_significant_{kind}"])]
    return samil


def samil_summary(samil: pd.DataFrame) -> list[dict]:
    """Per (model, samil variant): its claim (c) comparisons, and per metric how many say it is significantly
    better / worse (raw and Holm)."""
    rows = []
    for (model, mil), g in (samil.groupby(["model", "samil"], sort=False) if len(samil) else ()):
        row = {"claim": "c_summary", "model": model, "samil": mil, "n_comparisons": len(g)}
        for metric in C_METRICS:
            row.update({f"{k}_{metric}": v for k, v in directions(g, f"delta_{metric}", "samil").items()})
        rows.append(row)
    return rows


def write_cross_model(results_dir: Path, reports_dir: Path, models: list[str], datapacks: list[str],
                      split: str = "entity_disjoint", n_boot: int = 1000, page_dir: Path | None = None) -> Path:
    """The depth figures and claims tables (module docstring) in <reports_dir>/cross_model/ and, given
    `page_dir`, the same files there too (the results page docs/results/claims/), each whole or not at all
    (tables.publish)."""
    models, datapacks = list(models), list(datapacks)
    study = load_study(results_dir, models, datapacks, split)
    parts = {"a": [], "b": [], "c": [], "versus": [], "baselines": []}
    for (model, datapack), (cells, table) in study.items():
        parts["a"] += depth_claims(model, datapack, cells, table, n_boot)
        parts["b"] += neither_claims(model, datapack, cells, table, n_boot)
        parts["versus"] += control_claims(model, datapack, cells, table, n_boot)
        parts["c"] += samil_claims(model, datapack, cells, table, n_boot)
        parts["baselines"] += samil_claims(model, datapack, cells, table, n_boot, BASELINES, "baselines")
    depth, neither, samil, versus = (pd.DataFrame(parts[k]) for k in ("a", "b", "c", "versus"))
    baselines = samil_verdicts(pd.DataFrame(parts["baselines"]))
    versus = control_verdicts(versus)
    verdicts = pd.DataFrame(neither_verdicts(versus))
    depth = with_holm(depth, "q3_vs_rest_mcc", ["model"])
    samil = samil_verdicts(samil)
    summary, samil_counts = pd.DataFrame(depth_summary(depth)), pd.DataFrame(samil_summary(samil))
    family = max((int(t.groupby("model")[col].count().max()) for t, col in
                  ((depth, "q3_vs_rest_mcc_p_raw"), (samil, "delta_mcc_p_raw")) if not t.empty), default=0)
    family = max(family, int(versus["delta_mcc_all_p_raw"].count()) if "delta_mcc_all_p_raw" in versus else 0)
    if warning := holm_resolution_warning(n_boot, family):
        log.warning(warning)

    stamp = f"{page_stamp()}, `{page_command()}`, {host()}"

    def build(out: Path) -> None:
        colours = {m: f"C{i}" for i, m in enumerate(models)}
        figures = []
        for datapack in datapacks:
            tables = {m: study[m, datapack][1] for m in models if (m, datapack) in study}
            if tables:
                figures.append(f"depth_{datapack}.png")
                plots.depth_figure(tables, colours, QUARTER_EDGES[1:], out / figures[-1], f"{datapack} ({split})")
            else:
                log.info("no model has cells for %s: no depth_%s.png", datapack, datapack)
        claims = pd.concat([depth, summary, neither, versus, verdicts, samil, samil_counts, baselines],
                           ignore_index=True)
        claims.to_csv(out / "claims.csv", index=False)
        (out / "claims.md").write_text(claims_markdown(depth, summary, neither, samil, samil_counts,
                                                       coverage_markdown(study, stamp, figures), versus, verdicts,
                                                       baselines))

    if page_dir is not None:
        publish(Path(page_dir), build)
        log.info("results page written to %s", page_dir)
    out = publish(Path(reports_dir) / "cross_model", build)
    log.info("cross-model report written to %s (%d model / datapack pairs)", out, len(study))
    return out


def cross_model(cfg: DictConfig) -> Path:
    o = typed_options(cfg, CrossModelSchema, {"n_boot": "a whole number >= 1", "models": "a list, e.g. [smollm2]"})
    check_count(o["n_boot"], "n_boot")
    check_writable(o["reports_dir"], "reports_dir")
    if o["page_dir"] is not None:
        check_writable(o["page_dir"], "page_dir")
    return write_cross_model(Path(o["results_dir"]), Path(o["reports_dir"]), o["models"], o["datapacks"],
                             o["split"]["kind"], o["n_boot"], None if o["page_dir"] is None else Path(o["page_dir"]))


main = entry_main("cross_model", CrossModelSchema, cross_model)


if __name__ == "__main__":
    main()
