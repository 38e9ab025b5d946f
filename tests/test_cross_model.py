"""Cross-model claims report: two toy models with different depths, real train_probe cells on synthetic
stores; relative depths and quarters, the neither shares against a direct count, verdicts against
their intervals, figures, and the entry point's one-line error."""
from __future__ import annotations

import json
import subprocess
import sys
from functools import partial
from pathlib import Path

import h5py
import numpy as np
import pandas as pd
import pytest

from experiments.cross_model import depth_quarter, verdict
from extract.config import compose_config
from extract.statements import load_statements
from extract.store import KIND_SPECIAL, KIND_STATEMENT, create_store
from probes.pipeline import train_probes

ROOT = Path(__file__).resolve().parent.parent
D = 16
# model: (stored layers, n_layers, layer of the strongest signal, probes)
MODELS = {"toy-a": ([0, 2, 4, 6, 8], 8, 6, ("mean_diff", "samil")),
          "toy-b": ([0, 2, 4, 6], 6, 2, ("mean_diff",))}
TASKS = "[true_vs_all,false_vs_all,neither_vs_all,multiclass]"


def make_depth_store(store_dir: Path, model: str, layers: list[int], n_layers: int, peak: int,
                     n_real: int = 200, n_neither: int = 100, seed: int = 0) -> Path:
    """tests/test_train_probe.make_synthetic_store with more layers: a store for `model` (n_layers deep)
    of city_locations statements whose last two statement tokens carry a class direction of strength
    3 / (1 + |layer - peak|)."""
    table = load_statements("city_locations")
    table = table.iloc[np.r_[0:n_real, len(table) - n_neither:len(table)]].reset_index(drop=True)
    rng = np.random.default_rng(seed)
    lengths = rng.integers(4, 8, size=len(table))
    ids = [rng.integers(10, 500, size=n) for n in lengths]
    kinds = [np.r_[KIND_SPECIAL, np.full(n - 1, KIND_STATEMENT)].astype(np.int8) for n in lengths]
    path = store_dir / model / "city_locations.h5"
    create_store(path, table, ids, kinds, layers, D, "float32",
                 {"model_id": model, "model_fingerprint": "0", "n_layers": n_layers, "datapack": "city_locations"})
    ends = np.cumsum(lengths)
    with h5py.File(path, "r+") as f:
        for k in layers:
            x = rng.standard_normal((ends[-1], D)).astype(np.float32)
            for end, label in zip(ends, table["label"]):
                x[end - 2:end, label] += 3.0 / (1 + abs(k - peak))
            f[f"layers/{k}"][:] = x
        f.attrs["n_done"] = len(table)
    return path


def _cli(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "experiments.cross_model", f"results_dir={root / 'results'}",
                           f"reports_dir={root / 'reports'}", f"hydra.run.dir={root / 'logs'}", *args],
                          cwd=ROOT, capture_output=True, text=True, check=False)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    root = tmp_path_factory.mktemp("cross_model")
    for model, (layers, n_layers, peak, probes) in MODELS.items():
        make_depth_store(root / "activations", model, layers, n_layers, peak)
        run = partial(compose_config, "train_probe", f"model.name={model}", f"store_dir={root / 'activations'}",
                      f"results_dir={root / 'results'}", "n_boot=50", "layer=all", f"tasks={TASKS}")
        for probe in probes:
            train_probes(run(f"probe={probe}", *(["probe.C=10"] if probe == "samil" else [])))
    result = _cli(root, "models=[toy-a,toy-b]", "datapacks=[city_locations,med_indications]", "n_boot=50")
    assert result.returncode == 0, result.stderr[-2000:]
    claims = pd.read_csv(root / "reports" / "cross_model" / "claims.csv")
    return root, claims, result.stderr


def _cells(root: Path, model: str, probe: str, task: str) -> dict[int, dict]:
    folder = root / "results" / model / "city_locations" / probe / task / "entity_disjoint"
    return {int(p.parent.name.split("=")[1]): json.loads(p.read_text()) for p in folder.glob("layer=*/seed=0.json")}


def _best_calibration_layer(cells: dict[int, dict], layers) -> int:
    """The first of `layers` with the highest calibration MCC (experiments.report.best_layers' rule)."""
    layers = sorted(layers)
    scores = [cells[k]["calibration_metrics"]["mcc_all"] for k in layers]
    return layers[int(np.argmax(scores))]


def test_quarters_on_a_hand_example():
    depths = [0.0, 0.25, 0.2501, 0.5, 0.51, 0.75, 0.76, 1.0]
    assert depth_quarter(depths).tolist() == [1, 1, 2, 2, 3, 3, 4, 4]
    assert depth_quarter(np.array([0, 2, 4, 6, 8]) / 8).tolist() == [1, 1, 2, 3, 4]
    assert depth_quarter(np.array([0, 2, 4, 6]) / 6).tolist() == [1, 2, 3, 4]


