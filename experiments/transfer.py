"""`python -m experiments.transfer model=smollm2`: how probes fitted on one datapack do on the others.

For each training datapack and each probe and task, the layer with the best calibration-split MCC
(the report's rule, experiments.report.best_layers) is applied to every evaluation datapack's store of
the same model (apply_probe; only missing transfer cells are computed; the diagonal is the ordinary
cell's test split). Writes to <reports_dir>/<model>/:

    transfer.csv, transfer.md   one row per (probe, task, train, eval): MCC on accepted rows and W-MCC
                                with their bootstrap 95 % intervals, acceptance, statements, the
                                threshold-free AUROC of the raw scores (all rows) with its bootstrap
                                95 % interval, `single_label` (the conformal sets accept one label only
                                on the evaluated datapack, so MCC on accepted rows is 0 whatever the
                                scores: abstention, not absence of signal; read the AUROC), and the
                                probe's `flag` (experiments.tables.cell_flag); the markdown as one
                                train x eval matrix per probe and task
    transfer_<task>.png         MCC heat-maps (rows: training datapack, columns: evaluation datapack),
                                one panel per probe, each cell's 95 % interval under its value;
                                "(one label)" marks single-label cells
"""
from __future__ import annotations

from toolkit.config import answer_help
from experiments.schema import TRANSFER_TASKS, TransferSchema

answer_help(__name__, "transfer", TransferSchema)   # before the imports below: --help needs no torch

import logging
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
from omegaconf import DictConfig

from probes.apply import apply_to_store, transfer_path
from evaluation.cell_metrics import cell_auroc_interval
from evaluation.cells import CellError
from toolkit.provenance import host, page_command, page_stamp
from experiments.plots import LABELS, save, subplots, words
from experiments.tables import (best_layers, cell_flag, layer_table, load_cells,
                                publish, report_cell)
from toolkit.errors import check_name, check_writable
from toolkit.markdown import markdown_table
from toolkit.entry import entry_main
from toolkit.schema import typed_options
from extract.statements import TRILEMMA

log = logging.getLogger(__name__)
KEYS = ["probe", "task", "split", "layer"]
# (path: the transfer cell, relative to results_dir)
COLUMNS = ["probe", "task", "split", "layer", "train", "eval", "mcc", "mcc_lo", "mcc_hi", "wmcc", "wmcc_lo", "wmcc_hi",
           "acceptance", "n", "auroc", "auroc_lo", "auroc_hi", "single_label", "flag", "path"]


def best_cells(results_dir, model: str, datapack: str, split: str) -> pd.DataFrame:
    """The best layer of each probe and task on `split` (calibration MCC), with its first seed's cell path."""
    cells = load_cells(results_dir, model, datapack)
    best = best_layers(layer_table(cells))
    first = cells.sort_values("seed").drop_duplicates(KEYS)[KEYS + ["path"]]
    return best[best["split"] == split][KEYS].merge(first, on=KEYS)


def transfer_table(results_dir, model: str, datapacks=TRILEMMA, tasks=TRANSFER_TASKS, split: str = "entity_disjoint",
                   store_dir=None) -> pd.DataFrame:
    """One row per (probe, task, train datapack, eval datapack) whose cell exists; with `store_dir`,
    missing transfer cells are computed first from its stores."""
    rows = []
    for train in datapacks:
        try:
            best = best_cells(results_dir, model, train, split)
        except CellError as err:
            log.warning("no probe trained on %s (%s): its row is left out", train, err)
            continue
        for _, b in best[best["task"].isin(list(tasks))].iterrows():
            probe_cell = report_cell(Path(b["path"]))
            for evaluated in datapacks:
                path = Path(b["path"]) if evaluated == train else transfer_path(results_dir, probe_cell, evaluated)
                if not path.exists() and store_dir is not None:
                    apply_to_store(b["path"], evaluated, store_dir, results_dir)
                if not path.exists():
                    continue
                cell = report_cell(path)
                m = cell["metrics"]
                auroc = m.get("auroc")
                rows.append({"probe": b["probe"], "task": b["task"], "split": split, "layer": int(b["layer"]),
                             "train": train, "eval": evaluated, "mcc": m["mcc"], "mcc_lo": m["mcc_ci"][0],
                             "mcc_hi": m["mcc_ci"][1], "wmcc": m["wmcc"], "wmcc_lo": m["wmcc_ci"][0],
                             "wmcc_hi": m["wmcc_ci"][1], "acceptance": m["acceptance"], "n": m["n"],
                             "auroc": np.nan if auroc is None else auroc,
                             **dict(zip(("auroc_lo", "auroc_hi"), cell_auroc_interval(cell))),
                             "single_label": bool(m.get("single_label_accepted", False)),
                             "flag": cell_flag(probe_cell),
                             "path": Path(path).absolute().relative_to(Path(results_dir).absolute()).as_posix()})
    return pd.DataFrame(rows, columns=COLUMNS)


