"""NCB stress-test tables and figure from `python -m ncb` outputs (results/<model>/<datapack>/ncb/*/stress.json).

    ncb.csv / ncb.md   per method, interference, level and fraction: accuracy under interference of the
                       high and low NCB groups with cluster-bootstrap 95 % intervals, their drop from clean
                       accuracy, and the gap high - low (the layout of Table 3 of Xu et al., 2601.05905);
                       where stress.json records the gap's bootstrap p (`gap_p`), `gap_p_raw` and `gap_p_holm`
                       (Holm over the family of all one method's gaps: every interference, level and fraction)
    ncb_stress.png     accuracy against the number k of peers repeating the false claim (peer, peer_truth),
                       high (solid) and low (dashed) NCB group, one panel per method (probes and zero-shot)
    ncb_internal_vs_behaviour.csv / .md
                       each probe (internal belief) against the zero-shot answer (behaviour) of the same task on
                       the same stress inputs: the test targets both get right on the clean statement, the
                       accuracy of each under every context and the paired difference probe - zero-shot, its
                       bootstrap p raw and Holm-adjusted over the family of every row of the table
    self_consistency.csv / .md
                       per zero-shot method and setting: perfectly self-consistent targets and their collapse
                       under each context (ncb.self_consistency); the other settings' stress results are rows of
                       ncb.csv / ncb.md as methods `<method> [cot]`, `<method> [reflection]`
    ncb_robust.csv / .md, ncb_robust_clean.csv / .md
                       probes trained with augment=structure_aware / neutral against the plain probe and each
                       other on the same test targets (experiments/ncb_robust.py)
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pandas as pd

from evaluation.selective import paired_bootstrap
from experiments.ncb_robust import stress_inputs, write_robust
from experiments.plots import pyplot
from experiments.tables import ALPHA, p_text, with_holm, yes_no
from toolkit.errors import check_name
from toolkit.markdown import markdown_table

log = logging.getLogger(__name__)
QUANTITY = ("peer", "peer_truth")  # interferences whose level is a count k


def load_stress(results_dir: Path, model: str, datapack: str) -> pd.DataFrame:
    """One row per (method, interference, level, fraction) of every stress.json of the model and datapack, and
    of every other zero-shot setting's stress-<setting>.json (method `<method> [<setting>]`)."""
    folder = Path(results_dir) / check_name(model, "model") / check_name(datapack, "data") / "ncb"
    rows = []
    for path in sorted(folder.glob("*/stress.json")):
        summary = json.loads(path.read_text())
        runs = [(summary["method"], summary["results"])]
        for setting in sorted(path.parent.glob("stress-*.json")):
            other = json.loads(setting.read_text())
            runs.append((f"{summary['method']} [{other['setting']}]", other["results"]))
        for method, r in ((m, r) for m, results in runs for r in results):
            row = {"method": method, "kind": summary["info"]["kind"], "interference": r["interference"],
                   "level": r["level"], "fraction": r["fraction"], "gap": r["gap"], "gap_p_raw": r.get("gap_p")}
            row["gap_lo"], row["gap_hi"] = r["gap_ci"] or (None, None)
            for side in ("high", "low"):
                s = r[side]
                row.update({f"{side}_n": s["n"], f"{side}_p_y": s["p_y_mean"], f"{side}_accuracy": s["accuracy"],
                            f"{side}_drop": s["drop"]})
                row[f"{side}_accuracy_lo"], row[f"{side}_accuracy_hi"] = s["accuracy_ci"] or (None, None)
            rows.append(row)
    return with_holm(pd.DataFrame(rows), "gap", ["method"])


def write_ncb(results_dir, out_dir, model: str, datapack: str, fraction: float = 0.2) -> list[Path]:
    """Write ncb.csv, ncb.md and ncb_stress.png (the figure at one group `fraction`) to out_dir,
    ncb_internal_vs_behaviour.csv / .md where a probe and zero-shot share a task, and the ncb_robust tables
    where augmented probes sit beside their plain probe; returns their paths ([] when the model and datapack
    have no NCB results)."""
    table = load_stress(results_dir, model, datapack)
    if table.empty:
        log.info("no NCB results for %s / %s (run python -m ncb)", model, datapack)
        return []
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "ncb.csv", out / "ncb.md", out / "ncb_stress.png"]
    table.to_csv(paths[0], index=False)
    paths[1].write_text(_markdown(table))
    plot_stress(table, fraction, paths[2], f"{model}, {datapack}: accuracy under peer conflict\n"
                                           f"high / low NCB = top / bottom {fraction:.0%} of valid test targets")
    versus = internal_vs_behaviour(results_dir, model, datapack)
    if not versus.empty:
        paths += [out / "ncb_internal_vs_behaviour.csv", out / "ncb_internal_vs_behaviour.md"]
        versus.to_csv(paths[3], index=False)
        paths[4].write_text(_versus_markdown(versus))
    consistency = self_consistency_table(results_dir, model, datapack)
    if not consistency.empty:
        paths += [out / "self_consistency.csv", out / "self_consistency.md"]
        consistency.to_csv(paths[-2], index=False)
        paths[-1].write_text(_consistency_markdown(consistency))
    return paths + write_robust(results_dir, out, model, datapack)