def test_files_and_skipped_datapack(report):
    root, _, log = report
    out = root / "reports" / "cross_model"
    for name in ("depth_city_locations.png", "claims.csv", "claims.md"):
        assert (out / name).stat().st_size > 0
    assert not (out / "depth_med_indications.png").exists()
    assert "no cells for toy-b / med_indications" in log
    md = (out / "claims.md").read_text()
    assert all(f"## ({c})" in md for c in "abc") and "| toy-b | city_locations | mean_diff | multiclass |" in md


def test_depth_rows_quarters_and_summary(report):
    root, claims, _ = report
    depth = claims[claims["claim"] == "a"]
    expected = {(m, p, t) for m, (_, _, _, probes) in MODELS.items() for p in probes
                for t in TASKS.strip("[]").split(",")}
    assert set(zip(depth["model"], depth["probe"], depth["task"])) == expected and len(depth) == len(expected)
    for _, r in depth.iterrows():
        layers, n_layers, _, _ = MODELS[r["model"]]
        quarter = dict(zip(layers, depth_quarter(np.array(layers) / n_layers)))
        cells = _cells(root, r["model"], r["probe"], r["task"])
        assert r["n_layers"] == n_layers and r["layer"] == _best_calibration_layer(cells, layers)
        assert r["depth"] == pytest.approx(r["layer"] / n_layers)
        assert r["quarter"] == quarter[r["layer"]] and r["peak_in_q3"] == (r["quarter"] == 3)
        for q in range(1, 5):
            in_q = [k for k in layers if quarter[k] == q]
            chosen = _best_calibration_layer(cells, in_q)
            assert r[f"q{q}_layer"] == chosen
            assert r[f"q{q}_mcc"] == pytest.approx(cells[chosen]["metrics"]["mcc"])
            assert [r[f"q{q}_mcc_lo"], r[f"q{q}_mcc_hi"]] == pytest.approx(cells[chosen]["metrics"]["mcc_ci"])
        assert r["q3_vs_rest_mcc_lo"] <= r["q3_vs_rest_mcc"] + 1e-9 <= r["q3_vs_rest_mcc_hi"] + 2e-9
    summary = claims[claims["claim"] == "a_summary"].set_index("model")
    for model, g in depth.groupby("model"):
        assert summary.loc[model, "n_combinations"] == len(g)
        assert summary.loc[model, "n_peak_in_q3"] == g["peak_in_q3"].sum()
        assert summary.loc[model, "n_q3_better"] == (g["q3_vs_rest_mcc_lo"] > 0).sum()


def test_neither_shares_equal_a_direct_count(report):
    root, claims, _ = report
    neither = claims[claims["claim"] == "b"]
    assert len(neither) == sum(len(probes) for *_, probes in MODELS.values())
    for _, r in neither.iterrows():
        layers = MODELS[r["model"]][0]
        cells = _cells(root, r["model"], r["probe"], "multiclass")
        assert r["layer"] == _best_calibration_layer(cells, layers)
        test = cells[r["layer"]]["test"]
        pred = np.array(test["pred"])[np.array(test["y"]) == 2]
        wrong = np.isin(pred, [0, 1])
        assert r["n_neither"] == pred.size and r["n_abstained"] == np.sum(pred == -1)
        assert r["neither_recall"] == pytest.approx(np.mean(pred == 2))
        assert r["neither_abstained"] == pytest.approx(np.mean(pred == -1))
        if wrong.any():
            assert r["misclassified_as_false"] == pytest.approx(np.mean(pred[wrong] == 0))
            assert r["misclassified_as_true"] == pytest.approx(np.mean(pred[wrong] == 1))
        assert r["neither_recall_lo"] <= r["neither_recall"] <= r["neither_recall_hi"]
        binary = _cells(root, r["model"], r["probe"], "neither_vs_all")
        assert r["neither_vs_all_mcc"] == pytest.approx(binary[r["neither_vs_all_layer"]]["metrics"]["mcc"])


def test_samil_verdicts_follow_their_intervals(report):
    _, claims, _ = report
    samil = claims[claims["claim"] == "c"]
    # only toy-a has samil cells; mean_diff is its one single-instance rival here
    assert set(samil["model"]) == {"toy-a"} and set(samil["versus"]) == {"mean_diff"} and len(samil) == 4
    for _, r in samil.iterrows():
        for metric in ("mcc", "wmcc"):
            lo, hi = r[f"delta_{metric}_lo"], r[f"delta_{metric}_hi"]
            assert r[f"verdict_{metric}"] == verdict((lo, hi))
            assert (r[f"verdict_{metric}"] == "samil better") == (lo > 0)
            assert (r[f"verdict_{metric}"] == "samil worse") == (hi < 0)
    assert verdict((0.01, 0.2)) == "samil better" and verdict((-0.3, -0.01)) == "samil worse"
    assert verdict((-0.1, 0.1)) == "no significant difference"


def test_no_cells_is_one_line_error(tmp_path):
    result = _cli(tmp_path, "models=[nothing]", "datapacks=[city_locations]")
    errors = [line for line in result.stderr.splitlines() if "ERROR" in line]
    assert result.returncode == 1 and len(errors) == 1 and "no result cells" in errors[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr
