"""`python -m experiments.interventions`: does the model use the probes' directions? `python -m intervene` on the
best-layer cell of each probe and binary task of every model x datapack, then the page docs/results/interventions/.

1. For every (model, datapack): each of `probes` x `tasks` at its best calibration layer (experiments.tables.
   best_layers over the cells of `split`), `python -m intervene cell=<that cell>` in a child process
   (experiments.steps) with the page's sizes; an intervention file already there is kept, a stopped one resumes
   (intervene's checkpoints), so a killed study resumes by rerunning the command.
2. The page (whole or not at all, experiments.tables.publish): index.md (what was steered, how, and per
   (model, datapack, probe, task, readout) the probe's mean effect at the largest pushes, the dose-response slope
   of probe - random directions with its interval, whether the probe's effect leaves the random directions'
   range, and the verdict; the same for the probe orthogonalised to the mean difference), interventions.csv (those
   rows) and one dose-response figure per (model, readout). Rerunning it on the same files rewrites it byte for
   byte but for its provenance line.
"""
from __future__ import annotations

from toolkit.config import answer_help
from experiments.schema import InterventionsSchema

answer_help(__name__, "interventions", InterventionsSchema)   # before the imports below: --help is quick

import json
import logging
from pathlib import Path

import numpy as np
import pandas as pd
from omegaconf import DictConfig

from toolkit.provenance import host, page_command, page_stamp
from experiments import plots
from experiments.steps import run_step
from experiments.tables import best_layers, layer_table, load_cells, publish
from toolkit.markdown import markdown_table
from toolkit.config import CONF_DIR
from toolkit.entry import entry_main
from toolkit.errors import ToolkitError, check_count, check_name, check_writable
from toolkit.schema import typed_options

log = logging.getLogger(__name__)
BINARY_TASKS = ("true_vs_all", "false_vs_all", "neither_vs_all", "true_vs_false")
READOUT_WORDS = {"zero_shot": "zero-shot log-odds of the task's class (the paper's prompt)",
                 "likelihood": "log P(true object) - log P(false object) after the statement's opening"}


def best_cells(o: dict, model: str, datapack: str) -> list[str]:
    """The cell paths of each of `probes` x `tasks` at its best calibration layer (those swept)."""
    if not (Path(o["results_dir"]) / model / datapack).is_dir():
        log.info("no cells for %s / %s: skipped", model, datapack)
        return []
    cells = load_cells(o["results_dir"], model, datapack)
    cells = cells[(cells["split"] == o["split"]["kind"]) & cells["probe"].isin(o["probes"])
                  & cells["task"].isin(o["tasks"]) & cells["layer"].notna()]
    if cells.empty:
        return []
    best = best_layers(layer_table(cells))
    paths = []
    for r in best.sort_values(["probe", "task"]).itertuples():
        match = cells[(cells["probe"] == r.probe) & (cells["task"] == r.task) & (cells["layer"] == r.layer)]
        paths.append(match.sort_values("seed")["path"].iloc[0])
    return paths


def intervention_files(o: dict, model: str, datapack: str) -> list[Path]:
    """The intervention files of one (model, datapack) for the page's probes, tasks and split."""
    root = Path(o["results_dir"]) / check_name(model, "models") / check_name(datapack, "datapacks") / "interventions"
    return sorted(p for probe in o["probes"] for task in o["tasks"]
                  for p in (root / probe / task / o["split"]["kind"]).glob("layer=*/seed=*.json"))


def page_rows(records: list[dict]) -> pd.DataFrame:
    """One row per (intervention file, readout) with the page's columns."""
    rows = []
    for r in records:
        for kind, out in r["readouts"].items():
            row = {"model": r["model"], "model_label": r["model_label"], "datapack": r["datapack"],
                   "probe": r["probe"], "task": r["task"], "layer": r["layer"], "readout": kind, "at": r["at"],
                   "scale": r["scale"], "cos_probe_mean_diff": r["cos_probe_mean_diff"], "n_random": r["n_random"],
                   "alphas": " ".join(f"{a:g}" for a in r["alphas"])}
            if "skipped" in out:
                rows.append({**row, "verdict": f"skipped: {out['skipped']}"})
                continue
            row.update(n_items=out["n_items"], n_groups=out["n_groups"],
                       effect_low=out["effect"]["probe"][0], effect_high=out["effect"]["probe"][-1],
                       random_low=out["random_band"][0][-1], random_high=out["random_band"][1][-1],
                       outside_band=bool(out["outside_random_band"][0] and out["outside_random_band"][-1]),
                       slope=out["did"]["slope"], slope_lo=out["did"]["slope_ci"][0], slope_hi=out["did"]["slope_ci"][1],
                       verdict=out["verdict"])
            if "did_orthogonal" in out:
                d = out["did_orthogonal"]
                row.update(orthogonal_slope=d["slope"], orthogonal_slope_lo=d["slope_ci"][0],
                           orthogonal_slope_hi=d["slope_ci"][1])
            rows.append(row)
    return pd.DataFrame(rows)