def write_transfer(results_dir, reports_dir, model: str, datapacks=TRILEMMA, tasks=TRANSFER_TASKS,
                   split: str = "entity_disjoint", store_dir=None, page_dir=None) -> Path:
    """The transfer tables and heat-maps of `model` in <reports_dir>/<model>/ (see the module
    docstring); `store_dir` given: missing transfer cells are computed first, else only existing
    cells are tabulated; `page_dir` given: also the results page <page_dir>/<model>.md (a provenance
    line, the heat-maps and the tables) with copies of the report's transfer.csv and heat-maps as
    <model>_transfer.csv and <model>_transfer_<task>.png beside it. Returns the report folder."""
    table = transfer_table(results_dir, model, datapacks, tasks, split, store_dir)
    if table.empty:
        raise CellError(f"no result cell of {model} on {', '.join(datapacks)} under {results_dir}: run "
                        "`python -m train_probe` first")
    model = check_name(model, "model")
    markdown = _markdown(table, list(datapacks))
    figures = [f"transfer_{task}.png" for task in sorted(table["task"].unique())]

    def build(folder: Path) -> None:
        table.to_csv(folder / "transfer.csv", index=False)
        (folder / "transfer.md").write_text(markdown)
        for task, g in table.groupby("task"):
            heat_maps(g, list(datapacks), folder / f"transfer_{task}.png", f"{model}, {words(task)}")

    # the model's folder also holds its datapacks' reports: only the transfer files are replaced
    out = publish(Path(reports_dir) / model, build, whole_folder=False)

    def page(folder: Path) -> None:
        for name in ("transfer.csv", *figures):
            shutil.copyfile(out / name, folder / f"{model}_{name}")
        label = report_cell(Path(results_dir) / table["path"].iloc[0]).get("store", {}).get("model_label") or model
        (folder / f"{model}.md").write_text("\n".join([
            f"# Does a truth direction transfer? {label}", "",
            f"> Generated by `python -m experiments.transfer` ({page_stamp()}, `{page_command()}`, "
            f"{host()}). Rerunning it on the same cells rewrites this page, `{model}_transfer.csv` and the "
            "figures; only this line changes.", "",
            f"Each probe of each training datapack at its best calibration layer ({split} split; the layer is in "
            "each table's `layer` column), applied to every statement of the other datapacks' stores of the same "
            "model; the diagonal is the ordinary test split.", "",
            *(f"![{model}_{f}]({model}_{f})\n" for f in figures), markdown]))

    if page_dir is not None:
        publish(Path(page_dir), page, whole_folder=False)
        log.info("results page written to %s", Path(page_dir) / f"{model}.md")
    log.info("transfer matrix of %d cells written to %s", len(table), out)
    return out


def _entries(rows: pd.DataFrame, datapacks: list[str]) -> list[str]:
    """One trained-on row's entries, a column per evaluation datapack ("" where it has no cell)."""
    by_eval = {e: x for e, x in zip(rows["eval"], rows.itertuples())}
    return [_entry(x) if (x := by_eval.get(e)) else "" for e in datapacks]


