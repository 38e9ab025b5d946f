"""TruthfulQA, what the model knows against what it says: probe MC1 / MC2 / MC2_verify (cells of the
truthfulqa datapack) against the likelihood MC1 / MC2 (`python -m truthfulqa`, format lm_eval) and the
verification MC1 / MC2_verify (`python -m truthfulqa mode=verify`, the first of verify-chat.json,
verify-plain.json, verify-lm_eval.json found); and the behaviour page (`behaviour_page`, the command
below): likelihood, verification and generation results side by side with the probes'.

    python -m experiments.truthfulqa_report --results-dir results --model smollm2 \
        --out docs/results/truthfulqa_behaviour.md

Reads the cells of tasks true_vs_false and true_vs_all (the same statements on this datapack, which
has no neither) under <results_dir>/<model>/truthfulqa/, whose metrics hold probe_mc1 / probe_mc2
(evaluation.multiple_choice.probe_mc: MC1 credits a tie at the top 1/k), and
<results_dir>/<model>/truthfulqa/likelihood-lm_eval.json if it exists. One layer per (probe, task,
split) is reported: the one with the highest calibration-split MCC (experiments.tables.best_layers,
the rule of every other report), never one chosen on test. Writes to `out_dir`:

    truthfulqa_probe_mc.csv, .md   the selection: per (probe, task, split) the cells (one per seed) of
                                   its chosen layer: probe, task, split, layer, seed, calibration MCC,
                                   test MCC, AUROC, probe MC1 / MC2 / MC2_verify with their 95 %
                                   intervals (bootstrap over the test questions; MC2_verify empty for a
                                   cell written before it existed), probe_mc1_ties (questions decided by
                                   a tie), n_questions, and the likelihood MC1 / MC2 and verification
                                   MC1 / MC2_verify of the same questions (likelihood_mc1_same / _mc2_same,
                                   verify_mc1_same / _mc2_same)
    truthfulqa_probe_mc_all_layers.csv, .md
                                   the same columns for every layer: all layers, not a selection
    knows_vs_says.png              probe MC1 (left) and MC2 (right) against layer, one line per
                                   (probe, task, split) (mean over seeds), its chosen layer circled, the
                                   likelihood MC1 / MC2 of all questions as horizontal lines
"""
from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import numpy as np
import pandas as pd

from evaluation.cells import CellError, cell_files, read_cell
from toolkit.provenance import host, shown_command
from experiments.plots import legend_below, pyplot
from experiments.tables import best_layers, layer_table, load_cells
from toolkit.errors import check_name
from toolkit.markdown import markdown_table
from extract.statements import TRUTHFULQA
from evaluation.multiple_choice import mc1_credit, mc2_verify, mc_scores

log = logging.getLogger(__name__)
TASKS = ("true_vs_false", "true_vs_all")
LIKELIHOOD = "likelihood-lm_eval.json"
VERIFY = ("verify-chat.json", "verify-plain.json", "verify-lm_eval.json")     # the first found is reported
KEYS = ["probe", "task", "split", "layer"]


def read_behaviour(results_dir: Path, model: str) -> tuple[dict | None, dict | None]:
    """(likelihood-lm_eval.json, the first of VERIFY) under <results_dir>/<model>/truthfulqa/, None where absent."""
    root = Path(results_dir) / check_name(model, "model") / TRUTHFULQA
    likelihood = json.loads((root / LIKELIHOOD).read_text()) if (root / LIKELIHOOD).exists() else None
    verify = next((json.loads((root / name).read_text()) for name in VERIFY if (root / name).exists()), None)
    return likelihood, verify


def verify_same(verify: dict | None, rows: list[int]) -> tuple[float, float]:
    """Verification MC1 / MC2_verify (means) of the questions `rows` (CSV rows), NaN unless all were scored."""
    by_row = {q["row"]: q for q in verify["questions"]} if verify else {}
    same = [by_row[r] for r in rows if r in by_row]
    if not same or len(same) != len(rows):
        return np.nan, np.nan
    mc1 = [mc1_credit(q["mc1_p_yes"], ties="expected") for q in same]
    return float(np.mean(mc1)), float(mc2_verify([q["p_yes"] for q in same], [q["mc2_labels"] for q in same]).mean())