def _num(value, signed: bool = True) -> str:
    return "-" if pd.isna(value) else (f"{value:+.3f}" if signed else f"{value:.3f}")


def _slope(r: pd.Series, prefix: str) -> str:
    if pd.isna(r.get(prefix, np.nan)):
        return "-"
    return f"{r[prefix]:+.4f} [{r[f'{prefix}_lo']:+.4f}, {r[f'{prefix}_hi']:+.4f}]"


def page_markdown(rows: pd.DataFrame, records: list[dict], stamp: str, figures: list[str]) -> str:
    labels = rows.drop_duplicates("model").set_index("model")["model_label"].to_dict()
    first = records[0]
    text = ["# Interventions: does the model use the probe's direction?", "",
            f"> Generated by `python -m experiments.interventions` ({stamp}). Rerunning it on the same intervention "
            "files rewrites this page, `interventions.csv` and the figures; only this line changes.", "",
            "Models: " + "; ".join(f"{m}: {label}" for m, label in labels.items()) + ".", "",
            "Each probe of a binary task, at its best calibration layer, gives a direction in the model's coordinates "
            "(`python -m intervene`, docs/intervene.md). It is added to the residual stream at that layer, at the "
            f"statement's tokens (at={first['at']}), alpha times the standard deviation of the probe's projection on "
            f"its training tokens, alpha in {{{', '.join(f'{a:g}' for a in first['alphas'])}}}; against "
            f"{first['n_random']} random directions of the same push norm, and the probe orthogonalised to the "
            "training class-mean difference. Readouts: "
            + "; ".join(f"**{k}**: {w}" for k, w in READOUT_WORDS.items()) + ". Effect = steered - unsteered per "
            "statement; slope = least-squares slope over alpha of probe - random mean, with a 95 % bootstrap interval "
            "resampling subject entities and random directions jointly. The verdict reads the slope's interval; "
            "'outside random range' says whether the probe's mean effect at both largest pushes lies outside the "
            "random directions' range. Sizes per cell: up to "
            f"{max(r.get('n_test_rows', 0) for r in records)} test statements, see n (subjects).", ""]
    for kind in READOUT_WORDS:
        part = rows[rows["readout"] == kind]
        if part.empty:
            continue
        text += [f"## Readout: {kind}", "", READOUT_WORDS[kind] + ".", ""]
        lines = [[r["model"], r["datapack"], r["probe"], r["task"], r["layer"],
                  "-" if pd.isna(r.get("n_items", np.nan)) else f"{int(r['n_items'])} ({int(r['n_groups'])})",
                  f"{_num(r.get('effect_low'))} / {_num(r.get('effect_high'))}",
                  f"[{_num(r.get('random_low'))}, {_num(r.get('random_high'))}]",
                  "-" if pd.isna(r.get("outside_band", np.nan)) else "yes" if r["outside_band"] else "no",
                  _slope(r, "slope"), r["verdict"], _slope(r, "orthogonal_slope")]
                 for _, r in part.iterrows()]
        text.append(markdown_table(["model", "datapack", "probe", "task", "layer", "n (subjects)",
                                    "probe effect at lowest / highest alpha", "random directions' range at highest alpha",
                                    "outside random range", "slope, probe - random [95 %]", "verdict",
                                    "slope, orthogonalised probe - random [95 %]"], lines))
    text += ["## Dose-response", ""] + [f"![{f}]({f})" for f in figures]
    return "\n".join(text) + "\n"