def _markdown(table: pd.DataFrame, datapacks: list[str]) -> str:
    lines = []
    for (task, probe), g in table.groupby(["task", "probe"]):
        lines += [f"### {probe}, {task}", "", "MCC on accepted rows (conformal, abstentions excluded) / W-MCC / "
                  "AUROC of the raw scores (threshold-free, all rows), each with its bootstrap 95 % interval; \"one "
                  "label\": the conformal sets accept one label only, so MCC is 0 by construction (abstention, not "
                  "absence of signal: read the AUROC); rows: trained on (its best calibration layer; flag: why the "
                  "probe's numbers are not a fitted probe's), columns: evaluated on", "",
                  markdown_table(["trained on", "layer", "flag", *datapacks],
                                 [[train, r["layer"].iloc[0], r["flag"].iloc[0], *_entries(r, datapacks)]
                                  for train, r in g.groupby("train", sort=False)])]
    return "\n".join(lines)


def _entry(x) -> str:
    """One matrix entry: "MCC [ci] / W-MCC [ci] / AUROC [ci]", with "(one label)" for a single-label cell."""
    text = f"{x.mcc:.3f} [{x.mcc_lo:.3f}, {x.mcc_hi:.3f}] / {x.wmcc:.3f} [{x.wmcc_lo:.3f}, {x.wmcc_hi:.3f}]"
    auroc = "n/a" if pd.isna(x.auroc) else f"{x.auroc:.3f} [{x.auroc_lo:.3f}, {x.auroc_hi:.3f}]"
    return f"{text} / {auroc}" + (" (one label)" if x.single_label else "")


def heat_maps(table: pd.DataFrame, datapacks: list[str], path: Path, title: str) -> None:
    """One panel per probe: MCC of each (train, eval) pair with its 95 % interval under it, "(one label)"
    where the conformal sets accept one label only; blank where no cell exists."""
    probes = sorted(table["probe"].unique())
    side = 1.3 * len(datapacks) + 0.8
    fig, axes = subplots(1, len(probes), side, side, layout="compressed")
    index = {d: i for i, d in enumerate(datapacks)}
    for ax, probe in zip(axes[0], probes):
        grid = np.full((len(datapacks), len(datapacks)), np.nan)
        rows = table[table["probe"] == probe]
        for r in rows.itertuples():
            grid[index[r.train], index[r.eval]] = r.mcc
        image = ax.imshow(grid, vmin=-1, vmax=1, cmap="RdBu_r")
        for r in rows.itertuples():
            text = f"{r.mcc:.2f}" + ("" if pd.isna(r.mcc_lo) else f"\n[{r.mcc_lo:.2f}, {r.mcc_hi:.2f}]")
            ax.text(index[r.eval], index[r.train], text + ("\n(one label)" if r.single_label else ""), ha="center",
                    va="center", fontsize=7, color="w" if abs(r.mcc) > 0.6 else "k")
        labels = [words(d) for d in datapacks]
        ax.set_xticks(range(len(datapacks)), labels, rotation=30, ha="right", fontsize=7)
        ax.set_yticks(range(len(datapacks)), labels if ax is axes[0][0] else [], fontsize=7)
        ax.set_xlabel("evaluated on")
        ax.set_title(probe, fontsize=9)
    axes[0][0].set_ylabel("trained on")
    fig.colorbar(image, ax=axes[0].tolist(), shrink=0.8, label=LABELS["mcc"])
    save(fig, path, f"{title}: MCC on accepted statements, its 95 % interval under it")


def transfer(cfg: DictConfig) -> Path:
    o = typed_options(cfg, TransferSchema, {"datapacks": "a list, e.g. datapacks=[city_locations,med_indications]",
                                            "tasks": "a list, e.g. tasks=[true_vs_false]"})
    check_writable(o["reports_dir"], "reports_dir")
    if o["page_dir"] is not None:
        check_writable(o["page_dir"], "page_dir")
    return write_transfer(o["results_dir"], o["reports_dir"], o["model"]["name"], o["datapacks"], o["tasks"],
                          o["split"]["kind"], o["store_dir"], o["page_dir"])


main = entry_main("transfer", TransferSchema, transfer)


if __name__ == "__main__":
    main()
