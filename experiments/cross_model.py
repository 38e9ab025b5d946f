"""`python -m experiments.cross_model models=[...] datapacks=[...]`: the paper's claims, tested across models.

Reads the layer-sweep cells of every (model, datapack) under <results_dir>/<model>/<datapack>/ (one split,
entity_disjoint by default; a missing model / datapack is logged and skipped) and writes to
<reports_dir>/cross_model/:

    depth_<datapack>.png    test MCC (solid, bootstrap band) and W-MCC (dashed) against relative depth
                            (layer / the model's n_layers), one colour per model, one panel per (probe, task)
    claims.csv              the three tables below in one file, told apart by the column `claim`
    claims.md               the same as markdown, one section per claim

Every layer is chosen on the calibration split (experiments.report.best_layers); test intervals are
95 % cluster-bootstrap intervals (whole subject entities resampled); differences are paired
(experiments.compare.compare_cells).

    (a) depth     per (model, datapack, probe, task): relative depth and quarter of the best layer, the test
                  MCC at each quarter's best layer (Q1 [0, .25], Q2 (.25, .5], Q3 (.5, .75], Q4 (.75, 1]),
                  `peak_in_q3`, and the MCC difference Q3's best layer - the best layer outside Q3;
                  `a_summary`: per model, in how many combinations the peak lies in Q3 and in how many
                  Q3's best layer is significantly better / worse than the best layer outside Q3
    (b) neither   per (model, datapack, probe): the multiclass cell at its best layer: recall of "neither",
                  the share of neither statements abstained on, and of those misclassified the share
                  predicted false / true; neither_vs_all MCC at its best layer
    (c) samil     per (model, datapack, task): samil - linear / mlp / mean_diff, each at its best layer:
                  MCC and W-MCC differences and a verdict per metric (interval above / below 0)
"""
from __future__ import annotations

import logging
from pathlib import Path

import hydra
import numpy as np
import pandas as pd
from omegaconf import DictConfig

from evaluation.cells import CellError
from evaluation.metrics import ABSTAIN
from evaluation.selective import paired_bootstrap
from experiments import plots
from experiments.compare import compare_cells
from experiments.tables import best_layers, cell_of, layer_table, load_cells
from extract.errors import check_name, run_entry
from extract.statements import FALSE, NEITHER, TRUE

log = logging.getLogger(__name__)
QUARTER_EDGES = (0.25, 0.5, 0.75)
SINGLE_INSTANCE = ("linear", "mlp", "mean_diff")


def depth_quarter(depth) -> np.ndarray:
    """Quarter (1..4) of relative depths in [0, 1]: Q1 [0, .25], Q2 (.25, .5], Q3 (.5, .75], Q4 (.75, 1]."""
    return np.searchsorted(QUARTER_EDGES, np.asarray(depth, dtype=float), side="left") + 1


def load_study(results_dir: Path, models: list[str], datapacks: list[str],
               split: str = "entity_disjoint") -> dict[tuple[str, str], tuple[pd.DataFrame, pd.DataFrame]]:
    """{(model, datapack): (cells, layer table)} of the probes' cells of `split` (methods without a layer
    left out); the table gains `depth` (layer / n_layers) and `quarter`. Missing ones are logged and skipped."""
    study = {}
    for model in models:
        for datapack in datapacks:
            root = Path(results_dir) / check_name(model, "models") / check_name(datapack, "datapacks")
            if not root.is_dir():
                log.info("no cells for %s / %s under %s: skipped", model, datapack, root)
                continue
            cells = load_cells(results_dir, model, datapack)
            cells = cells[(cells["split"] == split) & cells["layer"].notna()].reset_index(drop=True)
            if cells.empty:
                log.info("no %s probe cells for %s / %s: skipped", split, model, datapack)
                continue
            if cells["n_layers"].isna().any():
                raise CellError(f"cells under {root} record no store.n_layers, so their relative depth is unknown: "
                                "rerun `python -m train_probe` on them with overwrite=true")
            table = layer_table(cells)
            table["depth"] = table["layer"].astype(float) / table["n_layers"].astype(float)
            table["quarter"] = depth_quarter(table["depth"])
            study[model, datapack] = cells, table
    if not study:
        raise CellError(f"no result cells for models {models} and datapacks {datapacks} under {results_dir}: "
                        "run the layer sweeps first (`python -m train_probe experiment=layer_sweep`)")
    return study


def _best(table: pd.DataFrame) -> pd.Series:
    """The one (probe, task) table's row with the best calibration MCC."""
    return best_layers(table).iloc[0]