def likelihood_same(by_row: dict, rows: list[int]) -> tuple:
    """Likelihood MC1 / MC2 per question ([Q] each) of the questions `rows` (CSV rows), from the likelihood
    file's questions by row; (NaN, NaN) unless all of them were scored."""
    same = [by_row[r] for r in rows if r in by_row]
    if not same or len(same) != len(rows):
        return np.nan, np.nan
    return mc_scores(*zip(*[(q["mc1_logliks"], q["mc2_logliks"], q["mc2_labels"]) for q in same]))


def probe_mc_table(results_dir: Path, model: str, likelihood: dict | None, verify: dict | None = None) -> pd.DataFrame:
    """One row per cell of TASKS, every layer (columns in the module docstring); a cell without probe
    MC, or with the probe MC of before the tie rule (no probe_mc1_ties), is a one-line CellError."""
    root = Path(results_dir) / check_name(model, "model") / TRUTHFULQA
    by_row = {q["row"]: q for q in likelihood["questions"]} if likelihood else {}
    rows = []
    for task in TASKS:
        for path in cell_files(results_dir, root.parent.name, TRUTHFULQA, task=task):
            cell = read_cell(path)
            m = cell["metrics"]
            if "probe_mc1" not in m:
                raise CellError(f"{path} has no probe MC1 / MC2: rerun train_probe with overwrite=true")
            if "probe_mc1_ties" not in m:
                raise CellError(f"{path} has the probe MC1 of the old tie rule (a tie went to the best answer): "
                                "rerun train_probe with overwrite=true")
            mc1, mc2 = likelihood_same(by_row, m["probe_mc_questions"])
            v_mc1, v_mc2 = verify_same(verify, m["probe_mc_questions"])
            v_ci = m.get("probe_mc2_verify_ci") or [np.nan, np.nan]
            rows.append({"probe": cell["config"]["probe"]["name"], "task": task, "split": cell["split"]["kind"],
                         "layer": cell["layer"], "seed": cell["config"]["seed"],
                         "cal_mcc": cell.get("calibration_metrics", {}).get("mcc_all"), "mcc": m.get("mcc"),
                         "auroc": m.get("auroc"), "probe_mc1": m["probe_mc1"], "probe_mc1_lo": m["probe_mc1_ci"][0],
                         "probe_mc1_hi": m["probe_mc1_ci"][1], "probe_mc2": m["probe_mc2"],
                         "probe_mc2_lo": m["probe_mc2_ci"][0], "probe_mc2_hi": m["probe_mc2_ci"][1],
                         "probe_mc2_verify": m.get("probe_mc2_verify", np.nan), "probe_mc2_verify_lo": v_ci[0],
                         "probe_mc2_verify_hi": v_ci[1], "probe_mc1_ties": m["probe_mc1_ties"],
                         "n_questions": len(m["probe_mc_questions"]), "likelihood_mc1_same": np.mean(mc1),
                         "likelihood_mc2_same": np.mean(mc2), "verify_mc1_same": v_mc1, "verify_mc2_same": v_mc2})
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
    likelihood, verify = read_behaviour(results_dir, model)
    if likelihood is None:
        log.warning("%s not found under %s (run `python -m truthfulqa model=%s`): the plot has no likelihood lines",
                    LIKELIHOOD, results_dir, model)
    table = probe_mc_table(results_dir, model, likelihood, verify)
    chosen = table.merge(chosen_layers(results_dir, model), on=KEYS)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "truthfulqa_probe_mc.csv", out / "truthfulqa_probe_mc.md", out / "truthfulqa_probe_mc_all_layers.csv",
             out / "truthfulqa_probe_mc_all_layers.md", out / "knows_vs_says.png"]
    chosen.to_csv(paths[0], index=False)
    paths[1].write_text("Per probe, the layer with the highest calibration-split MCC (experiments.tables.best_layers); "
                        "test-split metrics of that layer.\n\n" + _markdown(chosen, likelihood, verify))
    table.to_csv(paths[2], index=False)
    paths[3].write_text("All layers, not a selection: the layer of a probe's row in truthfulqa_probe_mc.md is "
                        "chosen on the calibration split; picking the best row here would choose on test.\n\n"
                        + _markdown(table, likelihood, verify))
    _plot(table, chosen, likelihood, paths[4], f"{model} / TruthfulQA: knows (probe) vs says (likelihood)")
    return paths


