"""TruthfulQA, what the model knows against what it says: probe MC1 / MC2 (cells of the truthfulqa
datapack) against the likelihood MC1 / MC2 (`python -m truthfulqa`, format lm_eval).

Reads the cells of tasks true_vs_false and true_vs_all (the same statements on this datapack, which
has no neither) under <results_dir>/<model>/truthfulqa/, whose metrics hold probe_mc1 / probe_mc2
(evaluation.multiple_choice.probe_mc: MC1 credits a tie at the top 1/k), and
<results_dir>/<model>/truthfulqa/likelihood-lm_eval.json if it exists. One layer per (probe, task,
split) is reported: the one with the highest calibration-split MCC (experiments.tables.best_layers,
the rule of every other report), never one chosen on test. Writes to `out_dir`:

    truthfulqa_probe_mc.csv, .md   the selection: per (probe, task, split) the cells (one per seed) of
                                   its chosen layer: probe, task, split, layer, seed, calibration MCC,
                                   test MCC, AUROC, probe MC1 / MC2 with their 95 % intervals (bootstrap
                                   over the test questions), probe_mc1_ties (questions decided by a
                                   tie), n_questions, and the likelihood MC1 / MC2 of the same
                                   questions (likelihood_mc1_same / _mc2_same)
    truthfulqa_probe_mc_all_layers.csv, .md
                                   the same columns for every layer: all layers, not a selection
    knows_vs_says.png              probe MC1 (left) and MC2 (right) against layer, one line per
                                   (probe, task, split) (mean over seeds), its chosen layer circled, the
                                   likelihood MC1 / MC2 of all questions as horizontal lines
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pandas as pd

from evaluation.cells import CellError, read_cell
from experiments.plots import legend_below, pyplot
from experiments.tables import best_layers, layer_table, load_cells
from extract.errors import check_name
from extract.statements import TRUTHFULQA
from evaluation.multiple_choice import mc_scores

log = logging.getLogger(__name__)
TASKS = ("true_vs_false", "true_vs_all")
LIKELIHOOD = "likelihood-lm_eval.json"
KEYS = ["probe", "task", "split", "layer"]


def probe_mc_table(results_dir: Path, model: str, likelihood: dict | None) -> pd.DataFrame:
    """One row per cell of TASKS, every layer (columns in the module docstring); a cell without probe
    MC, or with the probe MC of before the tie rule (no probe_mc1_ties), is a one-line CellError."""
    root = Path(results_dir) / check_name(model, "model") / TRUTHFULQA
    by_row = {q["row"]: q for q in likelihood["questions"]} if likelihood else {}
    rows = []
    for task in TASKS:
        for path in sorted(root.glob(f"*/{task}/*/layer=*/seed=*.json")):
            cell = read_cell(path)
            m = cell["metrics"]
            if "probe_mc1" not in m:
                raise CellError(f"{path} has no probe MC1 / MC2: rerun train_probe with overwrite=true")
            if "probe_mc1_ties" not in m:
                raise CellError(f"{path} has the probe MC1 of the old tie rule (a tie went to the best answer): "
                                "rerun train_probe with overwrite=true")
            same = [by_row[r] for r in m["probe_mc_questions"] if r in by_row]
            mc1, mc2 = (mc_scores(*zip(*[(q["mc1_logliks"], q["mc2_logliks"], q["mc2_labels"]) for q in same]))
                        if len(same) == len(m["probe_mc_questions"]) else (np.nan, np.nan))
            rows.append({"probe": cell["config"]["probe"]["name"], "task": task, "split": cell["split"]["kind"],
                         "layer": cell["layer"], "seed": cell["config"]["seed"],
                         "cal_mcc": cell.get("calibration_metrics", {}).get("mcc_all"), "mcc": m.get("mcc"),
                         "auroc": m.get("auroc"), "probe_mc1": m["probe_mc1"], "probe_mc1_lo": m["probe_mc1_ci"][0],
                         "probe_mc1_hi": m["probe_mc1_ci"][1], "probe_mc2": m["probe_mc2"],
                         "probe_mc2_lo": m["probe_mc2_ci"][0], "probe_mc2_hi": m["probe_mc2_ci"][1],
                         "probe_mc1_ties": m["probe_mc1_ties"],
                         "n_questions": len(m["probe_mc_questions"]), "likelihood_mc1_same": np.mean(mc1),
                         "likelihood_mc2_same": np.mean(mc2)})
    if not rows:
        raise CellError(f"no {' / '.join(TASKS)} cells under {root}: run `python -m train_probe data=truthfulqa "
                        "task=true_vs_false layer=all` first")
    return pd.DataFrame(rows)


def chosen_layers(results_dir: Path, model: str) -> pd.DataFrame:
    """Per (probe, task, split) of TASKS: its layer with the highest calibration MCC (seeds averaged),
    by experiments.tables.best_layers over all the datapack's cells; columns KEYS."""
    best = best_layers(layer_table(load_cells(results_dir, model, TRUTHFULQA)))
    best = best[best["task"].isin(TASKS)]
    return best[KEYS].astype({"layer": int}).reset_index(drop=True)


