"""evaluation.metrics against independent computations (scikit-learn, loops by hand)."""

import json
import warnings

import numpy as np
import pytest
from sklearn.metrics import accuracy_score, matthews_corrcoef, roc_auc_score

from evaluation import metrics as M


def _sk_mcc(y_true, y_pred):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return matthews_corrcoef(y_true, y_pred)


def _random_labels(rng, n, k):
    """Labels with random (often very skewed) class frequencies."""
    w = rng.dirichlet(np.full(k, 0.3))
    return rng.choice(k, size=n, p=w)


# ------------------------------------------------------------------------- MCC
@pytest.mark.parametrize("k", [2, 3])
def test_mcc_matches_sklearn_random(k):
    rng = np.random.default_rng(k)
    for _ in range(100):
        n = int(rng.integers(1, 60))
        yt = _random_labels(rng, n, k)
        # predictions: noisy copies of the truth, or independent, or constant
        mode = rng.integers(3)
        if mode == 0:
            yp = np.where(rng.random(n) < 0.7, yt, rng.integers(0, k, n))
        elif mode == 1:
            yp = _random_labels(rng, n, k)
        else:
            yp = np.full(n, rng.integers(k))
        assert M.mcc(yt, yp) == pytest.approx(_sk_mcc(yt, yp), abs=1e-12)


def test_mcc_degenerate_cases():
    cases = [
        ([1, 1, 1], [1, 1, 1]),          # one class only, perfect
        ([1, 1, 1], [0, 1, 0]),          # constant truth
        ([0, 1, 2], [2, 2, 2]),          # constant prediction
        ([0], [0]),
        ([0], [1]),
        ([2, 2], [2, 2]),
        ([0, 1, 0, 1], [1, 0, 1, 0]),    # perfectly wrong: -1
        ([0, 1, 2, 0, 1, 2], [0, 1, 2, 0, 1, 2]),
        ([-1, 0, 1, -1], [0, 0, 1, -1]),  # arbitrary labels, as sklearn
    ]
    for yt, yp in cases:
        assert M.mcc(yt, yp) == pytest.approx(_sk_mcc(yt, yp), abs=1e-12), (yt, yp)
    assert M.mcc([], []) == 0.0
    assert M.mcc([0, 1, 0, 1], [1, 0, 1, 0]) == pytest.approx(-1.0)


def test_mcc_from_confusion_is_vectorised():
    rng = np.random.default_rng(0)
    tables = rng.integers(0, 20, size=(50, 3, 3))
    tables[0] = 0                       # empty table
    tables[1] = 0
    tables[1, :, 2] = 5                 # constant prediction
    batch = M.mcc_from_confusion(tables)
    assert batch.shape == (50,)
    for t, b in zip(tables, batch):
        yt = np.repeat(np.repeat(np.arange(3), 3), t.ravel())
        yp = np.repeat(np.tile(np.arange(3), 3), t.ravel())
        want = _sk_mcc(yt, yp) if yt.size else 0.0
        assert b == pytest.approx(want, abs=1e-12)


# ------------------------------------------------------------------ abstention
@pytest.mark.parametrize("k", [2, 3])
def test_wmcc_and_accuracy_on_accepted(k):
    rng = np.random.default_rng(10 + k)
    for _ in range(80):
        n = int(rng.integers(1, 80))
        yt = _random_labels(rng, n, k)
        yp = np.where(rng.random(n) < 0.75, yt, rng.integers(0, k, n))
        yp = np.where(rng.random(n) < rng.random(), -1, yp)
        acc = yp != -1
        n_abstained = int(np.sum(~acc))
        if acc.any():
            mcc_acc = _sk_mcc(yt[acc], yp[acc])
            want_acc = accuracy_score(yt[acc], yp[acc])
            assert M.accuracy(yt, yp) == pytest.approx(want_acc, abs=1e-12)
        else:
            mcc_acc = 0.0
            assert np.isnan(M.accuracy(yt, yp))
        assert M.abstain_mcc(yt, yp) == pytest.approx(mcc_acc, abs=1e-12)
        assert M.acceptance_rate(yp) == pytest.approx(1 - n_abstained / n)
        assert M.wmcc(yt, yp) == pytest.approx(mcc_acc * (1 - n_abstained / n), abs=1e-12)


def test_all_abstained():
    yt = np.array([0, 1, 2, 1])
    yp = np.full(4, -1)
    assert M.abstain_mcc(yt, yp) == 0.0
    assert M.wmcc(yt, yp) == 0.0
    assert M.acceptance_rate(yp) == 0.0
    probs = np.full((4, 3), 1 / 3)
    res = M.evaluate(yt, yp, probs, n_boot=200)
    assert res["mcc"] == 0.0 and res["wmcc"] == 0.0 and res["acceptance"] == 0.0
    assert res["accuracy"] is None
    assert res["mcc_ci"] == [0.0, 0.0] and res["wmcc_ci"] == [0.0, 0.0]
    json.dumps(res, allow_nan=False)