def _ci(r, k, signed: bool = False) -> str:
    if pd.isna(r[k]):
        return ""
    f = "{:+.3f}" if signed else "{:.3f}"
    return f"{f.format(r[k])} [{f.format(r[k + '_lo'])}, {f.format(r[k + '_hi'])}]"


def _num(x, signed: bool = False) -> str:
    return "" if x is None or pd.isna(x) else (f"{x:+.3f}" if signed else f"{x:.3f}")


def _markdown(table: pd.DataFrame, likelihood: dict | None, verify: dict | None = None) -> str:
    ci, num = _ci, _num
    lines = [markdown_table(
        ["probe", "task", "split", "layer", "seed", "cal. MCC", "test MCC", "AUROC", "probe MC1", "MC1 ties", "probe MC2",
         "probe MC2_verify", "questions", "likelihood MC1 / MC2 (same questions)",
         "verification MC1 / MC2_verify (same questions)"],
        [[r["probe"], r["task"], r["split"], r["layer"], r["seed"], num(r["cal_mcc"]), num(r["mcc"]), num(r["auroc"]),
          ci(r, "probe_mc1"), r["probe_mc1_ties"], ci(r, "probe_mc2"), ci(r, "probe_mc2_verify", True), r["n_questions"],
          f"{num(r['likelihood_mc1_same'])} / {num(r['likelihood_mc2_same'])}",
          f"{num(r['verify_mc1_same'])} / {num(r['verify_mc2_same'], True)}"]
         for _, r in table.sort_values(["probe", "task", "split", "layer", "seed"]).iterrows()]).rstrip("\n")]
    lines.append("\nprobe MC1: a best answer sharing the top probability with k - 1 other answers scores 1 / k "
                 "(expected accuracy under random tie-breaking); MC1 ties = test questions so decided.")
    if likelihood:
        lines.append(f"\nLikelihood ({likelihood['format']}, all {likelihood['n_questions']} questions): MC1 "
                     f"{likelihood['mc1']:.3f} [{likelihood['mc1_ci'][0]:.3f}, {likelihood['mc1_ci'][1]:.3f}], MC2 "
                     f"{likelihood['mc2']:.3f} [{likelihood['mc2_ci'][0]:.3f}, {likelihood['mc2_ci'][1]:.3f}]")
    if verify:
        lines.append(f"\nVerification ({verify['format']}, all {verify['n_questions']} questions): MC1 "
                     f"{verify['mc1_verify']:.3f} [{verify['mc1_verify_ci'][0]:.3f}, {verify['mc1_verify_ci'][1]:.3f}], "
                     f"MC2_verify {verify['mc2_verify']:+.3f} [{verify['mc2_verify_ci'][0]:+.3f}, "
                     f"{verify['mc2_verify_ci'][1]:+.3f}]")
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


# ------------------------------------------------------------------ the behaviour page
def behaviour_page(results_dir: Path, model: str) -> str:
    """The markdown of docs/results/truthfulqa_behaviour.md: every likelihood-, verify- and generate-*.json
    under <results_dir>/<model>/truthfulqa/ (limit runs included, each named), each with its provenance
    line, and the knows-vs-says table (likelihood, verification, the probes at their calibration-chosen
    layers) when probe cells exist; nothing typed by hand."""
    root = Path(results_dir) / check_name(model, "model") / TRUTHFULQA
    results = {p.name: json.loads(p.read_text()) for p in sorted(root.glob("*.json"))
               if p.name.split("-")[0] in ("likelihood", "verify", "generate")}
    if not results:
        raise CellError(f"no TruthfulQA results under {root}: run `python -m truthfulqa model={model} mode=...` first")
    label = next(r["model_label"] for r in results.values() if r.get("model_label"))
    lines = [f"# TruthfulQA behaviour: what {label} says", "",
             f"> Generated by `{shown_command(['python', '-m', 'experiments.truthfulqa_report', '--results-dir', str(results_dir)])} --model {model} "
             f"--out docs/results/truthfulqa_behaviour.md` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
             "every number below is read from the result files named. How they are computed: "
             "[python -m truthfulqa](../truthfulqa.md).", ""]
    lines += _knows_vs_says(results_dir, model, results)
    lines += _transfer(results_dir, model, results.get(LIKELIHOOD))
    for name, r in results.items():
        lines += [f"## {name}", "", _provenance_line(root / name, r), ""]
        lines += {"likelihood": _likelihood_section, "verify": _verify_section,
                  "generate": _generate_section}[name.split("-")[0]](r)
    return "\n".join(lines) + "\n"


