"""`python -m experiments.ncb_study models=[...] datapacks=[...] probes=[...]`: NCB and its stress tests on every
model x datapack, each probe at its calibration-chosen layer, and the results page they make.

For every (model, datapack), each step runs the repo's own entry point in a child process and is skipped where
its outputs exist, so a killed study resumes by rerunning the command:

1. store  `python -m extract model=<m> data=<d>` (every layer) unless the store is complete (a stopped one resumes);
2. sweep  `python -m experiments.sweep probes=<probes> tasks=[<task>]` over every stored layer (written cells kept);
3. layer  per probe, the layer with the best calibration MCC (experiments.tables.best_layers, every report's rule)
          among the cells of `split` (cross_model.load_study); a probe not swept at every stored layer is refused;
4. NCB    `python -m ncb method=<that layer's cell> stress_layers=[<every probe's chosen layer>]`: one extraction
          of the stress inputs serves every probe (its stress store and outputs resumable).

Then the page, <out_dir>/index.md and ncb.csv (whole or not at all, tables.publish), read from those outputs
alone: rerunning the command reproduces it byte for byte but for its provenance line (commit, date, command,
machine). Per model and datapack, the layout of Table 3 of Xu et al. (2601.05905) at one group `fraction`:
accuracy under each context of the high and low NCB groups and the gap high - low with its cluster-bootstrap
interval (ncb.stress), the gap's bootstrap p raw and Holm-adjusted over the family of the method's gaps (every
interference, level and fraction; experiments.ncb_report.load_stress, the claims page's rule). ncb.csv holds
every fraction. Where probes trained with `train_probe augment=structure_aware | neutral` have NCB outputs beside a
plain probe, their paired comparison (experiments.ncb_robust: stress drops and clean metrics, Holm over each table)
follows the model and datapack's section.
"""
from __future__ import annotations

from toolkit.config import answer_help
from experiments.schema import NCBStudySchema

answer_help(__name__, "ncb_study", NCBStudySchema)   # before the imports below: --help is quick

import json
import logging
from pathlib import Path

import pandas as pd
from omegaconf import DictConfig

from evaluation.cells import CellError
from toolkit.provenance import host, page_command, page_stamp
from evaluation.tasks import TASKS
from experiments.cross_model import load_study
from experiments.ncb_report import load_stress
from experiments.steps import run_step, store_complete
from experiments.ncb_robust import clean_markdown, clean_table, ncb_folders, robust_markdown, robust_table
from experiments.tables import ALPHA, best_layers, holm_resolution_warning, publish
from toolkit.config import CONF_DIR
from toolkit.entry import entry_main
from toolkit.errors import ToolkitError, check_count, check_writable
from toolkit.markdown import markdown_table
from toolkit.schema import typed_options
from extract.store import store_path

log = logging.getLogger(__name__)
CONTROL = ("peer", "0")          # the neutral passage: a context, no false claim


def study_steps(o: dict) -> None:
    """Steps 1-4 of the module docstring for every (model, datapack), each in its own process."""
    for model in o["models"]:
        for datapack in o["datapacks"]:
            common = [f"model={model}", f"data={datapack}", f"store_dir={o['store_dir']}"]
            if not store_complete(store_path(o["store_dir"], model, datapack)):
                run_step("extract", *common)                     # a stopped store resumes
            run_step("experiments.sweep", *common, f"results_dir={o['results_dir']}", f"tasks=[{o['task']}]",
                  f"probes=[{','.join(o['probes'])}]", f"workers={o['workers']}", f"n_boot={o['n_boot']}",
                  f"split={o['split']['kind']}")
            chosen = chosen_cells(o, model, datapack)
            layers = f"stress_layers=[{','.join(str(int(k)) for k in sorted(set(chosen['layer'])))}]"
            for cell in chosen["path"]:                       # one stress store at every chosen layer serves all
                run_step("ncb", *common, f"results_dir={o['results_dir']}", f"method='{cell}'", layers,
                      f"n_boot={o['n_boot']}")


def chosen_cells(o: dict, model: str, datapack: str) -> pd.DataFrame:
    """Per probe of `probes`: its best calibration layer's row (best_layers) for `task`, with its cell `path`."""
    split = o["split"]["kind"]
    cells, table = load_study(o["results_dir"], [model], [datapack], split)[model, datapack]
    rows = []
    for probe in o["probes"]:
        part = table[(table["probe"] == probe) & (table["task"] == o["task"])]
        if part.empty or not part["full_sweep"].all():
            raise CellError(f"{model} / {datapack}: {probe} {o['task']} ({split}) is not swept at every stored layer "
                            f"({0 if part.empty else int(part['layers_swept'].iloc[0])} of the store's layers): rerun "
                            "the study (its sweep step fills the missing layers)")
        best = best_layers(part).iloc[0]
        match = cells[(cells["probe"] == probe) & (cells["task"] == o["task"]) & (cells["layer"] == best["layer"])]
        rows.append({**best.to_dict(), "path": match.sort_values("seed")["path"].iloc[0]})
    return pd.DataFrame(rows)