# ----------------------------------------------------------------------- AUROC
def test_auroc_binary_matches_sklearn_with_ties():
    rng = np.random.default_rng(1)
    for _ in range(60):
        n = int(rng.integers(2, 80))
        yt = rng.integers(0, 2, n)
        if yt.min() == yt.max():
            yt[0] = 1 - yt[0]
        s = yt * rng.random() + rng.normal(size=n)
        if rng.random() < 0.5:
            s = np.round(s, 1)  # many ties
        assert M.auroc(yt, s) == pytest.approx(roc_auc_score(yt, s), abs=1e-12)
        p = 1 / (1 + np.exp(-s))
        assert M.auroc(yt, M.as_probs(p)) == pytest.approx(roc_auc_score(yt, p), abs=1e-12)


def test_auroc_multiclass_matches_sklearn():
    rng = np.random.default_rng(2)
    for _ in range(40):
        n = int(rng.integers(6, 100))
        yt = rng.integers(0, 3, n)
        yt[:3] = [0, 1, 2]
        logits = rng.normal(size=(n, 3)) + 1.5 * rng.random() * np.eye(3)[yt]
        if rng.random() < 0.3:
            logits = np.round(logits, 1)
        p = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
        want = roc_auc_score(yt, p, multi_class="ovr", average="macro")
        assert M.auroc(yt, p) == pytest.approx(want, abs=1e-12)


def test_auroc_undefined_is_nan():
    assert np.isnan(M.auroc([1, 1, 1], [0.2, 0.3, 0.9]))
    assert np.isnan(M.auroc([2, 2, 2], np.eye(3)))
    # one class absent: macro over the scorable classes (sklearn would raise)
    yt = np.array([0, 0, 1, 1])
    p = np.array([[.8, .1, .1], [.6, .3, .1], [.2, .7, .1], [.4, .5, .1]])
    assert M.auroc(yt, p) == pytest.approx(
        np.mean([roc_auc_score(yt == 0, p[:, 0]), roc_auc_score(yt == 1, p[:, 1])]))


# ------------------------------------------------------------------------- ECE
def _ece_loop(yt, p, n_bins=10):
    p = np.asarray(p, float)
    if p.ndim == 1:
        conf = np.maximum(p, 1 - p)
        pred = (p > 0.5).astype(int)
    else:
        conf = p.max(1)
        pred = p.argmax(1)
    total = 0.0
    for b in range(n_bins):
        lo, hi = b / n_bins, (b + 1) / n_bins
        m = (conf > lo) & (conf <= hi) if b > 0 else (conf <= hi)
        if m.any():
            total += m.sum() / len(yt) * abs(np.mean(pred[m] == yt[m]) - conf[m].mean())
    return total


def test_ece_matches_loop():
    rng = np.random.default_rng(3)
    for _ in range(100):
        n = int(rng.integers(1, 200))
        yt = rng.integers(0, 3, n)
        logits = rng.normal(size=(n, 3)) * 2
        p = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
        assert M.ece(yt, p) == pytest.approx(_ece_loop(yt, p), abs=1e-12)
        yb = rng.integers(0, 2, n)
        pb = rng.random(n)
        assert M.ece(yb, pb) == pytest.approx(_ece_loop(yb, pb), abs=1e-12)
        assert M.ece(yb, pb) == pytest.approx(M.ece(yb, M.as_probs(pb)), abs=1e-12)


def test_ece_hand_example_and_calibrated():
    # two statements at confidence 0.9 (one right), one at 0.6 (right)
    yt = np.array([1, 0, 1])
    p = np.array([0.9, 0.9, 0.6])
    want = 2 / 3 * abs(0.5 - 0.9) + 1 / 3 * abs(1.0 - 0.6)
    assert M.ece(yt, p) == pytest.approx(want)
    rng = np.random.default_rng(4)
    p = rng.random(20000)
    y = (rng.random(20000) < p).astype(int)  # perfectly calibrated
    assert M.ece(y, p) < 0.02
    assert M.ece(1 - y, p) > 0.3


def test_raw_scores_rejected_for_probabilities():
    with pytest.raises(ValueError, match="probabilities"):
        M.evaluate([0, 1], None, np.array([-2.0, 3.0]))


# ------------------------------------------------------------------- coverage
def test_set_coverage_helpers():
    sets = np.array([[1, 0, 0], [1, 1, 0], [0, 0, 0], [0, 0, 1], [0, 1, 1]], bool)
    y = np.array([0, 1, 1, 0, 2])
    assert M.coverage(sets, y) == pytest.approx(3 / 5)
    pc = M.per_class_coverage(sets, y)
    assert pc[0] == pytest.approx(0.5) and pc[1] == pytest.approx(0.5) and pc[2] == 1.0
    assert M.mean_set_size(sets) == pytest.approx(6 / 5)
    assert np.isnan(M.per_class_coverage(sets[:2], y[:2])[2])