def self_consistency_table(results_dir, model: str, datapack: str) -> pd.DataFrame:
    """One row per (zero-shot method, setting) of every self_consistency.json (ncb.self_consistency): the pool's
    targets, those the setting answers right on the clean statement, the perfect ones among them and the
    expected number of unanimous pools, then per (interference, level) how many perfect targets collapse
    (`collapsed <interference> <level>`: collapsed / n)."""
    folder = Path(results_dir) / check_name(model, "model") / check_name(datapack, "data") / "ncb"
    rows = []
    for path in sorted(folder.glob("*/self_consistency.json")):
        record = json.loads(path.read_text())
        for setting, s in record["settings"].items():
            row = {"method": record["method"], "setting": setting, "temperature": record["temperature"],
                   "n_samples": record["n_samples"], **s["counts"]}
            row.update({f"collapsed {c['interference']} {c['level']}": f"{c['collapsed']} / {c['n']}"
                        for c in s["collapse"]})
            rows.append(row)
    return pd.DataFrame(rows)


def _consistency_markdown(table: pd.DataFrame) -> str:
    lines = ["Self-consistency (ncb.self_consistency): perfect = n answers at the temperature agree with probability "
             ">= 1/2, counted among the group pool's targets that the setting answers right on the clean statement; "
             "collapsed = perfect targets whose answer under the context is wrong / perfect targets with that "
             "context. Counts only: no test, so no multiplicity correction.", "",
             "| " + " | ".join(table.columns) + " |", "|" + "---|" * len(table.columns)]
    for _, r in table.iterrows():
        lines.append("| " + " | ".join("-" if pd.isna(v) else f"{v:.3g}" if isinstance(v, float) else str(v)
                                       for v in r) + " |")
    return "\n".join(lines) + "\n"


def internal_vs_behaviour(results_dir, model: str, datapack: str, n_boot: int = 1000, seed: int = 0) -> pd.DataFrame:
    """One row per (probe method, zero-shot method of the same task, interference, level): on the test
    targets valid for both (both plain predictions right on the clean statement) that both scored under
    that context, n, n_entities, each method's accuracy, the difference probe - zero-shot, 95 % intervals
    from one cluster bootstrap over subject entities (the same draws for both methods), the difference's
    two-sided bootstrap p raw and Holm-adjusted over every row of the table (`difference_p_raw`,
    `difference_p_holm`, tables.with_holm), and each method's mean shift of P(y) (under the context -
    clean), which moves even where the plain prediction does not."""
    folder = Path(results_dir) / check_name(model, "model") / check_name(datapack, "data") / "ncb"
    methods = {}
    for path in sorted(folder.glob("*/stress.json")):
        if path.with_name("inputs.csv").exists() and path.with_name("targets.json").exists():
            methods[path.parent.name] = (json.loads(path.read_text())["info"], stress_inputs(path.parent))
    rows = []
    for probe, (p_info, p_frame) in methods.items():
        for zero, (z_info, z_frame) in methods.items():
            if p_info["kind"] != "probe" or z_info["kind"] != "zero_shot" or p_info["task"] != z_info["task"]:
                continue
            both = p_frame.merge(z_frame, on=["target_row", "entity", "interference", "level", "control"],
                                 suffixes=("_p", "_z"))
            for (interference, level), part in both.groupby(["interference", "level"], sort=False):
                a, b = part["correct_p"].to_numpy(float), part["correct_z"].to_numpy(float)
                row = {"probe": probe, "zero_shot": zero, "task": p_info["task"], "interference": interference,
                       "level": level, "n": len(part), "n_entities": part["entity"].nunique()}
                for name, column, stat in (("probe", "probe_accuracy", lambda i: a[i].mean()),
                                           ("zero_shot", "zero_shot_accuracy", lambda i: b[i].mean()),
                                           ("difference", "difference", lambda i: a[i].mean() - b[i].mean())):
                    r = paired_bootstrap(stat, len(part), groups=part["entity"].to_numpy(), n_boot=n_boot,
                                         seed=seed)                       # one seed: the same draws for all three
                    row.update({column: r["diff"], f"{name}_lo": r["ci"][0], f"{name}_hi": r["ci"][1]})
                rows.append({**row, "difference_p_raw": r["p_value"], "probe_p_y_shift": part["shift_p"].mean(),
                             "zero_shot_p_y_shift": part["shift_z"].mean()})
    return with_holm(pd.DataFrame(rows), "difference", [])


