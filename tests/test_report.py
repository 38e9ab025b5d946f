"""Reports: the per-layer table equals metrics recomputed with scikit-learn from the cells' stored
test predictions; seeds are aggregated; plots and best-layer table are written; cells' health flags;
Holm columns within families."""
from __future__ import annotations

import json
import shutil
from functools import partial

import numpy as np
import pandas as pd
import pytest
from sklearn.metrics import matthews_corrcoef

from experiments.report import write_report
from experiments.tables import cell_flag, with_holm
from toolkit.config import compose_config
from probes.pipeline import train_probes
from tests.helpers import make_synthetic_store


@pytest.fixture(scope="module")
def report_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("report")
    make_synthetic_store(root / "activations", n_real=500, n_neither=250)
    run = partial(compose_config, "train_probe", "model.name=synthetic", f"store_dir={root / 'activations'}",
                  f"results_dir={root / 'results'}", "n_boot=50", "layer=all")
    for seed in (0, 1):
        train_probes(run("probe=mean_diff", "task=true_vs_all", f"seed={seed}"))
    train_probes(run("probe=linear", "task=neither_vs_all"))
    return root, write_report(root / "results", root / "reports", "synthetic", "city_locations")


def recomputed(cell_path) -> tuple[float, float, float]:
    test = json.loads(cell_path.read_text())["test"]
    y, pred = np.array(test["y"]), np.array(test["pred"])
    accepted = pred >= 0
    mcc = matthews_corrcoef(y[accepted], pred[accepted])
    return mcc, mcc * accepted.mean(), accepted.mean()


def test_table_equals_metrics_recomputed_from_predictions(report_dir):
    root, out = report_dir
    table = pd.read_csv(out / "layers.csv")
    assert len(table) == 2 * 2  # two (probe, task) pairs x layers 0, 1
    for _, row in table.iterrows():
        seeds = [0, 1] if row["probe"] == "mean_diff" else [0]
        paths = [root / "results" / "synthetic" / "city_locations" / row["probe"] / row["task"] / row["split"]
                 / f"layer={row['layer']}" / f"seed={s}.json" for s in seeds]
        values = np.array([recomputed(p) for p in paths])
        assert row["n_seeds"] == len(seeds)
        np.testing.assert_allclose([row["mcc"], row["wmcc"], row["acceptance"]], values.mean(0), atol=1e-9)
        if len(seeds) > 1:
            np.testing.assert_allclose(row["mcc_hi"] - row["mcc"], values[:, 0].std(ddof=1), atol=1e-9)


def test_best_layer_and_plots(report_dir):
    _, out = report_dir
    best = pd.read_csv(out / "best.csv")
    assert set(best["layer"]) == {1}  # the planted layer wins on the calibration split
    for name in ("layers.md", "best.md", "mcc_by_layer.png", "reliability.png"):
        assert (out / name).stat().st_size > 0
    assert (out / "layers.md").read_text().startswith("| probe | task |")


def test_flag_column_names_why_a_cell_is_degenerate(report_dir, tmp_path):
    """best.csv / layers.csv `flag`: a cell's degenerate_reasons joined by ";", "degenerate" for a
    degenerate cell without reasons (cells written before the key), empty for a healthy one."""
    root, _ = report_dir
    results = tmp_path / "results"
    shutil.copytree(root / "results", results)
    folder = results / "synthetic" / "city_locations" / "mean_diff" / "true_vs_all" / "entity_disjoint" / "layer=1"
    for seed, change in ((0, {"degenerate": True, "degenerate_reasons": ["C_at_grid_edge:upper", "zero_weights"]}),
                         (1, {"degenerate": True})):
        cell = json.loads((folder / f"seed={seed}.json").read_text())
        cell.pop("degenerate_reasons", None)
        (folder / f"seed={seed}.json").write_text(json.dumps({**cell, **change}))
    out = write_report(results, tmp_path / "reports", "synthetic", "city_locations")
    best = pd.read_csv(out / "best.csv", keep_default_na=False).set_index("probe")
    assert best.loc["mean_diff", "flag"] == "C_at_grid_edge:upper;zero_weights;degenerate"
    linear = json.loads(next((results / "synthetic" / "city_locations" / "linear").glob(
        f"neither_vs_all/*/layer={best.loc['linear', 'layer']}/seed=0.json")).read_text())
    assert best.loc["linear", "flag"] == ";".join(linear.get("degenerate_reasons") or [])   # untouched: its own
    assert "| C_at_grid_edge:upper;zero_weights;degenerate |" in (out / "best.md").read_text()
    assert cell_flag({"degenerate": False}) == "" and cell_flag({}) == ""
    assert cell_flag({"degenerate": True, "degenerate_reasons": []}) == "degenerate"


def test_holm_columns_adjust_within_each_family():
    table = pd.DataFrame({"model": ["a", "a", "a", "b", "b"], "d_p_raw": [0.01, 0.04, np.nan, 0.02, 0.5]})
    out = with_holm(table, "d", ["model"])
    np.testing.assert_allclose(out["d_p_holm"], [0.02, 0.04, np.nan, 0.04, 0.5])   # m = 2 in each family
    assert out["d_significant_raw"].tolist()[:2] == [True, True] and pd.isna(out["d_significant_raw"][2])
    assert out["d_significant_holm"].tolist()[3:] == [True, False]
    assert with_holm(table, "d", [])["d_p_holm"].tolist()[:2] == pytest.approx([0.04, 0.08])  # one family of 4
    assert {"d_p_holm", "d_significant_holm"} <= set(with_holm(table.iloc[:0], "d", ["model"]).columns)