# ------------------------------------------------------------------ bootstrap
def _data(seed, n=2000, k=3, abstain=0.2):
    rng = np.random.default_rng(seed)
    yt = rng.integers(0, k, n)
    yp = np.where(rng.random(n) < 0.7, yt, rng.integers(0, k, n))
    yp = np.where(rng.random(n) < abstain, -1, yp)
    return yt, yp


def test_bootstrap_deterministic_and_contains_point():
    for k in (2, 3):
        for seed in range(5):
            yt, yp = _data(seed, n=500, k=k)
            a = M.bootstrap_ci(yt, yp, k, seed=seed)
            b = M.bootstrap_ci(yt, yp, k, seed=seed)
            c = M.bootstrap_ci(yt, yp, k, seed=seed + 100)
            assert a == b
            assert a != c
            lo, hi = a["mcc"]
            assert lo < M.abstain_mcc(yt, yp) < hi
            lo, hi = a["wmcc"]
            assert lo < M.wmcc(yt, yp) < hi


def test_bootstrap_agrees_with_naive_resampling():
    """The multinomial shortcut must match resampling statement indices."""
    yt, yp = _data(7, n=400, k=3, abstain=0.3)
    rng = np.random.default_rng(0)
    m, w = [], []
    for _ in range(1000):
        i = rng.integers(0, yt.size, yt.size)
        m.append(M.abstain_mcc(yt[i], yp[i]))
        w.append(M.wmcc(yt[i], yp[i]))
    ci = M.bootstrap_ci(yt, yp, 3, n_boot=4000, seed=1)
    for key, vals in (("mcc", m), ("wmcc", w)):
        want = np.percentile(vals, [2.5, 97.5])
        assert np.allclose(ci[key], want, atol=0.02), (key, ci[key], want)


def test_bootstrap_width_is_sane():
    yt, yp = _data(3, n=2000)
    ci = M.bootstrap_ci(yt, yp, 3)
    # MCC of ~0.8 on ~1600 statements: a standard error of roughly 0.01
    assert 0.02 < ci["mcc"][1] - ci["mcc"][0] < 0.08


def test_evaluate_keys_values_and_json():
    rng = np.random.default_rng(5)
    n = 2000
    yt = rng.integers(0, 3, n)
    logits = rng.normal(size=(n, 3)) + 2 * np.eye(3)[yt]
    p = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    sets = p >= 0.25
    from evaluation.conformal import prediction
    yp = prediction(sets)
    res = M.evaluate(yt, yp, p, sets=sets, seed=0, n_boot=1000)
    json.dumps(res, allow_nan=False)
    acc = yp != -1
    assert res["n"] == n and res["n_classes"] == 3 and res["n_accepted"] == acc.sum()
    assert res["mcc_all"] == pytest.approx(_sk_mcc(yt, p.argmax(1)), abs=1e-12)
    assert res["accuracy_all"] == pytest.approx(accuracy_score(yt, p.argmax(1)))
    assert res["mcc"] == pytest.approx(_sk_mcc(yt[acc], yp[acc]), abs=1e-12)
    assert res["wmcc"] == pytest.approx(res["mcc"] * acc.mean(), abs=1e-12)
    assert res["acceptance"] == pytest.approx(acc.mean())
    assert res["accuracy"] == pytest.approx(accuracy_score(yt[acc], yp[acc]))
    assert res["auroc"] == pytest.approx(roc_auc_score(yt, p, multi_class="ovr"), abs=1e-12)
    assert res["ece"] == pytest.approx(_ece_loop(yt, p), abs=1e-12)
    assert res["coverage"] == pytest.approx(sets[np.arange(n), yt].mean())
    assert len(res["per_class_coverage"]) == 3
    for key in ("mcc_all", "mcc", "wmcc"):
        lo, hi = res[key + "_ci"]
        assert lo <= res[key] <= hi
    assert res == M.evaluate(yt, yp, p, sets=sets, seed=0, n_boot=1000)


def test_evaluate_binary_from_positive_probability():
    rng = np.random.default_rng(6)
    n = 500
    yt = rng.integers(0, 2, n)
    p = 1 / (1 + np.exp(-(2 * yt - 1 + rng.normal(size=n))))
    res = M.evaluate(yt, None, p, n_boot=200)
    assert res["n_classes"] == 2 and res["acceptance"] == 1.0
    assert res["mcc_all"] == pytest.approx(_sk_mcc(yt, p > 0.5), abs=1e-12)
    assert res["mcc"] == res["mcc_all"] == res["wmcc"]
    assert res["auroc"] == pytest.approx(roc_auc_score(yt, p), abs=1e-12)
    assert res["coverage"] is None
    res2 = M.evaluate(yt, None, M.as_probs(p), n_boot=200)
    assert res2 == res