def study_table(o: dict) -> pd.DataFrame:
    """One row per (model, datapack, probe, interference, level, fraction) of the chosen cells' stress.json
    (load_stress's columns, Holm per method), with the model's label, the layer and its calibration MCC."""
    frames = []
    for model in o["models"]:
        for datapack in o["datapacks"]:
            stress = load_stress(o["results_dir"], model, datapack)
            folders = probe_folders(o["results_dir"], model, datapack)
            for _, best in chosen_cells(o, model, datapack).iterrows():
                folder = folders.get(cell_key(best["path"]))
                if folder is None:
                    raise CellError(f"no NCB outputs of {best['path']}: rerun the study with run=true")
                counts = json.loads((folder / "stress.json").read_text())["counts"]
                cell = json.loads(Path(best["path"]).read_text())
                sizes = {int(k): v for k, v in counts["test_neighbourhood_sizes"].items()}
                frames.append(stress[stress["method"] == folder.name].assign(
                    model=model, model_label=cell["store"].get("model_label", model), datapack=datapack,
                    probe=best["probe"], layer=int(best["layer"]), n_stored_layers=int(best["n_stored_layers"]),
                    cal_mcc=best["cal_mcc"], stress_targets=counts["stress_targets"], group_pool=counts["group_pool"],
                    one_neighbour=sizes.get(1, 0) / max(1, sum(sizes.values()))))
    return pd.concat(frames, ignore_index=True)


def probe_folders(results_dir, model: str, datapack: str) -> dict[Path, Path]:
    """{probe cell (cell_key): its NCB output folder} of ncb_robust.ncb_folders' probe folders (groups unbalanced)."""
    folders = {}
    for folder in ncb_folders(results_dir, model, datapack).values():
        summary = json.loads((folder / "stress.json").read_text())
        if not summary["options"]["balance_by_py"]:
            folders[cell_key(summary["info"]["cell"])] = folder
    return folders


def cell_key(path) -> Path:
    """A cell's path below its results_dir (<model>/<datapack>/<probe>/<task>/<split>/layer=<k>/seed=<s>.json), so
    NCB outputs still find their cell after the results folder is moved."""
    return Path(*Path(path).parts[-7:])


def page(table: pd.DataFrame, o: dict, stamp: str, robust_tables: dict | None = None) -> str:
    """index.md: the provenance line, the summary over every model, datapack and probe, then one Table-3
    section per model and datapack at the group fraction `o['fraction']`, with the context-robust training
    comparison where augmented probes have NCB outputs there ({(model, datapack): (robust_table, clean_table)})."""
    robust_tables = robust_tables or {}
    at = table[(table["fraction"] - o["fraction"]).abs() < 1e-9]
    if at.empty:
        raise CellError(f"fraction={o['fraction']} is not one of the NCB runs' fractions "
                        f"{sorted(table['fraction'].unique())}")
    lines = ["# Belief robustness (NCB) across models and datapacks", "",
             f"> Generated by `python -m experiments.ncb_study` ({stamp}). Rerun it to regenerate this page and "
             "`ncb.csv` (every group fraction); finished steps are kept.", "",
             "What NCB, the groups and the stress inputs are: [python -m ncb](../../ncb.md). "
             f"Task {o['task']}, {o['split']['kind']} split; each probe at the layer with its best calibration MCC "
             "among every stored layer (the swept layers and the choice come from the same command). "
             f"High / low = the top / bottom {o['fraction']:.0%} of the valid test targets by NCB. Accuracy: the "
             "plain prediction's under the context (clean accuracy 1 for valid targets, so drop = 1 - accuracy); "
             "intervals: 95 % cluster bootstrap over subject entities. Family for the multiplicity correction: "
             "each probe's gaps (every interference, level and fraction, as on the claims page: Holm); "
             f"`*`: gap significant after Holm (p < {ALPHA}).", "",
             "## Summary", "",
             "Mean drop: the mean over the misleading contexts (every interference and level but the neutral "
             "control) of each group's drop; gaps significant: Holm-significant gaps of the method at this "
             "fraction / gaps tested; one-neighbour: the share of test targets whose NCB rests on one other "
             "statement.", "",
             markdown_table(["model", "datapack", "probe", "layer", "cal. MCC", "stress targets", "group pool",
                             "one-neighbour", "mean drop high", "mean drop low", "gaps significant"],
                            [_summary_row(datapack, probe, g)
                             for (_, datapack, probe), g in at.groupby(["model", "datapack", "probe"], sort=False)]
                            ).rstrip("\n")]
    for (model, datapack), g in at.groupby(["model", "datapack"], sort=False):
        probes = list(dict.fromkeys(g["probe"]))
        lines += ["", f"## {g['model_label'].iloc[0]}, {datapack}", "",
                  markdown_table(["interference", "level", *(f"{p} (layer {g[g['probe'] == p]['layer'].iloc[0]}): "
                                                             "high / low / gap" for p in probes)],
                                 [[interference, level, *(_cell(rows[rows["probe"] == p]) for p in probes)]
                                  for (interference, level), rows in g.groupby(["interference", "level"], sort=False)]
                                 ).rstrip("\n")]
        robust, clean = robust_tables.get((model, datapack), (pd.DataFrame(), pd.DataFrame()))
        if not robust.empty:
            lines += ["", "Context-robust training (`train_probe augment=structure_aware | neutral`, the probe "
                      "analogue of SAT), each against the plain probe of the same layer and against each other "
                      "(experiments/ncb_robust.py):", "", robust_markdown(robust).rstrip("\n")]
            if not clean.empty:
                lines += ["", clean_markdown(clean).rstrip("\n")]
    return "\n".join(lines) + "\n"


