"""`python -m experiments.report model=... data=...`: result cells -> per-layer tables and plots.

Reads every cell under <results_dir>/<model>/<datapack>/ and writes to <reports_dir>/<model>/<datapack>/:

    layers.csv, layers.md   one row per (probe, task, split, layer): MCC, W-MCC, acceptance (mean over
                            seeds) with intervals (one seed: its bootstrap 95 % interval; several seeds:
                            mean +/- the spread across seeds), n_seeds; zero-shot rows have layer "-"
    best.csv, best.md       per (probe, task, split): the layer with the highest calibration-split MCC
                            (never chosen on test) and its test metrics
    cells.md                what the report was made from: the cells' commits, groups made with mixed
                            settings (flag mixed_settings: not comparable), stored layers without a cell
    mcc_by_layer.png        MCC and W-MCC against layer (top) and relative depth (bottom), one panel per
                            task, one line per probe, zero-shot as horizontal lines
    reliability.png         reliability diagram (test split) of every probe at its best layer, first task, with ECE
    risk_coverage.png       risk-coverage curves of every probe at its best layer (and zero-shot), one panel per task
    aurc_by_layer.png       AURC (lower is better) against layer, one panel per task
    ncb.csv, ncb.md, ncb_stress.png         when `python -m ncb` results exist (experiments/ncb_report.py)
    truthfulqa_probe_mc.*, knows_vs_says.png  for data=truthfulqa (experiments/truthfulqa_report.py)
    ../transfer.*, ../transfer_<task>.png   the model's transfer matrix, when apply_probe transfer cells
                                            exist (experiments/transfer.py)

The best-layer table's `flag` says why a cell's numbers are not a fitted probe's (tables.cell_flag;
empty when healthy). best_vs_runner_up.csv (also in best.md): the best probe of each task (by
calibration MCC) against the runner-up on test, with abstention (MCC on each probe's accepted rows)
and without (argmax on all rows): paired bootstrap of the difference (whole subject entities
resampled) and McNemar's exact test on the same rows, raw and Holm-adjusted over the table's
comparisons of one estimand (experiments/compare.py, tables.with_holm).
With several seeds (same split_seed), `<metric>_seed_sd` is the probe's seed-to-seed spread,
apart from the sampling interval `<metric>_boot_lo/_hi` (mean of the seeds' bootstrap bounds).
"""
from __future__ import annotations

from toolkit.config import answer_help
from experiments.schema import ReportSchema

answer_help(__name__, "report", ReportSchema)   # before the imports below: --help needs no torch

import logging
from pathlib import Path

import pandas as pd
from omegaconf import DictConfig

from experiments import plots
from experiments.compare import ESTIMANDS, compare_cells
from experiments.tables import (ALPHA, MIXED, best_layers, coverage_gaps, cell_of, layer_table, load_cells, publish,
                                with_holm, yes_no)
from experiments.cross_model import write_cross_model
from experiments.ncb_report import write_ncb
from experiments.transfer import write_transfer
from experiments.truthfulqa_report import write_truthfulqa
from extract.statements import TRILEMMA, TRUTHFULQA
from toolkit.entry import entry_main
from toolkit.errors import check_writable
from toolkit.markdown import markdown_table
from toolkit.schema import typed_options

log = logging.getLogger(__name__)
VERSUS = {"mcc": "mcnemar", "mcc_all": "mcnemar_all"}   # estimand -> the McNemar test on the same rows


