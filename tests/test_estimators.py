"""Probes are scikit-learn estimators on arrays: clone, cross_val_score, GridSearchCV, Pipeline,
OneVsRestClassifier, and sklearn's own estimator checks (each expected failure listed with its reason)."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from sklearn.base import clone
from sklearn.exceptions import NotFittedError
from sklearn.metrics import matthews_corrcoef
from sklearn.model_selection import GridSearchCV, cross_val_score
from sklearn.multiclass import OneVsRestClassifier
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from sklearn.utils.estimator_checks import parametrize_with_checks
from threadpoolctl import threadpool_limits

from probes import (CCSProbe, FittedProbe, LinearProbe, MeanDiffProbe, MLPProbe, SAwMILProbe, SupervisedPCAProbe,
                    TTPDProbe, fit_probe)
from probes.base import ProbeError
from probes.features import Features
from probes.samil import make_planted_bags


def _separable(n=240, d=12, seed=0, classes=("false", "true")):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, d)).astype(np.float32)
    w = rng.standard_normal(d)
    return X, np.asarray(classes)[(X @ w > 0).astype(int)]


def test_clone_keeps_the_arguments_and_drops_the_fit():
    probe = LinearProbe(C=1, Cs=[0.1, 1], seed=0, accelerator="cpu")
    assert probe.get_params()["C"] == 1 and probe.get_params()["Cs"] == (0.1, 1)
    X, y = _separable()
    copy = clone(probe.fit(X, y))
    assert copy.get_params() == probe.get_params()
    with pytest.raises(NotFittedError):
        copy.predict(X)
    assert probe.n_features_in_ == X.shape[1] and list(probe.classes_) == ["false", "true"]
    assert not hasattr(copy, "n_features_in_")


def test_predict_score_and_proba_on_numpy_and_torch():
    X, y = _separable()
    probe = LinearProbe(seed=0, accelerator="cpu").fit(torch.from_numpy(X), y)
    pred = probe.predict(X)
    assert set(pred) <= {"false", "true"} and np.mean(pred == y) > 0.95
    assert isinstance(probe.score(X, y), float) and probe.score(X, y) == matthews_corrcoef(y, pred)
    proba = probe.predict_proba(X)
    np.testing.assert_allclose(proba.sum(1), 1.0)
    np.testing.assert_array_equal(proba.argmax(1), (probe.decision_function(X) > 0).astype(int))
    with pytest.raises(ProbeError, match="X has 5 features, but LinearProbe is expecting 12"):
        probe.predict(X[:, :5])


def test_array_fit_equals_the_pipeline_fit():
    """fit(ndarray, y) and the pipeline's fit(Features, 0/1 targets, folds) give the same probe."""
    X, y = _separable()
    target = (y == "true").astype(np.int64)
    folds = [(np.arange(0, 240, 2), np.arange(1, 240, 2)), (np.arange(1, 240, 2), np.arange(0, 240, 2))]
    internal = LinearProbe(seed=0, accelerator="cpu").fit(Features(torch.from_numpy(X)), target, folds=folds)
    array = LinearProbe(seed=0, accelerator="cpu").fit(X, y, folds=folds)
    np.testing.assert_array_equal(internal.decision_function(X), array.decision_function(X))
    assert internal.params() == array.params() and internal.held_out_scores_ is not None


def test_cross_val_score_grid_search_and_pipeline():
    X, y = _separable()
    scores = cross_val_score(LinearProbe(seed=0, accelerator="cpu"), X, y, cv=5)
    assert scores.shape == (5,) and scores.mean() > 0.85            # MCC on each held-out fold
    search = GridSearchCV(LinearProbe(seed=0, accelerator="cpu"), {"C": [1e-4, 1.0]}, cv=3).fit(X, y)
    assert search.best_params_ == {"C": 1.0} and search.best_score_ > 0.85
    pipe = make_pipeline(StandardScaler(), MeanDiffProbe(accelerator="cpu")).fit(X, y)
    assert pipe.score(X, y) > 0.85
    with pytest.raises(ProbeError, match="cv_metric"):
        LinearProbe(accelerator="cpu").set_params(cv_metric="auc").fit(X, y)   # set_params is checked at fit


def test_binary_heads_and_one_vs_rest():
    X, y = _separable(n=300)
    X[:100] += 6.0
    y3 = np.where(np.arange(300) < 100, "neither", y)
    with pytest.raises(ValueError, match="Only binary classification is supported"):
        MeanDiffProbe(accelerator="cpu").fit(X, y3)
    ovr = OneVsRestClassifier(MeanDiffProbe(accelerator="cpu")).fit(X, y3)
    assert len(ovr.estimators_) == 3 and np.mean(ovr.predict(X) == y3) > 0.85


