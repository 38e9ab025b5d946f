"""Score -> probability map (evaluation/calibration.py) inside task_cell (probes/pipeline.py):
out-of-fold vs in-sample map, scale-free map and rank-based AUROC, degenerate / one-label flags,
and the non-default procedures' cell folders."""
from __future__ import annotations

import json
import warnings

import h5py
import numpy as np
import pytest

from evaluation.calibration import ScoreMap
from evaluation.splits import entity_groups, make_split
from evaluation.tasks import task_targets
from extract.store import ActivationStore, store_path
from probes.features import layer_features
from probes.mean_diff import MeanDiffProbe
from probes.fitting import HeadBank
from probes.pipeline import degenerate_reasons, grid_edge, task_cell, train_probes
from tests.helpers import make_synthetic_store, probe_config


def _weaken(path, strength: float, seed: int = 1) -> None:
    """Replace layer 1 by fresh noise plus a planted class direction of `strength` on the last two
    statement tokens (make_synthetic_store plants 5.0: too easy for calibration to matter)."""
    with h5py.File(path, "r+") as f:
        offsets, labels = f["tokens/offsets"][:], f["statements/label"][:]
        X = np.random.default_rng(seed).standard_normal(f["layers/1"].shape).astype(np.float32)
        for i, label in enumerate(labels):
            X[offsets[i + 1] - 2:offsets[i + 1], label] += strength
        f["layers/1"][:] = X


@pytest.fixture(scope="module")
def weak_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("weak")
    _weaken(make_synthetic_store(root / "activations"), 1.0)
    return root


def _cfg(dirs, *overrides):
    return probe_config("model.name=synthetic", f"store_dir={dirs / 'activations'}", f"results_dir={dirs / 'results'}",
                        "layer=1", "n_boot=20", *overrides)


def _run(dirs, *overrides) -> dict:
    [path] = train_probes(_cfg(dirs, *overrides))
    return json.loads(path.read_text())


def _record(record_property, name, value):
    print(f"\n{name}: {value}")
    record_property(name, value)
    warnings.warn(f"{name}: {value}", UserWarning, stacklevel=2)


def test_out_of_fold_map_lowers_test_ece(weak_dirs, record_property):
    """The in-sample map is fitted on scores of a probe fitted on the same rows (over-confident);
    the out-of-fold map is not. Measured direction on a weakly planted store, every probe."""
    eces = {}
    for probe in ("linear", "mean_diff", "mlp"):
        for calibration in ("in_sample", "out_of_fold_cv"):
            cell = _run(weak_dirs, f"probe={probe}", f"calibration={calibration}")
            eces[probe, calibration] = cell["metrics"]["ece"]
            assert cell["calibration"]["kind"] == calibration
            assert cell["calibration"]["n_folds"] == (3 if calibration == "out_of_fold_cv" else 0)
            assert cell["method"]["name"] == (probe if calibration == "out_of_fold_cv" else f"{probe}+in_sample")
            assert cell["config"]["probe"]["name"] == cell["method"]["name"]   # what the report groups by
    _record(record_property, "test_ece", ", ".join(f"{p} {c} {e:.4f}" for (p, c), e in eces.items()))
    for probe in ("linear", "mean_diff", "mlp"):
        assert eces[probe, "out_of_fold_cv"] < eces[probe, "in_sample"]


def _inputs(dirs, task="true_vs_all"):
    """What train_probes hands task_cell for one layer (features, targets, split positions)."""
    cfg = _cfg(dirs, f"task={task}", "probe=mean_diff")
    store = ActivationStore(store_path(cfg.store_dir, "synthetic", "city_locations"))
    table = store.table
    rows, y = task_targets(table["label"].to_numpy(), task)
    split = make_split(table, **cfg.split)
    parts = {name: np.flatnonzero(np.isin(rows, getattr(split, name))) for name in ("train", "calibration", "test")}
    features = layer_features(store, 1, "last").subset(rows)
    features.groups = entity_groups(table)[rows]
    return cfg, features, y, parts


def fit_and_evaluate(cfg, template, features, y, parts):
    """task_cell of one probe at one layer on its own bank (out-of-fold folds shared, as train_probes)."""
    bank = HeadBank(template, features, y, parts["train"], cfg.calibration_folds, cfg.seed, True)
    return task_cell(cfg, cfg.task.name, bank, y, parts, [1] if y.max() == 1 else [0, 1, 2])


class Scaled(MeanDiffProbe):
    """mean_diff with its scores multiplied by 1e-7 (a monotone rescaling)."""

    def decision_function(self, data):
        return super().decision_function(data) * 1e-7


class Constant(MeanDiffProbe):
    """A degenerate probe: every statement scores 0."""

    def decision_function(self, data):
        return np.zeros(len(data))