def _interval(prefix: str, value: float, ci) -> dict:
    return {prefix: value, f"{prefix}_lo": ci[0], f"{prefix}_hi": ci[1]}


def depth_claims(model: str, datapack: str, cells: pd.DataFrame, table: pd.DataFrame, n_boot: int) -> list[dict]:
    """Claim (a) rows of one (model, datapack), one per (probe, task); see the module docstring."""
    rows = []
    for (probe, task), g in table.groupby(["probe", "task"]):
        best = _best(g)
        row = {"claim": "a", "model": model, "datapack": datapack, "probe": probe, "task": task,
               "n_layers": int(best["n_layers"]), "layer": int(best["layer"]), "depth": best["depth"],
               "quarter": int(best["quarter"]), "peak_in_q3": bool(best["quarter"] == 3),
               **_interval("mcc", best["mcc"], (best["mcc_lo"], best["mcc_hi"]))}
        for q in range(1, 5):
            inside = g[g["quarter"] == q]
            if len(inside):
                b = _best(inside)
                row.update({f"q{q}_layer": int(b["layer"]),
                            **_interval(f"q{q}_mcc", b["mcc"], (b["mcc_lo"], b["mcc_hi"]))})
        inside, outside = g[g["quarter"] == 3], g[g["quarter"] != 3]
        if len(inside) and len(outside):
            q3, rest = _best(inside), _best(outside)
            result = compare_cells(cell_of(cells, q3), cell_of(cells, rest), n_boot=n_boot)
            row.update(outside_layer=int(rest["layer"]),
                       **_interval("q3_vs_rest_mcc", result["mcc"]["diff"], result["mcc"]["ci"]))
        rows.append(row)
    return rows


def depth_summary(depth: pd.DataFrame) -> list[dict]:
    """Per model, over its (datapack, probe, task) combinations: how often the peak lies in Q3, and how
    often Q3's best layer is significantly better / worse on test than the best layer outside Q3."""
    rows = []
    for model, g in depth.groupby("model", sort=False):
        tested = g.dropna(subset=["q3_vs_rest_mcc_lo"]) if "q3_vs_rest_mcc_lo" in g else g.iloc[:0]
        rows.append({"claim": "a_summary", "model": model, "n_combinations": len(g),
                     "n_peak_in_q3": int(g["peak_in_q3"].sum()), "n_tested": len(tested),
                     "n_q3_better": int((tested["q3_vs_rest_mcc_lo"] > 0).sum()),
                     "n_q3_worse": int((tested["q3_vs_rest_mcc_hi"] < 0).sum()),
                     "median_q3_vs_rest_mcc": float(tested["q3_vs_rest_mcc"].median()) if len(tested) else np.nan})
    return rows


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
        out.update(_interval(name, r["diff"], r["ci"]))
    return out


def neither_claims(model: str, datapack: str, cells: pd.DataFrame, table: pd.DataFrame, n_boot: int) -> list[dict]:
    """Claim (b) rows of one (model, datapack), one per probe with a multiclass cell."""
    rows = []
    for probe, g in table.groupby("probe"):
        multi, binary = g[g["task"] == "multiclass"], g[g["task"] == "neither_vs_all"]
        if multi.empty:
            log.info("%s / %s / %s: no multiclass cells, left out of claim (b)", model, datapack, probe)
            continue
        best = _best(multi)
        test = cell_of(cells, best)["test"]
        groups = np.asarray(test["groups"]) if test.get("groups") is not None else None
        row = {"claim": "b", "model": model, "datapack": datapack, "probe": probe, "layer": int(best["layer"]),
               "depth": best["depth"], **neither_shares(test["y"], test["pred"], groups, n_boot)}
        if len(binary):
            b = _best(binary)
            row.update(neither_vs_all_layer=int(b["layer"]),
                       **_interval("neither_vs_all_mcc", b["mcc"], (b["mcc_lo"], b["mcc_hi"])))
        rows.append(row)
    return rows


def verdict(ci) -> str:
    """samil - other: better when the interval lies above 0, worse below, else no significant difference."""
    lo, hi = ci
    if np.isnan(lo) or np.isnan(hi):
        return "undefined"
    return "samil better" if lo > 0 else "samil worse" if hi < 0 else "no significant difference"