def best_vs_runner_up(cells: pd.DataFrame, best: pd.DataFrame, n_boot: int = 500) -> pd.DataFrame:
    """Per (task, split): the best probe (calibration MCC at its best layer) against the runner-up on
    test, one row per estimand of VERSUS (`estimand` names it, experiments.compare.ESTIMANDS): the
    difference best - runner-up with its paired bootstrap interval and p (`delta_*`), and McNemar's exact
    test on the rows that estimand compares (`mcnemar_*`: rows both accept / all rows), each
    Holm-adjusted over the table's comparisons of the same estimand (tables.with_holm)."""
    out = []
    for (task, split), g in best.groupby(["task", "split"]):
        if len(g) < 2:
            continue
        first, second = (r for _, r in g.sort_values("cal_mcc", ascending=False).head(2).iterrows())
        result = compare_cells(cell_of(cells, first), cell_of(cells, second), n_boot=n_boot)
        for key, mcnemar in VERSUS.items():
            r, m = result[key], result[mcnemar]
            out.append({"task": task, "split": split, "best": f"{first['probe']} (layer {int(first['layer'])})",
                        "runner_up": f"{second['probe']} (layer {int(second['layer'])})", "estimand": ESTIMANDS[key],
                        "delta": r["diff"], "delta_lo": r["ci"][0], "delta_hi": r["ci"][1], "delta_p_raw": r["p_value"],
                        "bootstrap": result["bootstrap"], "mcnemar_rows": m["n_both"], "mcnemar_p_raw": m["p_value"]})
    versus = pd.DataFrame(out)
    for prefix in ("delta", "mcnemar"):
        versus = with_holm(versus, prefix, ["estimand"])
    return versus


def write_report(results_dir: Path, reports_dir: Path, model: str, datapack: str) -> Path:
    """The report of one (model, datapack) (module docstring), written whole or not at all
    (experiments.tables.publish: a failure leaves the previous report as it was)."""
    cells = load_cells(results_dir, model, datapack)
    table = layer_table(cells)
    best = best_layers(table)
    versus = best_vs_runner_up(cells, best)
    gaps = coverage_gaps(cells)
    for line in gaps:
        log.warning("no cell at some stored layers (a sweep still running or stopped early?): %s", line)

    def build(out: Path) -> None:
        table.to_csv(out / "layers.csv", index=False)
        best.to_csv(out / "best.csv", index=False)
        versus.to_csv(out / "best_vs_runner_up.csv", index=False)
        (out / "layers.md").write_text(_markdown(table))
        (out / "best.md").write_text(_markdown(best) + "\n" + _versus_markdown(versus))
        (out / "cells.md").write_text(_cells_markdown(cells, gaps))
        title = f"{model} / {datapack}"
        plots.metric_by_layer(table, out / "mcc_by_layer.png", title)
        plots.metric_by_layer(table, out / "aurc_by_layer.png", title, metrics=("aurc",))
        if len(best):
            chosen = {(r["probe"], r["task"]): cell_of(cells, r) for _, r in best.iterrows()}
            behaviour = {(r["probe"], r["task"]): cell_of(cells, r) for _, r in table[table["layer"].isna()].iterrows()}
            plots.risk_coverage(chosen, behaviour, out / "risk_coverage.png", title)
            first_task = sorted(best["task"])[0]
            plots.reliability({p: c for (p, t), c in chosen.items() if t == first_task}, out / "reliability.png",
                              f"{title}, {plots.words(first_task)}")
        write_ncb(results_dir, out, model, datapack)             # nothing when `python -m ncb` has not run
        if datapack == TRUTHFULQA:
            write_truthfulqa(results_dir, out, model)               # probe vs likelihood MC1 / MC2

    out = publish(Path(reports_dir) / model / datapack, build)
    if any(Path(results_dir, model).glob("*->*")):              # apply_probe transfer cells exist
        write_transfer(results_dir, reports_dir, model)
    log.info("report written to %s (%d cells)", out, len(cells))
    return out