def _summary_row(datapack: str, probe: str, g: pd.DataFrame) -> list:
    """The summary table's row of one (model, datapack, probe): its rows `g` of every interference and level."""
    r = g.iloc[0]
    misleading = g[[(i, lv) != CONTROL for i, lv in zip(g["interference"], g["level"])]]
    return [r["model_label"], datapack, probe, f"{r['layer']} of {r['n_stored_layers']}", f"{r['cal_mcc']:.3f}",
            r["stress_targets"], r["group_pool"], f"{r['one_neighbour']:.2f}", f"{misleading['high_drop'].mean():.3f}",
            f"{misleading['low_drop'].mean():.3f}",
            f"{int(g['gap_significant_holm'].fillna(False).sum())} / {int(g['gap_p_raw'].notna().sum())}"]


def _cell(rows: pd.DataFrame) -> str:
    if rows.empty:
        return "-"
    r = rows.iloc[0]
    if pd.isna(r["gap"]):
        return "n/a"
    ci = "" if pd.isna(r["gap_lo"]) else f" [{r['gap_lo']:+.2f}, {r['gap_hi']:+.2f}]"
    star = "*" if not pd.isna(r["gap_significant_holm"]) and r["gap_significant_holm"] else ""
    return f"{r['high_accuracy']:.2f} / {r['low_accuracy']:.2f} / {r['gap']:+.2f}{ci}{star}"


def ncb_study(cfg: DictConfig) -> Path:
    o = typed_options(cfg, NCBStudySchema, {"models": "a list, e.g. [smollm2]", "probes": "a list, e.g. [linear]",
                                            "run": "true or false", "workers": "a whole number >= 1",
                                            "n_boot": "a whole number >= 1", "fraction": "a number in (0, 0.5)"})
    for key in ("workers", "n_boot"):
        check_count(o[key], key)
    for key, group in (("models", "model"), ("datapacks", "data"), ("probes", "probe")):
        known = sorted(f.stem for f in (CONF_DIR / group).glob("*.yaml"))
        if not o[key] or any(name not in known for name in o[key]):
            raise ToolkitError(f"{key}={o[key]}: give one or more of {known}")
    if o["task"] not in TASKS:
        raise ToolkitError(f"task={o['task']}: give one of {', '.join(TASKS)}")
    check_writable(o["out_dir"], "out_dir")
    if o["run"]:
        study_steps(o)
    table = study_table(o)
    stamp = f"{page_stamp()}, `{page_command()}`, {host()}"

    robust = {(m, d): (robust_table(o["results_dir"], m, d, o["n_boot"]), clean_table(o["results_dir"], m, d, o["n_boot"]))
              for m in o["models"] for d in o["datapacks"]}
    family = max((len(paired) for paired, _ in robust.values()), default=0)   # a robust table is one Holm family
    if warning := holm_resolution_warning(o["n_boot"], family):
        log.warning(warning)

    def build(out: Path) -> None:
        table.to_csv(out / "ncb.csv", index=False)
        (out / "index.md").write_text(page(table, o, stamp, robust))

    out = publish(Path(o["out_dir"]), build)
    log.info("NCB study page written to %s (%d model / datapack pairs)", out,
             table[["model", "datapack"]].drop_duplicates().shape[0])
    return out


main = entry_main("ncb_study", NCBStudySchema, ncb_study)


if __name__ == "__main__":
    main()
