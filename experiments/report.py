"""`python -m experiments.report model=... data=...`: result cells -> per-layer tables and plots.

Reads every cell under <results_dir>/<model>/<datapack>/ and writes to <reports_dir>/<model>/<datapack>/:

    layers.csv, layers.md   one row per (probe, task, split, layer): MCC, W-MCC, acceptance (mean over
                            seeds) with intervals (one seed: its bootstrap 95 % interval; several seeds:
                            mean +/- the spread across seeds), n_seeds; zero-shot rows have layer "-"
    best.csv, best.md       per (probe, task, split): the layer with the highest calibration-split MCC
                            (never chosen on test) and its test metrics
    mcc_by_layer.png        MCC and W-MCC against layer (top) and relative depth (bottom), one panel per
                            task, one line per probe, zero-shot as horizontal lines
    reliability.png         reliability diagram (test split) of every probe at its best layer, first task, with ECE
    risk_coverage.png       risk-coverage curves of every probe at its best layer (and zero-shot), one panel per task
    aurc_by_layer.png       AURC (lower is better) against layer, one panel per task
    ncb.csv, ncb.md, ncb_stress.png         when `python -m ncb` results exist (experiments/ncb_report.py)
    truthfulqa_probe_mc.*, knows_vs_says.png  for data=truthfulqa (experiments/truthfulqa_report.py)
    ../transfer.*, ../transfer_<task>.png   the model's transfer matrix, when apply_probe transfer cells
                                            exist (experiments/transfer.py)

The best-layer table also says whether the best probe of each task (by calibration MCC) is
significantly better than the runner-up on test: paired bootstrap of the MCC difference (whole
subject entities resampled), McNemar on the statements both accept (experiments/compare.py).
With several seeds (same split_seed), `<metric>_seed_sd` is the probe's seed-to-seed spread,
apart from the sampling interval `<metric>_boot_lo/_hi` (mean of the seeds' bootstrap bounds).
"""
from __future__ import annotations

import logging
from pathlib import Path

import hydra
import pandas as pd
from omegaconf import DictConfig

from experiments import plots
from experiments.compare import compare_cells
from experiments.tables import best_layers, cell_of, layer_table, load_cells
from experiments.cross_model import write_cross_model
from experiments.ncb_report import write_ncb
from experiments.transfer import DATAPACKS, write_transfer
from experiments.truthfulqa_report import write_truthfulqa
from extract.statements import TRUTHFULQA
from extract.errors import run_entry

log = logging.getLogger(__name__)


def best_vs_runner_up(cells: pd.DataFrame, best: pd.DataFrame, n_boot: int = 500) -> pd.DataFrame:
    """Per (task, split): the best probe (calibration MCC at its best layer) against the runner-up on
    test: MCC difference with its paired bootstrap interval, and McNemar's p on both-accepted rows."""
    out = []
    for (task, split), g in best.groupby(["task", "split"]):
        if len(g) < 2:
            continue
        first, second = (r for _, r in g.sort_values("cal_mcc", ascending=False).head(2).iterrows())
        result = compare_cells(cell_of(cells, first), cell_of(cells, second), n_boot=n_boot)
        out.append({"task": task, "split": split, "best": f"{first['probe']} (layer {int(first['layer'])})",
                    "runner_up": f"{second['probe']} (layer {int(second['layer'])})",
                    "delta_mcc": result["mcc"]["diff"], "delta_mcc_lo": result["mcc"]["ci"][0],
                    "delta_mcc_hi": result["mcc"]["ci"][1], "p_bootstrap": result["mcc"]["p_value"],
                    "p_mcnemar": result["mcnemar"]["p_value"], "bootstrap": result["bootstrap"],
                    "significant": bool(result["mcc"]["ci"][0] > 0)})
    return pd.DataFrame(out)


