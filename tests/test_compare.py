"""Paired comparisons of cells and the report's new parts (risk-coverage, AURC, best vs runner-up)."""
from __future__ import annotations

import subprocess
import sys
from functools import partial
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from evaluation.cells import CellError, read_cell
from evaluation.selective import aurc
from experiments.compare import compare_cells
from experiments.report import write_report
from extract.config import compose_config
from probes.pipeline import train_probes
from tests.test_train_probe import make_synthetic_store

ROOT = Path(__file__).resolve().parent.parent


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
    same = compare_cells(planted, planted, n_boot=100)
    assert same["mcc"]["diff"] == 0 and same["mcc"]["ci"] == [0.0, 0.0] and same["mcnemar"]["p_value"] == 1.0


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
    row = versus[versus["task"] == "true_vs_all"].iloc[0]
    assert row["delta_mcc_lo"] <= row["delta_mcc"] <= row["delta_mcc_hi"]
    assert "runner-up" in (out / "best.md").read_text()
    table = pd.read_csv(out / "layers.csv")
    assert {"aurc", "ece", "mcc_boot_lo", "mcc_boot_hi"} <= set(table.columns)