def test_samil_fits_a_list_of_bags():
    X, offsets, y, _, _ = make_planted_bags(60, 8, shift=6.0, seed=0)
    bags = [X[a:b] for a, b in zip(offsets[:-1], offsets[1:])]
    by_list = SAwMILProbe(C=10.0, accelerator="cpu").fit(bags, y)
    by_offsets = SAwMILProbe(C=10.0, accelerator="cpu").fit((X, offsets), y)
    np.testing.assert_array_equal(by_list.decision_function(bags), by_offsets.decision_function((X, offsets)))
    assert by_list.score(bags, y) > 0.8
    with pytest.raises(ProbeError, match="reads token bags"):
        by_list.predict(X)


def test_fitted_probe_predicts_labels_and_abstains_apart():
    X, y = _separable(n=300, classes=(0, 1))
    spec = {"name": "mean_diff", "_target_": "probes.mean_diff.MeanDiffProbe"}
    probe = fit_probe(spec, X, y, np.arange(200), np.arange(200, 300), alpha=0.02, accelerator="cpu")
    pred, abstain = probe.predict(X), probe.predict_with_abstention(X)
    assert set(pred) <= {0, 1} and -1 in abstain
    np.testing.assert_array_equal(pred[abstain >= 0], abstain[abstain >= 0])
    assert probe.score(X, y) == matthews_corrcoef(y, pred) > 0.8
    copy = clone(probe)
    assert isinstance(copy, FittedProbe) and copy is not probe and copy.fit(X, y) is copy
    np.testing.assert_array_equal(copy.predict_proba(X), probe.predict_proba(X))
    assert list(probe.classes_) == [0, 1] and probe.n_features_in_ == X.shape[1]


def test_package_level_names_and_a_light_extract_import():
    from extract import open_store
    from probes import load_probe
    assert callable(open_store) and callable(load_probe)
    code = "import sys, extract; assert 'torch' not in sys.modules and 'h5py' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# sklearn's estimator checks. Expected failures, each for a reason that is part of the design:
_LIGHTNING = "a LightningModule: nn.Module and Lightning set `training`, `prepare_data_per_node`, ... in __init__"
_COMMON = {
    "check_no_attributes_set_in_init": _LIGHTNING,
    "check_do_not_raise_errors_in_init_or_set_params": "options are checked at construction (and again at fit), so "
                                                      "a bad probe config fails in one line before any data is read",
}
_CLASS_WEIGHT = {"check_class_weight_classifiers": "class_weight is 'balanced' or None (no per-class dict)"}
EXPECTED_FAILURES = {
    "LinearProbe": {**_COMMON, **_CLASS_WEIGHT},   # (at one thread a batch and its subset score alike)
    "MLPProbe": {**_COMMON, **_CLASS_WEIGHT, "check_no_attributes_set_in_init": _LIGHTNING + " and `net`",
                 "check_dont_overwrite_parameters": "fit leaves the network in eval mode (nn.Module's `training`)"},
    "MeanDiffProbe": _COMMON,
    "SupervisedPCAProbe": _COMMON,
    "PolarityTTPD": _COMMON,
    "PairedCCS": {**_COMMON,
                  "check_classifiers_train": "unsupervised: the check's rows paired by position (0 with 1, 2 with 3, ...) "
                                             "are no statement / negation pairs, so the direction found need not follow y",
                  "check_positive_only_tag_during_fit": "the check's labels put both rows of every position pair in one "
                                                        "class, which CCS refuses (no contrast: use true_vs_false)"},
}


def _with_polarity(data: Features) -> Features:
    """sklearn's checks pass X and y only: rows 2i and 2i+1 become an affirmative statement and its negation."""
    rows = np.arange(len(data))
    return Features(data.X, data.offsets, data.groups, rows % 2 == 1, rows // 2)


class PolarityTTPD(TTPDProbe):
    """TTPD on arrays, each row given a polarity by its position (`_with_polarity`)."""

    def _features(self, X, width=None):
        return _with_polarity(super()._features(X, width))


class PairedCCS(CCSProbe):
    """CCS on arrays, its training rows paired by position (`_with_polarity`); rows scored without a polarity."""

    def _features(self, X, width=None):
        data = super()._features(X, width)
        return _with_polarity(data) if width is None else data


@parametrize_with_checks([LinearProbe(seed=0, accelerator="cpu"), MeanDiffProbe(accelerator="cpu"),
                          MLPProbe(max_epochs=5, seed=0, accelerator="cpu"),
                          SupervisedPCAProbe(seed=0, accelerator="cpu"), PolarityTTPD(accelerator="cpu"),
                          PairedCCS(epochs=100, seed=0, accelerator="cpu")],
                         expected_failed_checks=lambda est: EXPECTED_FAILURES[type(est).__name__], xfail_strict=True)
def test_sklearn_estimator_checks(estimator, check):
    """At one thread: several checks compare float32 scores of a subset with the same rows scored in a
    batch (to 1e-7), which a multi-threaded reduction on a loaded machine does not always reproduce."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with threadpool_limits(1):
            check(estimator)
    finally:
        torch.set_num_threads(threads)