def samil_claims(model: str, datapack: str, cells: pd.DataFrame, table: pd.DataFrame, n_boot: int) -> list[dict]:
    """Claim (c) rows of one (model, datapack): samil against each single-instance probe, per task."""
    best = {(r["probe"], r["task"]): r for _, r in best_layers(table).iterrows()}
    rows = []
    for task in sorted(table["task"].unique()):
        if ("samil", task) not in best:
            log.info("%s / %s / %s: no samil cells, left out of claim (c)", model, datapack, task)
            continue
        samil = best["samil", task]
        for other in (p for p in SINGLE_INSTANCE if (p, task) in best):
            rival = best[other, task]
            result = compare_cells(cell_of(cells, samil), cell_of(cells, rival), n_boot=n_boot)
            rows.append({"claim": "c", "model": model, "datapack": datapack, "task": task, "versus": other,
                         "samil_layer": int(samil["layer"]), "other_layer": int(rival["layer"]),
                         **_interval("delta_mcc", result["mcc"]["diff"], result["mcc"]["ci"]),
                         **_interval("delta_wmcc", result["wmcc"]["diff"], result["wmcc"]["ci"]),
                         "p_mcnemar": result["mcnemar"]["p_value"], "bootstrap": result["bootstrap"],
                         "verdict_mcc": verdict(result["mcc"]["ci"]), "verdict_wmcc": verdict(result["wmcc"]["ci"])})
    return rows


def depth_figure(tables: dict[str, pd.DataFrame], colours: dict[str, str], path: Path, title: str) -> None:
    """tables: {model: layer table with `depth`}; one panel per (probe row, task column), MCC solid with
    its interval as a band, W-MCC dashed, one colour per model; Q3 shaded."""
    plt = plots.pyplot()
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
            ax.axvspan(QUARTER_EDGES[1], QUARTER_EDGES[2], color="k", alpha=0.06, linewidth=0)
            ax.grid(alpha=0.3)
            ax.set_title(task if i == 0 else "", fontsize=9)
            if j == 0:
                ax.set_ylabel(probe)
            if i == len(probes) - 1:
                ax.set_xlabel("relative depth (layer / L)")
    plots.legend_below(fig, axes)
    fig.suptitle(f"{title}: test MCC (solid) and W-MCC (dashed); Q3 shaded")
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _ci(r: pd.Series, prefix: str, signed: bool = False, layer: str | None = None) -> str:
    """"value [lo, hi]" of r's prefix, prefix_lo, prefix_hi, then " L<k>" of r's `layer` column if given;
    "-" where r has no value."""
    if pd.isna(r.get(prefix, np.nan)):
        return "-"
    f = "{:+.3f}" if signed else "{:.3f}"
    text = f"{f.format(r[prefix])} [{f.format(r[f'{prefix}_lo'])}, {f.format(r[f'{prefix}_hi'])}]"
    return text if layer is None else f"{text} L{int(r[layer])}"


def _table(header: list[str], lines: list[list[str]]) -> str:
    rows = [header, ["---"] * len(header), *lines]
    return "\n".join("| " + " | ".join(str(x) for x in row) + " |" for row in rows) + "\n"