def _provenance_line(path: Path, r: dict) -> str:
    prov = r.get("provenance", {})
    commit = (prov.get("git_commit") or "unknown")[:10] + (" (uncommitted changes)" if prov.get("git_dirty") else "")
    seconds = r.get("seconds")
    wall = sum(seconds.values()) if isinstance(seconds, dict) else seconds
    machine = r.get("machine") or f"{host()} (not recorded in the file: the machine this page was made on)"
    return (f"Provenance: commit {commit}; written {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(path.stat().st_mtime))}; "
            f"command `{shown_command(prov.get('command', ['?']))}`; machine {machine}; "
            f"{wall / 60:.1f} min of work in the run that finished it"
            + (f" (resumed after {r['resumed_after_requests']} prompts)" if r.get("resumed_after_requests") else "")
            + f"; model {r.get('model_label')}.")


def _fmt_ci(value, ci, signed=False, scale=1.0, digits=3) -> str:
    f = f"{{:{'+' if signed else ''}.{digits}f}}"
    return f"{f.format(value * scale)} [{f.format(ci[0] * scale)}, {f.format(ci[1] * scale)}]"


def _knows_vs_says(results_dir: Path, model: str, results: dict) -> list[str]:
    likelihood, verify = results.get(LIKELIHOOD), next((results[n] for n in VERIFY if n in results), None)
    rows, notes = [], []
    if likelihood:
        rows.append([f"likelihood ({likelihood['format']})", likelihood["n_questions"],
                     _fmt_ci(likelihood["mc1"], likelihood["mc1_ci"]), _fmt_ci(likelihood["mc2"], likelihood["mc2_ci"]), ""])
    if verify:
        rows.append([f"verification ({verify['format']})", verify["n_questions"],
                     _fmt_ci(verify["mc1_verify"], verify["mc1_verify_ci"]), "",
                     _fmt_ci(verify["mc2_verify"], verify["mc2_verify_ci"], True)])
    if not likelihood and not verify:
        notes += ["", f"No full-run {LIKELIHOOD} or {' / '.join(VERIFY)} yet (runs with limit= are listed below)."]
    try:
        table = probe_mc_table(results_dir, model, likelihood, verify)
        chosen = table.merge(chosen_layers(results_dir, model), on=KEYS)
    except CellError as err:
        notes += ["", f"No probe row: {err}", ""]
    else:
        for _, r in chosen.sort_values(["probe", "task", "split", "seed"]).iterrows():
            n = r["n_questions"]
            rows += [[f"probe {r['probe']} ({r['task']}, layer {r['layer']} chosen on calibration MCC, seed {r['seed']}; "
                      "test questions)", n, _ci(r, "probe_mc1"), _ci(r, "probe_mc2"),
                      _ci(r, "probe_mc2_verify", True) or "not in this cell (rerun train_probe)"],
                     [f"likelihood / verification on the same {n} questions", n,
                      f"{_num(r['likelihood_mc1_same'])} / {_num(r['verify_mc1_same'])}", _num(r["likelihood_mc2_same"]),
                      _num(r["verify_mc2_same"], True)]]
        notes += ["", "Probe MC1 and verification MC1 credit a best answer tied at the top with k - 1 others 1 / k; "
                  "likelihood MC1 keeps the harness's argmax. MC2_verify = mean P(true) of the correct answers - "
                  "mean of the incorrect ones (> 0: true answers rated higher). Intervals: 95 % bootstrap over questions.",
                  ""]
    return ["## Knows vs says", "",
            markdown_table(["source", "questions", "MC1", "MC2", "MC2_verify"], rows).rstrip("\n"), *notes]