def dose_figure(records: list[dict], kind: str, path: Path, title: str) -> None:
    """One panel per datapack: the probe - random mean effect per alpha with its interval, a line per
    (probe, task)."""
    datapacks = sorted({r["datapack"] for r in records})
    fig, axes = plots.subplots(1, len(datapacks), 3.6, 3.0)
    for ax, datapack in zip(axes[0], datapacks):
        for i, r in enumerate(x for x in records if x["datapack"] == datapack):
            out = r["readouts"].get(kind, {})
            if "did" not in out:
                continue
            ci = np.asarray(out["did"]["ci"])
            colour = f"C{i}"
            plots.line(ax, r["alphas"], out["did"]["diff"], "o-", color=colour,
                       label=f"{r['probe']} {plots.words(r['task'])}")
            plots.interval(ax, r["alphas"], ci[:, 0], ci[:, 1], colour)
        ax.axhline(0, color="k", linewidth=0.6)
        ax.set_title(plots.words(datapack), fontsize=9)
        ax.set_xlabel("alpha (sd of the probe's projection)")
    axes[0][0].set_ylabel("effect, probe - random mean")
    plots.legend_below(fig, axes, loc="outside lower center")
    plots.save(fig, path, title)


def write_page(o: dict) -> Path:
    records = [json.loads(p.read_text()) for m in o["models"] for d in o["datapacks"]
               for p in intervention_files(o, m, d)]
    if not records:
        raise ToolkitError(f"no intervention files under {o['results_dir']} for models {o['models']}, datapacks "
                           f"{o['datapacks']}: run the command with run=true first")
    rows = page_rows(records)
    stamp = f"{page_stamp()}, `{page_command()}`, {host()}"

    def build(out: Path) -> None:
        figures = []
        for model in o["models"]:
            mine = [r for r in records if r["model"] == model]
            for kind in READOUT_WORDS:
                if any("did" in r["readouts"].get(kind, {}) for r in mine):
                    figures.append(f"dose_{model}_{kind}.png")
                    dose_figure(mine, kind, out / figures[-1], f"{model}: {kind} readout")
        rows.to_csv(out / "interventions.csv", index=False)
        (out / "index.md").write_text(page_markdown(rows, records, stamp, figures))

    return publish(Path(o["out_dir"]), build)


def interventions(cfg: DictConfig) -> Path:
    o = typed_options(cfg, InterventionsSchema, {"models": "a list, e.g. [smollm2]", "run": "true or false",
                                                 "n_statements": "a whole number >= 1", "n_random": "a whole number >= 1",
                                                 "n_boot": "a whole number >= 1", "probes": "a list, e.g. [linear]",
                                                 "tasks": "a list, e.g. [true_vs_false]",
                                                 "alphas": "a list of numbers holding 0"})
    for key in ("n_statements", "n_random", "n_boot"):
        check_count(o[key], key)
    for key, group in (("models", "model"), ("datapacks", "data"), ("probes", "probe")):
        known = sorted(f.stem for f in (CONF_DIR / group).glob("*.yaml"))
        if not o[key] or any(name not in known for name in o[key]):
            raise ToolkitError(f"{key}={o[key]}: give one or more of {known}")
    if not o["tasks"] or any(t not in BINARY_TASKS for t in o["tasks"]):
        raise ToolkitError(f"tasks={o['tasks']}: give one or more of {', '.join(BINARY_TASKS)} (a direction per task)")
    if 0 not in o["alphas"]:
        raise ToolkitError(f"alphas={o['alphas']}: give a list of numbers holding 0 (the unsteered run)")
    check_writable(o["out_dir"], "out_dir")
    if o["run"]:
        for model in o["models"]:
            for datapack in o["datapacks"]:
                for cell in best_cells(o, model, datapack):
                    run_step("intervene", f"model={model}", f"data={datapack}", f"cell='{cell}'",
                             f"store_dir={o['store_dir']}", f"results_dir={o['results_dir']}",
                             f"n_statements={o['n_statements']}", f"n_random={o['n_random']}",
                             f"alphas=[{','.join(f'{a:g}' for a in o['alphas'])}]", f"at={o['at']}",
                             f"n_boot={o['n_boot']}")
    return write_page(o)


main = entry_main("interventions", InterventionsSchema, interventions)


if __name__ == "__main__":
    main()
