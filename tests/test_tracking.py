"""Result cells in MLflow and TensorBoard (evaluation.tracking): a sweep with tracker=mlflow (two workers writing
into one store) leaves one MLflow run per cell whose params and metrics are the cell's, read back with MLflow's
own client; tracker=tensorboard leaves each cell's metrics as scalars by layer, read back with TensorBoard's event
reader; a missing package or an unknown tracker is one line before any work; the tracker options do not change
what a cell is (a rerun without them keeps the cells)."""
from __future__ import annotations

import json
import sys

import pytest

from evaluation.tracking import TrackerError, cell_record
from experiments.sweep import sweep
from toolkit.config import compose_config
from probes.pipeline import train_probes
from tests.helpers import make_synthetic_store

mlflow = pytest.importorskip("mlflow", reason="MLflow is not installed (the test extra installs it)")


def _cells(results):
    return sorted(p for p in results.rglob("seed=*.json"))


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("tracking")
    make_synthetic_store(root / "activations", n_real=300, n_neither=150)
    return root


def test_a_sweep_logs_one_mlflow_run_per_cell_with_the_cells_numbers(store, tmp_path):
    results, runs = tmp_path / "results", tmp_path / "mlruns"
    status = sweep(["probes=[linear,mean_diff]", "workers=2", "model.name=synthetic", f"store_dir={store / 'activations'}",
                    f"results_dir={results}", "n_boot=20", "tasks=[true_vs_all,multiclass]", "tracker=mlflow",
                    f"tracker_dir={runs}"])
    assert status == 0
    cells = _cells(results)
    assert len(cells) == 2 * 2 * 2     # probes x layers x tasks
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{runs / 'mlflow.db'}")
    experiments = client.search_experiments()
    logged = {r.data.tags["cell"]: r for e in experiments for r in client.search_runs([e.experiment_id])}
    assert sorted(logged) == [str(c) for c in cells]        # one run per cell, no more
    for path in cells:
        cell = json.loads(path.read_text())
        experiment, name, params, metrics = cell_record(cell)
        run = logged[str(path)]
        assert run.info.run_name == name and client.get_experiment(run.info.experiment_id).name == experiment
        assert run.data.params == {k: str(v) for k, v in params.items()}
        assert run.data.metrics == pytest.approx(metrics, rel=0, abs=0)
        for key in ("mcc", "wmcc", "auroc", "acceptance", "aurc", "ece"):
            assert run.data.metrics[key] == cell["metrics"][key]
        assert run.data.metrics["mcc_ci_low"] == cell["metrics"]["mcc_ci"][0]
        history = client.get_metric_history(run.info.run_id, "mcc")
        assert [m.step for m in history] == [cell["layer"]]
        artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
        assert path.name in artifacts and any(a.endswith(".probe.safetensors") for a in artifacts)
    # the options say where a run is logged, not what a cell is: a rerun without them keeps every cell
    before = {p: p.stat().st_mtime_ns for p in cells}
    assert sweep(["probes=[linear,mean_diff]", "workers=1", "model.name=synthetic", f"store_dir={store / 'activations'}",
                  f"results_dir={results}", "n_boot=20", "tasks=[true_vs_all,multiclass]"]) == 0
    assert {p: p.stat().st_mtime_ns for p in _cells(results)} == before


def test_tensorboard_holds_each_cells_metrics_by_layer(store, tmp_path):
    pytest.importorskip("tensorboard", reason="TensorBoard is not installed (the test extra installs it)")
    from tensorboard.backend.event_processing import event_accumulator

    results = tmp_path / "results"
    cells = train_probes(compose_config("train_probe", "model.name=synthetic", f"store_dir={store / 'activations'}",
                                        f"results_dir={results}", "n_boot=20", "layer=all", "probe=linear",
                                        "task=true_vs_all", "tracker=tensorboard"))
    events = event_accumulator.EventAccumulator(str(tmp_path / "tensorboard"),
                                                size_guidance={event_accumulator.SCALARS: 0})
    events.Reload()
    for key in ("mcc", "auroc", "acceptance", "mcc_ci_low"):
        series = events.Scalars(f"synthetic/city_locations/linear/true_vs_all/{key}")
        by_layer = {e.step: e.value for e in series}
        want = {}
        for path in cells:
            cell = json.loads(path.read_text())
            want[cell["layer"]] = cell_record(cell)[3][key]
        assert by_layer == pytest.approx(want, rel=1e-6)     # (TensorBoard stores float32)


def test_a_missing_package_or_unknown_tracker_is_one_line_before_any_work(store, tmp_path, monkeypatch):
    run = ["model.name=synthetic", f"store_dir={store / 'activations'}", f"results_dir={tmp_path / 'results'}",
           "probe=linear", "layer=1"]
    with pytest.raises(Exception, match=r"tracker='wandb': give one of mlflow, tensorboard|tracker.*wandb"):
        train_probes(compose_config("train_probe", *run, "tracker=wandb"))
    monkeypatch.setitem(sys.modules, "mlflow", None)     # as if not installed
    with pytest.raises(TrackerError, match=r"tracker=mlflow needs the mlflow package.*pip install mlflow"):
        train_probes(compose_config("train_probe", *run, "tracker=mlflow"))
    assert not (tmp_path / "results").exists() or not _cells(tmp_path / "results")
