"""Paired comparisons of cells and the report's new parts (risk-coverage, AURC, best vs runner-up, with
and without abstention, raw and Holm-adjusted)."""
from __future__ import annotations

import subprocess
import sys
from functools import partial
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from evaluation.cells import CellError, read_cell
from sklearn.metrics import matthews_corrcoef

from evaluation.selective import aurc, holm, mcnemar_exact
from experiments.compare import ESTIMANDS, compare_cells
from experiments.report import write_report
from toolkit.config import compose_config
from probes.pipeline import train_probes
from tests.helpers import make_synthetic_store

ROOT = Path(__file__).resolve().parent.parent


def cells_of(root: Path, best: pd.DataFrame, probe: str) -> dict:
    r = best.loc[probe]
    return read_cell(root / "results" / "synthetic" / "city_locations" / probe / r["task"] / r["split"]
                     / f"layer={r['layer']}" / "seed=0.json")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare")
    make_synthetic_store(root / "activations", n_real=400, n_neither=200)
    run = partial(compose_config, "train_probe", "model.name=synthetic", f"store_dir={root / 'activations'}",
                  f"results_dir={root / 'results'}", "n_boot=50", "layer=all", "task=true_vs_all")
    cells = {p: train_probes(run(f"probe={p}")) for p in ("mean_diff", "linear")}
    tvf = train_probes(run("probe=mean_diff", "task=true_vs_false", "layer=1"))[0]
    return root, cells, tvf


def test_planted_layer_beats_noise_layer_and_self_comparison_is_zero(results):
    _, cells, _ = results
    noise, planted = (read_cell(p) for p in cells["mean_diff"])
    better = compare_cells(planted, noise, n_boot=300)
    assert better["bootstrap"] == "cluster"
    assert better["mcc"]["diff"] > 0 and better["mcc"]["ci"][0] > 0 and better["mcc"]["p_value"] < 0.01
    assert better["aurc"]["diff"] < 0  # the planted layer's errors are the less confident ones
    y = np.array(planted["test"]["y"])
    probs = np.array(planted["test"]["probs"])
    assert planted["metrics"]["aurc"] == pytest.approx(aurc(y, probs.argmax(1), probs.max(1)))
    assert better["auroc"]["diff"] == pytest.approx(planted["metrics"]["auroc"] - noise["metrics"]["auroc"])
    assert better["auroc"]["ci"][0] > 0
    same = compare_cells(planted, planted, n_boot=100)
    assert same["auroc"]["diff"] == 0 and same["auroc"]["ci"] == [0.0, 0.0]
    assert same["mcc"]["diff"] == 0 and same["mcc"]["ci"] == [0.0, 0.0] and same["mcnemar"]["p_value"] == 1.0


def test_the_comparison_without_abstention_uses_all_rows(results):
    """mcc_all: argmax of each cell's probabilities on every test row (sklearn's MCC), McNemar on all rows;
    mcc: each cell on its own accepted rows."""
    _, cells, _ = results
    a, b = read_cell(cells["mean_diff"][1]), read_cell(cells["linear"][1])
    result = compare_cells(a, b, n_boot=100)
    y = np.array(a["test"]["y"])
    plain = [np.array(c["test"]["probs"]).argmax(1) for c in (a, b)]
    assert result["mcc_all"]["diff"] == pytest.approx(matthews_corrcoef(y, plain[0]) - matthews_corrcoef(y, plain[1]))
    assert result["mcc_all"]["ci"][0] <= result["mcc_all"]["diff"] <= result["mcc_all"]["ci"][1]
    assert result["mcnemar_all"] == mcnemar_exact(y, *plain) and result["mcnemar_all"]["n_both"] == y.size
    assert result["mcnemar"]["n_both"] == int(np.sum((np.array(a["test"]["pred"]) >= 0) & (np.array(b["test"]["pred"]) >= 0)))
    assert set(ESTIMANDS) >= {"mcc", "wmcc", "mcc_all", "aurc", "mcnemar", "mcnemar_all"}


def test_cells_on_other_rows_are_refused(results):
    _, cells, tvf = results
    with pytest.raises(CellError, match="different test rows"):
        compare_cells(read_cell(cells["linear"][1]), read_cell(tvf))
    done = subprocess.run([sys.executable, "-m", "experiments.compare", str(cells["linear"][1]), str(tvf)],
                          cwd=ROOT, capture_output=True, text=True)
    errors = [line for line in done.stderr.splitlines() if "ERROR" in line]
    assert done.returncode == 1 and len(errors) == 1 and "different test rows" in errors[0]


def test_report_has_selective_plots_and_best_vs_runner_up(results):
    root, _, _ = results
    out = write_report(root / "results", root / "reports", "synthetic", "city_locations")
    for name in ("risk_coverage.png", "aurc_by_layer.png", "reliability.png", "best_vs_runner_up.csv"):
        assert (out / name).stat().st_size > 0, name
    versus = pd.read_csv(out / "best_vs_runner_up.csv")
    # one row per estimand: with abstention (each probe's accepted rows) and without (argmax, all rows)
    assert sorted(versus["estimand"]) == sorted([ESTIMANDS["mcc"], ESTIMANDS["mcc_all"]])
    best = pd.read_csv(out / "best.csv").query("task == 'true_vs_all'").set_index("probe")
    first, second = (cells_of(root, best, p) for p in best.sort_values("cal_mcc", ascending=False).index[:2])
    plain = [np.array(c["test"]["probs"]).argmax(1) for c in (first, second)]
    for _, row in versus[versus["task"] == "true_vs_all"].iterrows():
        assert row["delta_lo"] <= row["delta"] <= row["delta_hi"]
        everything = row["estimand"] == ESTIMANDS["mcc_all"]
        assert row["mcnemar_rows"] == (len(first["test"]["y"]) if everything else
                                       compare_cells(first, second, n_boot=1)["mcnemar"]["n_both"])
        if everything:
            assert row["mcnemar_p_raw"] == pytest.approx(mcnemar_exact(first["test"]["y"], *plain)["p_value"])
        # one definition of significant: the bootstrap test's p (raw / Holm) < 0.05, McNemar its own column
        for test in ("delta", "mcnemar"):
            assert row[f"{test}_significant_raw"] == (row[f"{test}_p_raw"] < 0.05)
            assert row[f"{test}_significant_holm"] == (row[f"{test}_p_holm"] < 0.05)
    for estimand, g in versus.groupby("estimand"):        # the family: the table's comparisons of one estimand
        np.testing.assert_allclose(g["delta_p_holm"], holm(g["delta_p_raw"].to_numpy()))
        np.testing.assert_allclose(g["mcnemar_p_holm"], holm(g["mcnemar_p_raw"].to_numpy()))
    md = (out / "best.md").read_text()
    assert "runner-up" in md and ESTIMANDS["mcc_all"] in md and "after Holm" in md
    table = pd.read_csv(out / "layers.csv")
    assert {"aurc", "ece", "mcc_boot_lo", "mcc_boot_hi"} <= set(table.columns)