def _versus_markdown(table: pd.DataFrame) -> str:
    lines = [f"Paired cluster bootstrap over subject entities; p: two-sided bootstrap p of probe - zero-shot, raw / "
             f"Holm-adjusted over every row of this table; significant = Holm p < {ALPHA}.", "",
             markdown_table(["probe", "zero-shot", "interference", "level", "n (entities)", "probe accuracy",
                             "zero-shot accuracy", "probe - zero-shot", "p / Holm", "significant",
                             "P(y) shift: probe / zero-shot"],
                            [[r["probe"], r["zero_shot"], r["interference"], r["level"], f"{r['n']} ({r['n_entities']})",
                              f"{r['probe_accuracy']:.3f} [{r['probe_lo']:.3f}, {r['probe_hi']:.3f}]",
                              f"{r['zero_shot_accuracy']:.3f} [{r['zero_shot_lo']:.3f}, {r['zero_shot_hi']:.3f}]",
                              f"{r['difference']:+.3f} [{r['difference_lo']:+.3f}, {r['difference_hi']:+.3f}]",
                              p_text(r, "difference"), yes_no(r["difference_significant_holm"]),
                              f"{r['probe_p_y_shift']:+.3f} / {r['zero_shot_p_y_shift']:+.3f}"]
                             for _, r in table.iterrows()])]
    return "\n".join(lines)


def _markdown(table: pd.DataFrame) -> str:
    def acc(r, side):
        value, lo, hi = r[f"{side}_accuracy"], r[f"{side}_accuracy_lo"], r[f"{side}_accuracy_hi"]
        if pd.isna(value):
            return "n/a"
        return f"{value:.3f}" if pd.isna(lo) else f"{value:.3f} [{lo:.3f}, {hi:.3f}]"

    def num(x, fmt="{:.3f}"):
        return "n/a" if pd.isna(x) else fmt.format(x)

    lines = [f"Cluster-bootstrap 95 % intervals over subject entities, each on its own; gap p: two-sided bootstrap p "
             f"raw / Holm-adjusted over all the method's gaps (every interference, level and fraction), \"-\" where "
             f"stress.json records none; significant = Holm p < {ALPHA}.", "",
             markdown_table(["method", "interference", "level", "top / bottom", "high: n", "high: accuracy",
                             "high: drop", "low: n", "low: accuracy", "low: drop", "gap high - low", "gap p / Holm",
                             "significant"],
                            [[r["method"], r["interference"], r["level"], f"{r['fraction']:.0%}", r["high_n"],
                              acc(r, "high"), num(r["high_drop"]), r["low_n"], acc(r, "low"), num(r["low_drop"]),
                              num(r["gap"], "{:+.3f}") + ("" if pd.isna(r["gap_lo"])
                                                          else f" [{r['gap_lo']:+.3f}, {r['gap_hi']:+.3f}]"),
                              p_text(r, "gap"), yes_no(r["gap_significant_holm"])] for _, r in table.iterrows()])]
    return "\n".join(lines)


def plot_stress(table: pd.DataFrame, fraction: float, path: Path, title: str) -> None:
    """Accuracy of the high (solid) and low (dashed) group against k, one line colour per interference of
    QUANTITY, one panel per method, at the group fraction closest to `fraction`."""
    plt = pyplot()
    methods = list(dict.fromkeys(table["method"]))
    ncols = min(3, len(methods))
    nrows = -(-len(methods) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(max(7.0, 4.5 * ncols), 3.6 * nrows + 1.0), squeeze=False,
                             sharey=True)
    for ax in axes.flat[len(methods):]:
        ax.set_visible(False)
    for ax, method in zip(axes.flat, methods):
        part = table[(table["method"] == method) & table["interference"].isin(QUANTITY)]
        if part.empty:
            ax.set_title(f"{method}\n(no peer results)", fontsize=8)
            continue
        chosen = part["fraction"].iloc[int(np.argmin(np.abs(part["fraction"].to_numpy() - fraction)))]
        part = part[part["fraction"] == chosen]
        for colour, interference in zip(("C0", "C1"), QUANTITY):
            lines = part[part["interference"] == interference].assign(k=lambda d: d["level"].astype(float)).sort_values("k")
            for side, style in (("high", "-"), ("low", "--")):
                ax.plot(lines["k"], lines[f"{side}_accuracy"], style, color=colour, marker="o",
                        label=f"{interference}, {side} NCB")
                ax.fill_between(lines["k"], lines[f"{side}_accuracy_lo"].astype(float),
                                lines[f"{side}_accuracy_hi"].astype(float), color=colour, alpha=0.1)
        ax.set_title(f"{method}\n({part['kind'].iloc[0]}, groups of {chosen:.0%})", fontsize=8)
        ax.set_xlabel("k of 5 peers repeating the false claim (0 = neutral control)", fontsize=8)
        ax.grid(alpha=0.3)
    for row in axes:
        row[0].set_ylabel("accuracy under interference")
    axes[0][0].set_ylim(0, 1.02)
    fig.suptitle(title, fontsize=10)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="lower center", ncol=4)
    fig.tight_layout(rect=(0, 0.8 / fig.get_figheight(), 1, 1 - 0.6 / fig.get_figheight()))
    fig.savefig(path, dpi=120)
    plt.close(fig)