def _markdown(table: pd.DataFrame) -> str:
    def fmt(r, k):
        lo, hi = r.get(f"{k}_lo"), r.get(f"{k}_hi")
        return f"{r[k]:.3f}" if lo is None or pd.isna(lo) else f"{r[k]:.3f} [{lo:.3f}, {hi:.3f}]"

    rows = [[r["probe"], r["task"], r["split"], "none" if pd.isna(r["layer"]) else int(r["layer"]), fmt(r, "mcc"),
             fmt(r, "wmcc"), f"{r['acceptance']:.3f}", "" if pd.isna(r["cal_mcc"]) else f"{r['cal_mcc']:.3f}",
             r["n_seeds"], r["flag"] or ""] for _, r in table.iterrows()]
    lines = [markdown_table(["probe", "task", "split", "layer", "MCC", "W-MCC", "acceptance", "cal. MCC", "seeds",
                             "flag"], rows).rstrip("\n")]
    lines += ["", f"MCC: {ESTIMANDS['mcc']}; W-MCC: {ESTIMANDS['wmcc']}; cal. MCC: MCC without abstention "
              "(argmax, all rows) on the calibration split; flag: why a cell's numbers are not a fitted probe's."]
    return "\n".join(lines) + "\n"


def _cells_markdown(cells: pd.DataFrame, gaps: list[str]) -> str:
    """What the report was made from: the cells' commits (with counts), the (probe, task, split) groups made with
    mixed settings, and the stored layers without a cell (coverage_gaps)."""
    commits = cells["commit"].value_counts()
    lines = ["# The cells of this report", "", f"{len(cells)} cells, made at "
             + ", ".join(f"{c} ({n} cells)" for c, n in commits.items()) + ".", ""]
    mixed = sorted({(r.probe, r.task, r.split) for r in cells.itertuples() if MIXED in (r.flag or "")})
    lines += [f"Made with mixed settings (flagged {MIXED}, layers not comparable): "
              + ("; ".join(" ".join(m) for m in mixed) if mixed else "none") + ".", ""]
    lines += ["Stored layers without a cell: " + ("none." if not gaps else ""), *[f"- {g}" for g in gaps]]
    return "\n".join(lines) + "\n"


def _versus_markdown(versus: pd.DataFrame) -> str:
    lines = [f"Best probe (calibration MCC) - runner-up on test, one row per estimand. significant = the paired "
             f"bootstrap test's decision: two-sided p < {ALPHA} after Holm over this table's comparisons of the same "
             f"estimand. McNemar's exact test, on the rows the estimand compares, is a separate test with its own "
             f"Holm-adjusted decision.", "",
             markdown_table(["task", "split", "best", "runner-up", "estimand", "difference [95 % CI]", "p", "p (Holm)",
                             "significant", "McNemar: rows, p, p (Holm)", "McNemar significant"],
                            [[r["task"], r["split"], r["best"], r["runner_up"], r["estimand"],
                              f"{r['delta']:+.3f} [{r['delta_lo']:+.3f}, {r['delta_hi']:+.3f}]", f"{r['delta_p_raw']:.3g}",
                              f"{r['delta_p_holm']:.3g}", yes_no(r["delta_significant_holm"]),
                              f"{r['mcnemar_rows']}, {r['mcnemar_p_raw']:.3g}, {r['mcnemar_p_holm']:.3g}",
                              yes_no(r["mcnemar_significant_holm"])] for _, r in versus.iterrows()])]
    return "\n".join(lines)


_HINTS = {"cross_model": "a list of models, e.g. cross_model=[smollm2,gemma3-270m], or null"}


def validate(cfg: DictConfig) -> dict:
    """The options typed (toolkit.schema.typed_options) and reports_dir writable."""
    checked = typed_options(cfg, ReportSchema, _HINTS, {"model.name": "model=<name> or model.name=<name>",
                                                       "data.name": "data=<datapack> or data.name=<name>"})
    check_writable(checked["reports_dir"], "reports_dir")
    return checked


def report(cfg: DictConfig) -> Path:
    options = validate(cfg)
    out = write_report(Path(options["results_dir"]), Path(options["reports_dir"]), options["model"]["name"],
                       options["data"]["name"])
    if options["cross_model"]:   # several models: the cross-model view of the three Trilemma datapacks
        write_cross_model(options["results_dir"], options["reports_dir"], options["cross_model"], list(TRILEMMA))
    return out


main = entry_main("report", ReportSchema, report)


if __name__ == "__main__":
    main()