def claims_markdown(depth: pd.DataFrame, summary: pd.DataFrame, neither: pd.DataFrame, samil: pd.DataFrame) -> str:
    """claims.md: one section per claim, summary lines first, then a table."""
    text = ["## (a) Does the signal concentrate in the third quarter of depth?", "",
            ("Best layer chosen on the calibration split; test MCC with cluster-bootstrap 95 % intervals at each "
            "depth quarter's best layer (Q1 [0, .25], Q2 (.25, .5], Q3 (.5, .75], Q4 (.75, 1] of layer / L); last "
            "column: paired difference of test MCC, Q3's best layer - the best layer outside Q3."), ""]
    for _, s in summary.iterrows():
        text.append(f"- **{s['model']}**: the best layer lies in Q3 in {s['n_peak_in_q3']} of {s['n_combinations']} "
                    f"(datapack, probe, task) combinations; Q3's best layer against the best layer outside Q3: "
                    f"significantly better in {s['n_q3_better']}, worse in {s['n_q3_worse']} of {s['n_tested']} "
                    f"(median MCC difference {s['median_q3_vs_rest_mcc']:+.3f}).")
    lines = []
    for _, r in depth.iterrows():
        quarters = [_ci(r, f"q{q}_mcc", layer=f"q{q}_layer") for q in range(1, 5)]
        lines.append([r["model"], r["datapack"], r["probe"], r["task"],
                      f"{r['layer']} ({r['depth']:.2f}, Q{r['quarter']})", *quarters,
                      "yes" if r["peak_in_q3"] else "no", _ci(r, "q3_vs_rest_mcc", signed=True)])
    text += ["", _table(["model", "datapack", "probe", "task", "best layer (depth, quarter)", "Q1 MCC", "Q2 MCC",
                         "Q3 MCC", "Q4 MCC", "peak in Q3", "Q3 - rest MCC"], lines)]

    text += ["## (b) Is \"neither\" separable as its own class rather than as false?", "",
             ("Multiclass probe at its best calibration layer, test statements labelled neither: recall, share "
             "abstained on, and of those predicted a real class the share predicted false / true (cluster-bootstrap "
             "95 % intervals); neither_vs_all test MCC at its own best layer."), ""]
    lines = [[r["model"], r["datapack"], r["probe"], f"{r['layer']} ({r['depth']:.2f})", _ci(r, "neither_recall"),
              _ci(r, "neither_abstained"), _ci(r, "misclassified_as_false"), _ci(r, "misclassified_as_true"),
              f"{r['n_neither']} ({r['n_as_false']} / {r['n_as_true']} / {r['n_abstained']})",
              _ci(r, "neither_vs_all_mcc", layer="neither_vs_all_layer")]
             for _, r in neither.iterrows()]
    text += [_table(["model", "datapack", "probe", "multiclass layer (depth)", "neither recall", "abstained",
                     "misclassified: false", "misclassified: true", "n neither (as false / true / abstained)",
                     "neither_vs_all MCC"], lines)]

    text += ["## (c) Does sAwMIL beat the single-instance probes?", "",
             ("Each probe at its best calibration layer; paired cluster-bootstrap differences samil - other of test "
             "MCC and W-MCC (95 % intervals); a verdict says whether the interval lies above 0 (samil better), below "
             "(samil worse) or covers 0."), ""]
    lines = [[r["model"], r["datapack"], r["task"], r["versus"], f"{r['samil_layer']} / {r['other_layer']}",
              _ci(r, "delta_mcc", signed=True), _ci(r, "delta_wmcc", signed=True), f"{r['p_mcnemar']:.3g}",
              r["verdict_mcc"], r["verdict_wmcc"]] for _, r in samil.iterrows()]
    text += [_table(["model", "datapack", "task", "samil vs", "layers (samil / other)", "MCC difference",
                     "W-MCC difference", "p (McNemar)", "verdict (MCC)", "verdict (W-MCC)"], lines)]
    return "\n".join(text)


def write_cross_model(results_dir: Path, reports_dir: Path, models: list[str], datapacks: list[str],
                      split: str = "entity_disjoint", n_boot: int = 1000) -> Path:
    """The depth figures and the claims tables (module docstring) under <reports_dir>/cross_model/."""
    models, datapacks = list(models), list(datapacks)
    study = load_study(results_dir, models, datapacks, split)
    out = Path(reports_dir) / "cross_model"
    out.mkdir(parents=True, exist_ok=True)
    colours = {m: f"C{i}" for i, m in enumerate(models)}
    for datapack in datapacks:
        tables = {m: study[m, datapack][1] for m in models if (m, datapack) in study}
        if tables:
            depth_figure(tables, colours, out / f"depth_{datapack}.png", f"{datapack} ({split})")
        else:
            log.info("no model has cells for %s: no depth_%s.png", datapack, datapack)
    parts = {"a": [], "b": [], "c": []}
    for (model, datapack), (cells, table) in study.items():
        parts["a"] += depth_claims(model, datapack, cells, table, n_boot)
        parts["b"] += neither_claims(model, datapack, cells, table, n_boot)
        parts["c"] += samil_claims(model, datapack, cells, table, n_boot)
    depth, neither, samil = (pd.DataFrame(parts[k]) for k in "abc")
    summary = pd.DataFrame(depth_summary(depth))
    pd.concat([depth, summary, neither, samil], ignore_index=True).to_csv(out / "claims.csv", index=False)
    (out / "claims.md").write_text(claims_markdown(depth, summary, neither, samil))
    log.info("cross-model report written to %s (%d model / datapack pairs)", out, len(study))
    return out


def cross_model(cfg: DictConfig) -> Path:
    return write_cross_model(Path(cfg.results_dir), Path(cfg.reports_dir), list(cfg.models), list(cfg.datapacks),
                             cfg.split, int(cfg.n_boot))


@hydra.main(version_base="1.3", config_path="../conf", config_name="cross_model")
def main(cfg: DictConfig) -> None:
    run_entry(cross_model, cfg, log=log)


if __name__ == "__main__":
    main()