@pytest.mark.parametrize("task", ["true_vs_all", "multiclass"])
def test_auroc_and_map_unchanged_by_scores_times_1e7(weak_dirs, task):
    cfg, features, y, parts = _inputs(weak_dirs, task)
    plain, _ = fit_and_evaluate(cfg, MeanDiffProbe(), features, y, parts)
    scaled, _ = fit_and_evaluate(cfg, Scaled(), features, y, parts)
    assert scaled["metrics"]["auroc"] == plain["metrics"]["auroc"]   # from the raw scores' ranks
    assert 0.6 < plain["metrics"]["auroc"] < 1.0
    np.testing.assert_allclose(scaled["test"]["probs"], plain["test"]["probs"], atol=1e-6)
    assert scaled["test"]["pred"] == plain["test"]["pred"]
    assert scaled["metrics"]["ece"] == pytest.approx(plain["metrics"]["ece"], abs=1e-6)
    assert not plain["degenerate"] and not scaled["degenerate"]


def test_score_map_standardises():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 400)
    s = (2 * y - 1 + rng.normal(size=400))[:, None]
    a = ScoreMap().fit(s, y).predict_proba(s)
    b = ScoreMap().fit(s * 1e-7 + 3.0, y).predict_proba(s * 1e-7 + 3.0)
    np.testing.assert_allclose(a, b, atol=1e-8)
    assert a[:, 1].std() > 0.1                                        # not one constant probability
    assert json.loads(json.dumps(ScoreMap().fit(s, y).to_dict()))["scale"][0] > 0


def test_degenerate_and_one_label_fits_are_flagged(weak_dirs):
    cfg, features, y, parts = _inputs(weak_dirs)
    cell, _ = fit_and_evaluate(cfg, Constant(), features, y, parts)
    m = cell["metrics"]
    assert cell["degenerate"] is True
    assert m["auroc"] == 0.5
    assert sum(m["accepted_per_label"].values()) == m["n_accepted"]
    # constant probabilities: every set is the same, so at most one label is ever accepted
    assert m["n_accepted"] == 0 or m["single_label_accepted"]
    assert "constant_scores" in cell["degenerate_reasons"]
    assert ("single_label_accepted" in cell["degenerate_reasons"]) == m["single_label_accepted"]


def test_one_label_and_grid_edge_fits_are_flagged(weak_dirs, caplog):
    """A fit whose sets accept one label only, or whose C by CV sits on the grid's edge, is degenerate
    (with the reason, and one warning line: the grid's edge is named as such, not as a constant probe),
    although its weights are not zero."""
    assert degenerate_reasons({"1": {"C": 1.0}}, np.array([[0.0], [1.0]]), {"single_label_accepted": True}) \
        == ["single_label_accepted"]
    assert degenerate_reasons({"1": {"C": 1.0}}, np.array([[0.0], [1.0]]), {"single_label_accepted": False}) == []
    with caplog.at_level("WARNING"):
        cell = _run(weak_dirs, "probe=linear", "probe.Cs=[0.001,0.01]", "probe.C_limits=[0.001,0.01]",
                    "overwrite=true")   # the grid may not be extended beyond its bound
    edge = "lower" if cell["probe_params"]["1"]["C"] == 0.001 else "upper"
    assert cell["degenerate"] is True and f"C_at_grid_edge:{edge}" in cell["degenerate_reasons"]
    messages = [r.getMessage() for r in caplog.records]
    assert any("end of its grid" in m and "C_at_grid_edge" in m for m in messages)
    assert not any("degenerate fit" in m and "C_at_grid_edge" in m for m in messages)   # (not "a constant")
    cv = {"Cs": [0.1, 1.0, 10.0], "cv_loss": [0.5, 0.4, 0.6]}
    assert [grid_edge({**cv, "C": c}) for c in (0.1, 1.0, 10.0)] == ["lower", None, "upper"]
    assert grid_edge({"Cs": [0.1, 10.0], "C": 10.0, "cv_auroc": {}}) is None   # no folds: C not chosen by CV
    fixed = _run(weak_dirs, "probe=linear", "probe.C=0.001", "overwrite=true")   # no CV: no grid edge
    assert not any(r.startswith("C_at_grid_edge") for r in fixed["degenerate_reasons"])


def test_reference_conformal_cells(weak_dirs):
    cell = _run(weak_dirs, "probe=mean_diff", "conformal=reference")
    assert cell["method"]["name"] == "mean_diff+reference"
    assert cell["conformal"]["nonconformity"] == "symmetric" and cell["conformal"]["tie_breaking"] is False
    # exp(-(2y-1) f) on the raw scores: the set of a statement depends on its score only through f
    f = np.array(cell["test"]["scores"])[:, 0]
    sets = np.array(cell["test"]["sets"], bool)
    order = np.argsort(f)
    assert (np.diff(sets[order, 1].astype(int)) >= 0).all()           # label 1 enters as f grows
    assert (np.diff(sets[order, 0].astype(int)) <= 0).all()           # label 0 leaves
    multi = _run(weak_dirs, "probe=mean_diff", "conformal=reference", "task=multiclass")
    assert multi["conformal"]["nonconformity"] == "margin" and multi["conformal"]["n_classes"] == 3
    with pytest.raises(ValueError, match="mondrian"):
        train_probes(_cfg(weak_dirs, "conformal=reference", "mondrian=true"))
    with pytest.raises(ValueError, match="calibration.*'sometimes'"):
        train_probes(_cfg(weak_dirs, "calibration=sometimes"))