def write_truthfulqa(results_dir: Path, out_dir: Path, model: str) -> list[Path]:
    """The selection's table, the all-layers table and the plot (module docstring) -> their paths."""
    lik_path = Path(results_dir) / check_name(model, "model") / TRUTHFULQA / LIKELIHOOD
    likelihood = json.loads(lik_path.read_text()) if lik_path.exists() else None
    if likelihood is None:
        log.warning("%s not found (run `python -m truthfulqa model=%s`): the plot has no likelihood lines",
                    lik_path, model)
    table = probe_mc_table(results_dir, model, likelihood)
    chosen = table.merge(chosen_layers(results_dir, model), on=KEYS)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "truthfulqa_probe_mc.csv", out / "truthfulqa_probe_mc.md", out / "truthfulqa_probe_mc_all_layers.csv",
             out / "truthfulqa_probe_mc_all_layers.md", out / "knows_vs_says.png"]
    chosen.to_csv(paths[0], index=False)
    paths[1].write_text("Per probe, the layer with the highest calibration-split MCC (experiments.tables.best_layers); "
                        "test-split metrics of that layer.\n\n" + _markdown(chosen, likelihood))
    table.to_csv(paths[2], index=False)
    paths[3].write_text("All layers, not a selection: the layer of a probe's row in truthfulqa_probe_mc.md is "
                        "chosen on the calibration split; picking the best row here would choose on test.\n\n"
                        + _markdown(table, likelihood))
    _plot(table, chosen, likelihood, paths[4], f"{model} / TruthfulQA: knows (probe) vs says (likelihood)")
    return paths


def _markdown(table: pd.DataFrame, likelihood: dict | None) -> str:
    def ci(r, k):
        return f"{r[k]:.3f} [{r[k + '_lo']:.3f}, {r[k + '_hi']:.3f}]"

    def num(x):
        return "" if x is None or pd.isna(x) else f"{x:.3f}"

    lines = [("| probe | task | split | layer | seed | cal. MCC | test MCC | AUROC | probe MC1 | MC1 ties | probe MC2 | "
              "questions | likelihood MC1 / MC2 (same questions) |"), "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for _, r in table.sort_values(["probe", "task", "split", "layer", "seed"]).iterrows():
        lines.append(f"| {r['probe']} | {r['task']} | {r['split']} | {r['layer']} | {r['seed']} | {num(r['cal_mcc'])} | "
                     f"{num(r['mcc'])} | {num(r['auroc'])} | {ci(r, 'probe_mc1')} | {r['probe_mc1_ties']} | "
                     f"{ci(r, 'probe_mc2')} | {r['n_questions']} | "
                     f"{num(r['likelihood_mc1_same'])} / {num(r['likelihood_mc2_same'])} |")
    lines.append("\nprobe MC1: a best answer sharing the top probability with k - 1 other answers scores 1 / k "
                 "(expected accuracy under random tie-breaking); MC1 ties = test questions so decided.")
    if likelihood:
        lines.append(f"\nLikelihood ({likelihood['format']}, all {likelihood['n_questions']} questions): MC1 "
                     f"{likelihood['mc1']:.3f} [{likelihood['mc1_ci'][0]:.3f}, {likelihood['mc1_ci'][1]:.3f}], MC2 "
                     f"{likelihood['mc2']:.3f} [{likelihood['mc2_ci'][0]:.3f}, {likelihood['mc2_ci'][1]:.3f}]")
    return "\n".join(lines) + "\n"


def _plot(table: pd.DataFrame, chosen: pd.DataFrame, likelihood: dict | None, path: Path, title: str) -> None:
    plt = pyplot()
    keys = ["probe", "task", "split"]
    varying = [k for k in keys[1:] if table[k].nunique() > 1]
    fig, axes = plt.subplots(1, 2, figsize=(9, 4.2), squeeze=False, sharey=True)
    for ax, metric, name in zip(axes[0], ("probe_mc1", "probe_mc2"), ("MC1", "MC2")):
        for i, (key, g) in enumerate(table.groupby(keys, sort=True)):
            mean = g.groupby("layer")[[metric, f"{metric}_lo", f"{metric}_hi"]].mean()
            label = " ".join([key[0], *(key[keys.index(k)] for k in varying)])
            ax.plot(mean.index, mean[metric], "o-", markersize=3, color=f"C{i}", label=label)
            ax.fill_between(mean.index, mean[f"{metric}_lo"], mean[f"{metric}_hi"], color=f"C{i}", alpha=0.12,
                            linewidth=0)
            for layer in chosen[(chosen[keys] == list(key)).all(axis=1)]["layer"].unique():
                ax.plot([layer], [mean.loc[layer, metric]], "o", markersize=9, markerfacecolor="none", color="k",
                        label="layer chosen on calibration MCC")
        if likelihood:
            ax.axhline(likelihood[name.lower()], color="k", linestyle="--", linewidth=1,
                       label=f"likelihood ({likelihood['format']}, all questions)")
        ax.set_title(f"probe {name}")
        ax.set_xlabel("layer")
        ax.grid(alpha=0.3)
    legend_below(fig, axes[0])
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