def transfer_table(results_dir: Path, model: str, likelihood: dict | None) -> pd.DataFrame:
    """One row per transfer cell of a probe trained on another datapack and scored on TruthfulQA's answers
    (`python -m apply_probe probe=<cell> data=truthfulqa`: <results_dir>/<model>/<train>->truthfulqa/), with
    the likelihood MC1 of the same questions; a cell whose probe MC1 predates the tie rule is a CellError."""
    root = Path(results_dir) / check_name(model, "model")
    by_row = {q["row"]: q for q in likelihood["questions"]} if likelihood else {}
    rows = []
    for path in cell_files(results_dir, root.name, f"*->{TRUTHFULQA}"):
        cell = read_cell(path)
        m = cell["metrics"]
        if "probe_mc1_ties" not in m:
            raise CellError(f"{path} has no probe MC1 or the one of the old tie rule (a tie went to the best answer): "
                            "rerun apply_probe with overwrite=true")
        mc1, _ = likelihood_same(by_row, m["probe_mc_questions"])
        rows.append({"train": path.parents[4].name.split("->")[0], "probe": cell["config"]["probe"]["name"],
                     "task": cell["config"]["task"]["name"], "layer": cell["layer"], "mcc": m.get("mcc"),
                     "mcc_lo": (m.get("mcc_ci") or [np.nan] * 2)[0], "mcc_hi": (m.get("mcc_ci") or [np.nan] * 2)[1],
                     "auroc": m.get("auroc"), "probe_mc1": m["probe_mc1"], "probe_mc1_lo": m["probe_mc1_ci"][0],
                     "probe_mc1_hi": m["probe_mc1_ci"][1], "probe_mc1_ties": m["probe_mc1_ties"],
                     "n_questions": len(m["probe_mc_questions"]), "likelihood_mc1_same": np.mean(mc1)})
    return pd.DataFrame(rows)


def _transfer(results_dir: Path, model: str, likelihood: dict | None) -> list[str]:
    """The behaviour page's section on Trilemma probes scored on TruthfulQA (transfer_table); [] without cells."""
    table = transfer_table(results_dir, model, likelihood)
    if table.empty:
        return []
    lines = ["## Transfer of the Trilemma probes", "",
             "Every transfer cell found: a probe trained on a Trilemma datapack, at its cell's layer, scored on every "
             "answer of every question (`python -m apply_probe probe=<cell> data=truthfulqa`; which cells were "
             "applied is the command's choice, see the commands on the page that links here).", "",
             markdown_table(["trained on", "probe (task, layer)", "MCC (accepted rows)", "AUROC", "probe MC1", "MC1 ties",
                             "questions", "likelihood MC1 (same questions)"],
                            [[r["train"], f"{r['probe']} ({r['task']}, {r['layer']})", _ci(r, "mcc"), _num(r["auroc"]),
                              _ci(r, "probe_mc1"), r["probe_mc1_ties"], r["n_questions"], _num(r["likelihood_mc1_same"])]
                             for _, r in table.sort_values(["train", "probe", "task", "layer"]).iterrows()]
                            ).rstrip("\n")]
    return lines + ["", "Probe MC1 credits a best answer tied at the top with k - 1 others 1 / k. Intervals: 95 % "
                    "bootstrap (MCC as the cell records it; MC1 over questions).", ""]


def _likelihood_section(r: dict) -> list[str]:
    return [f"Likelihood, format `{r['format']}`, {r['n_questions']} questions: MC1 {_fmt_ci(r['mc1'], r['mc1_ci'])}, "
            f"MC2 {_fmt_ci(r['mc2'], r['mc2_ci'])}.", ""]