def write_report(results_dir: Path, reports_dir: Path, model: str, datapack: str) -> Path:
    cells = load_cells(results_dir, model, datapack)
    table = layer_table(cells)
    best = best_layers(table)
    out = Path(reports_dir) / model / datapack
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "layers.csv", index=False)
    best.to_csv(out / "best.csv", index=False)
    versus = best_vs_runner_up(cells, best)
    versus.to_csv(out / "best_vs_runner_up.csv", index=False)
    (out / "layers.md").write_text(_markdown(table))
    (out / "best.md").write_text(_markdown(best) + "\n" + _versus_markdown(versus))
    title = f"{model} / {datapack}"
    plots.metric_by_layer(table, out / "mcc_by_layer.png", title)
    plots.metric_by_layer(table, out / "aurc_by_layer.png", title, metrics=("aurc",))
    if len(best):
        chosen = {(r["probe"], r["task"]): cell_of(cells, r) for _, r in best.iterrows()}
        behaviour = {(r["probe"], r["task"]): cell_of(cells, r) for _, r in table[table["layer"].isna()].iterrows()}
        plots.risk_coverage(chosen, behaviour, out / "risk_coverage.png", title)
        first_task = sorted(best["task"])[0]
        plots.reliability({p: c for (p, t), c in chosen.items() if t == first_task}, out / "reliability.png",
                          f"{title}: {first_task}")
    write_ncb(results_dir, out, model, datapack)             # nothing when `python -m ncb` has not run
    if datapack == TRUTHFULQA:
        write_truthfulqa(results_dir, out, model)               # probe vs likelihood MC1 / MC2
    if any(Path(results_dir, model).glob("*->*")):              # apply_probe transfer cells exist
        write_transfer(results_dir, reports_dir, model)
    log.info("report written to %s (%d cells)", out, len(cells))
    return out


def _markdown(table: pd.DataFrame) -> str:
    def fmt(r, k):
        lo, hi = r.get(f"{k}_lo"), r.get(f"{k}_hi")
        return f"{r[k]:.3f}" if lo is None or pd.isna(lo) else f"{r[k]:.3f} [{lo:.3f}, {hi:.3f}]"

    lines = ["| probe | task | split | layer | MCC | W-MCC | acceptance | cal. MCC | seeds |",
             "|---|---|---|---|---|---|---|---|---|"]
    for _, r in table.iterrows():
        layer = "none" if pd.isna(r["layer"]) else int(r["layer"])
        cal = "" if pd.isna(r["cal_mcc"]) else f"{r['cal_mcc']:.3f}"
        lines.append(f"| {r['probe']} | {r['task']} | {r['split']} | {layer} | {fmt(r, 'mcc')} | {fmt(r, 'wmcc')} | "
                     f"{r['acceptance']:.3f} | {cal} | {r['n_seeds']} |")
    return "\n".join(lines) + "\n"


def _versus_markdown(versus: pd.DataFrame) -> str:
    lines = ["| task | split | best | runner-up | MCC difference | p (bootstrap) | p (McNemar) | significant |",
             "|---|---|---|---|---|---|---|---|"]
    for _, r in versus.iterrows():
        lines.append(f"| {r['task']} | {r['split']} | {r['best']} | {r['runner_up']} | {r['delta_mcc']:+.3f} "
                     f"[{r['delta_mcc_lo']:+.3f}, {r['delta_mcc_hi']:+.3f}] | {r['p_bootstrap']:.3f} | "
                     f"{r['p_mcnemar']:.3g} | {'yes' if r['significant'] else 'no'} |")
    return "\n".join(lines) + "\n"


def report(cfg: DictConfig) -> Path:
    out = write_report(Path(cfg.results_dir), Path(cfg.reports_dir), cfg.model.name, cfg.data.name)
    if cfg.cross_model:   # several models: the cross-model view of the three Trilemma datapacks
        write_cross_model(cfg.results_dir, cfg.reports_dir, list(cfg.cross_model), list(DATAPACKS))
    return out


@hydra.main(version_base="1.3", config_path="../conf", config_name="report")
def main(cfg: DictConfig) -> None:
    run_entry(report, cfg, log=log)


if __name__ == "__main__":
    main()