def _verify_section(r: dict) -> list[str]:
    p = r["prompt"]
    return [f"Verification, format `{r['format']}`, {r['n_questions']} questions ({r['n_prompts']} distinct prompts): "
            f"**MC1 {_fmt_ci(r['mc1_verify'], r['mc1_verify_ci'])}** ({r['mc1_verify_ties']} questions decided by a tie), "
            f"**MC2_verify {_fmt_ci(r['mc2_verify'], r['mc2_verify_ci'], True)}**; mean P(yes) "
            f"{r['p_yes_correct']:.3f} over the correct answers, {r['p_yes_incorrect']:.3f} over the incorrect ones.",
            "", f"Yes ids {p['yes_ids']} ({', '.join(repr(t) for t in p['yes_tokens'])}), no ids {p['no_ids']} "
            f"({', '.join(repr(t) for t in p['no_tokens'])}). The prompt (the next token answers it):", "",
            "```text", p["template"], "```", ""]


def _generate_section(r: dict) -> list[str]:
    d, j, a = r["decoding"], r["judge"], r["agreement"]
    decoding = ("greedy" if d["greedy"] else f"sampling, temperature {d['temperature']}, top_p {d['top_p']}, "
                f"seed {d['seed']}") + f", at most {d['max_new_tokens']} new tokens"
    kappa = "undefined" if a["kappa"] is None else f"{a['kappa']:.3f}"
    stops = pd.Series([q["stop"] for q in r["questions"]]).value_counts().to_dict()
    lines = [f"Generation, format `{r['format']}`, {decoding}; {r['n_questions']} questions; stops: "
             + ", ".join(f"{k} {v}" for k, v in stops.items()) + ".", "",
             f"Judge: {j['label']} (`judge={j['name']}`, {j['format']} prompt), P(yes) > 0.5; {j['prompts']} judge "
             f"prompts, {j['scored_now']} scored in the run that wrote the file, the rest read from the judge cache.", "",
             markdown_table(["", "% of the generated answers"],
                            [[title, _fmt_ci(r[f"pct_{name}"], r[f"pct_{name}_ci"], digits=1)]
                             for name, title in (("truthful", "truthful"), ("informative", "informative"),
                                                 ("truthful_informative", "truthful and informative"))]).rstrip("\n")]
    lines += ["", f"**Judge vs the dataset's labels** ({a['n']} of the dataset's own answers of these questions judged "
              f"as if generated, truthful = P(yes) > 0.5): accuracy {a['accuracy']:.3f}, Cohen's kappa {kappa}, "
              f"AUROC of P(yes) {_num(a.get('auroc'))} "
              f"(judge says truthful {100 * a['judge_says_truthful']:.1f} %, dataset {100 * a['dataset_truthful']:.1f} %; "
              f"tp {a['tp']}, fp {a['fp']}, tn {a['tn']}, fn {a['fn']}).", ""]
    if j["label"] == r["model_label"]:
        lines += ["The judge is the model that generated the answers (self-judging): its ratings share the "
                  "generator's blind spots and tend to favour its own answers, so read the percentages above "
                  "through the agreement line, not as a measurement of truthfulness.", ""]
    lines += ["First answers (question, answer, P(truthful), P(informative)):", "",
              markdown_table(["row", "question", "answer", "P(truthful)", "P(informative)"],
                             [[*(c.replace("|", "\\|") for c in (str(q["row"]), q["question"], q["answer"] or "(empty)")),
                               f"{q['p_truthful']:.3f}", f"{q['p_informative']:.3f}"] for q in r["questions"][:8]]
                             ).rstrip("\n")]
    lines += ["", "Judge prompt (truthful; the answer in place of `{answer}`):", "", "```text", j["example_prompt"],
              "```", ""]
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments.truthfulqa_report",
                                     description="Write the TruthfulQA behaviour page from the result JSON files.")
    parser.add_argument("--results-dir", default="results", help="the results_dir of python -m truthfulqa")
    parser.add_argument("--model", default="smollm2", help="model.name of the runs")
    parser.add_argument("--out", default="docs/results/truthfulqa_behaviour.md", help="the page written")
    args = parser.parse_args(argv)
    try:
        text = behaviour_page(Path(args.results_dir), args.model)
    except CellError as err:
        raise SystemExit(f"error: {err}") from None
    Path(args.out).write_text(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
