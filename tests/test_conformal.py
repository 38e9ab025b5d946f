"""evaluation.conformal: coverage on synthetic data, thresholds, abstention, errors."""

import json
import math

import numpy as np
import pytest

from evaluation.conformal import (
    ConformalClassifier,
    ReferenceConformal,
    acceptance_by_label,
    binary_probs,
    conformal_threshold,
    prediction,
)


def _softmax(z):
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def _synthetic(seed, n, k, hard_class=None):
    """Overlapping classes: probabilities = softmax of noisy one-hot logits."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, k, n)
    signal = np.full(n, 1.5)
    if hard_class is not None:
        signal[y == hard_class] = 0.3
    logits = signal[:, None] * np.eye(k)[y] + rng.normal(size=(n, k))
    return _softmax(logits), y


def _coverage(sets, y):
    return sets[np.arange(len(y)), y].mean()


SEEDS = range(5)
ALPHAS = (0.05, 0.1, 0.2)


@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("mondrian", [False, True])
@pytest.mark.parametrize("alpha", ALPHAS)
def test_coverage_synthetic(k, mondrian, alpha):
    # Coverage given one calibration split is random: sd ~ sqrt(a(1-a)(1/n_cal + 1/n_test))
    # (0.013 at alpha=0.2), so one seed is held to max(0.03, 4 sd) and the mean of the
    # seeds to 0.02 (its sd is 0.006 at alpha=0.2).
    sd = math.sqrt(alpha * (1 - alpha) * (1 / 2000 + 1 / 2000))
    per_class, covs = [], []
    for seed in SEEDS:
        p_cal, y_cal = _synthetic(seed, 2000, k)
        p_te, y_te = _synthetic(seed + 1000, 2000, k)
        cp = ConformalClassifier().fit(p_cal, y_cal, alpha=alpha, mondrian=mondrian)
        sets = cp.predict_sets(p_te)
        cov = _coverage(sets, y_te)
        assert abs(cov - (1 - alpha)) <= max(0.03, 4 * sd), (seed, cov)
        covs.append(cov)
        # sets are informative, not trivially full
        assert sets.sum(1).mean() < k
        rep = cp.report(p_te, y_te)
        assert rep["coverage"] == pytest.approx(cov)
        per_class.append(rep["per_class_coverage"])
        if mondrian:
            for c in range(k):
                m = y_te == c
                n_c = m.sum()
                # ~667 test and ~667 calibration statements per class: 4 sigma
                sigma = math.sqrt(alpha * (1 - alpha) * 2 / n_c)
                assert abs(_coverage(sets[m], y_te[m]) - (1 - alpha)) <= 4 * sigma
    assert abs(np.mean(covs) - (1 - alpha)) <= 0.02, covs
    if mondrian:
        mean_pc = np.mean(per_class, axis=0)
        assert np.all(np.abs(mean_pc - (1 - alpha)) <= 0.03), mean_pc


def test_mondrian_fixes_undercovered_class():
    """A hard class is under-covered by marginal sets, not by Mondrian sets."""
    alpha = 0.1
    p_cal, y_cal = _synthetic(11, 3000, 3, hard_class=2)
    p_te, y_te = _synthetic(12, 3000, 3, hard_class=2)
    marg = ConformalClassifier().fit(p_cal, y_cal, alpha=alpha).report(p_te, y_te)
    mond = ConformalClassifier().fit(p_cal, y_cal, alpha=alpha, mondrian=True).report(p_te, y_te)
    assert marg["per_class_coverage"][2] < 1 - alpha - 0.05
    assert abs(mond["per_class_coverage"][2] - (1 - alpha)) <= 0.04
    assert abs(marg["coverage"] - (1 - alpha)) <= 0.03


def test_threshold_is_finite_sample_order_statistic():
    rng = np.random.default_rng(0)
    for n in (9, 10, 37, 100, 2000):
        for alpha in (0.05, 0.1, 0.2, 0.5):
            if (n + 1) * (1 - alpha) > n:
                continue
            s = rng.random(n)
            q = conformal_threshold(s, alpha)
            # smallest calibration score t with #{s <= t} >= (1 - alpha)(n + 1)
            srt = np.sort(s)
            want = next(t for i, t in enumerate(srt) if i + 1 >= (1 - alpha) * (n + 1) - 1e-9)
            assert q == want
            assert q == np.quantile(s, math.ceil((n + 1) * (1 - alpha) - 1e-9) / n,
                                    method="inverted_cdf")


@pytest.mark.parametrize("mondrian", [False, True])
def test_sets_match_conformal_p_value_rule(mondrian):
    """Label y is in the set iff its conformal p-value exceeds alpha (independent rule)."""
    alpha = 0.1
    p_cal, y_cal = _synthetic(3, 300, 3)
    p_te, _ = _synthetic(4, 200, 3)
    sets = ConformalClassifier().fit(p_cal, y_cal, alpha=alpha, mondrian=mondrian).predict_sets(p_te)
    cal_scores = 1 - p_cal[np.arange(len(y_cal)), y_cal]
    want = np.zeros_like(sets)
    for i in range(len(p_te)):
        for y in range(3):
            ref = cal_scores[y_cal == y] if mondrian else cal_scores
            s = 1 - p_te[i, y]
            p_val = (np.sum(ref >= s) + 1) / (len(ref) + 1)
            want[i, y] = p_val > alpha
    assert np.array_equal(sets, want)


def test_prediction_abstains_on_empty_and_ambiguous_sets():
    sets = np.array([[1, 0, 0], [0, 0, 1], [1, 1, 0], [0, 0, 0], [1, 1, 1], [0, 1, 0]], bool)
    assert prediction(sets).tolist() == [0, 2, -1, -1, -1, 1]
    assert prediction(np.array([[0, 1], [1, 1], [0, 0]], bool)).tolist() == [1, -1, -1]


def test_binary_probs_and_binary_probe():
    p = np.array([0.1, 0.5, 0.97])
    assert np.allclose(binary_probs(p), [[0.9, 0.1], [0.5, 0.5], [0.03, 0.97]])
    rng = np.random.default_rng(5)
    y = rng.integers(0, 2, 1000)
    p_pos = 1 / (1 + np.exp(-(3 * (2 * y - 1) + rng.normal(size=1000) * 2)))
    cp = ConformalClassifier().fit(binary_probs(p_pos[:500]), y[:500], alpha=0.1)
    y_hat = cp.predict(binary_probs(p_pos[500:]))
    assert set(np.unique(y_hat)) <= {-1, 0, 1}
    acc = y_hat != -1
    assert 0 < acc.mean() < 1
    # accepted predictions agree with the thresholded probability
    assert np.array_equal(y_hat[acc], (p_pos[500:][acc] > 0.5).astype(int))


@pytest.mark.parametrize("n, alpha, need", [(8, 0.1, 9), (18, 0.05, 19), (3, 0.2, 4), (0, 0.1, 9)])
def test_too_small_calibration_raises_one_line(n, alpha, need):
    p, y = _synthetic(0, n, 3)
    with pytest.raises(ValueError) as err:
        ConformalClassifier().fit(p, y, alpha=alpha)
    msg = str(err.value)
    assert "\n" not in msg
    assert f"has {n} statements" in msg and f"at least {need}" in msg
    assert "enlarge the calibration split" in msg and "lower alpha" not in msg    # lowering alpha raises the need
    if n:
        higher = float(msg.split("raise alpha to at least ")[1].split()[0])
        ConformalClassifier().fit(*_synthetic(0, n, 3), alpha=higher)            # the advice works
    # exactly the minimum size works
    p, y = _synthetic(0, need, 3)
    ConformalClassifier().fit(p, y, alpha=alpha)


def test_too_small_class_raises_in_mondrian_mode():
    p, y = _synthetic(0, 60, 3)
    y[y == 2] = 0
    y[:5] = 2  # only 5 "neither" statements
    ConformalClassifier().fit(p, y, alpha=0.1)  # marginal mode is fine
    with pytest.raises(ValueError, match=r"class 2 \(neither\) has 5 statements.*at least 9") as err:
        ConformalClassifier().fit(p, y, alpha=0.1, mondrian=True)
    assert "\n" not in str(err.value)


def test_to_dict_json_roundtrip():
    p_cal, y_cal = _synthetic(0, 500, 3)
    p_te, _ = _synthetic(1, 100, 3)
    for mondrian in (False, True):
        cp = ConformalClassifier().fit(p_cal, y_cal, alpha=0.1, mondrian=mondrian)
        d = json.loads(json.dumps(cp.to_dict(), allow_nan=False))
        assert d["alpha"] == 0.1 and d["mondrian"] is mondrian and len(d["thresholds"]) == 3
        assert sum(d["n_cal_per_class"]) == d["n_cal"] == 500
        if not mondrian:
            assert len(set(d["thresholds"])) == 1
        cp2 = ConformalClassifier.from_dict(d)
        assert np.array_equal(cp2.predict_sets(p_te), cp.predict_sets(p_te))


def test_input_validation():
    cp = ConformalClassifier()
    with pytest.raises(RuntimeError):
        cp.predict_sets(np.full((2, 3), 1 / 3))
    with pytest.raises(ValueError):
        cp.fit(np.full((10, 3), 1 / 3), np.arange(10) % 4)
    with pytest.raises(ValueError):
        cp.fit(np.full((10, 3), 1 / 3), np.arange(10) % 3, alpha=1.5)
    cp.fit(np.full((20, 3), 1 / 3), np.arange(20) % 3)
    with pytest.raises(ValueError):
        cp.predict_sets(np.full((2, 2), 0.5))


# ------------------------------------------------------------- the reference's procedure
def _reference_by_hand(cal_values, cal_y, values, alpha, score, n_classes, tie_breaking):
    """One statement and one label at a time, from the definitions (module docstring)."""
    def nc(v, label):
        if score == "symmetric":
            return math.exp(-(2 * label - 1) * v)
        others = [v[k] for k in range(len(v)) if k != label]
        return (1.0 - (v[label] - max(others))) / 2
    cal = [nc(v, int(t)) for v, t in zip(cal_values, cal_y)]
    preds, all_sets = [], []
    for v in values:
        p = [(sum(c >= nc(v, label) for c in cal) + 1) / (len(cal) + 1) for label in range(n_classes)]
        members = [label for label in range(n_classes) if p[label] > alpha]
        all_sets.append([label in members for label in range(n_classes)])
        if not members:
            preds.append(-1)
        elif len(members) > 1:
            preds.append((0 if p[0] > p[1] else 1) if tie_breaking else -1)
        else:
            preds.append(members[0])
    return np.array(preds), np.array(all_sets)


@pytest.mark.parametrize("score, n_classes, tie_breaking", [("symmetric", 2, False), ("margin", 3, False),
                                                             ("margin", 4, True)])
def test_reference_conformal_equals_its_definition(score, n_classes, tie_breaking):
    rng = np.random.default_rng(3)
    if score == "symmetric":
        y = rng.integers(0, 2, 300)
        values = np.round(1.5 * (2 * y - 1) + rng.normal(size=300), 2)     # ties on purpose
    else:
        y = rng.integers(0, min(n_classes, 3), 300)                       # class 3 (abstain) never true
        values = np.round(_synthetic(4, 300, n_classes)[0] * 0.9, 2)      # unnormalised, with ties
        values[np.arange(300), y] += 0.05
    cal, test = slice(0, 200), slice(200, 300)
    cp = ReferenceConformal(score, n_classes, tie_breaking=tie_breaking).fit(values[cal], y[cal], alpha=0.1)
    want_pred, want_sets = _reference_by_hand(values[cal], y[cal], values[test], 0.1, score, n_classes, tie_breaking)
    assert np.array_equal(cp.predict_sets(values[test]), want_sets)
    assert np.array_equal(cp.predict(values[test]), want_pred)
    if tie_breaking:
        assert (want_sets.sum(1) > 1).any() and not (cp.predict(values[test])[want_sets.sum(1) > 1] == -1).any()
    d = json.loads(json.dumps(cp.to_dict(), allow_nan=False))
    assert d["nonconformity"] == score and d["n_cal"] == 200 and d["tie_breaking"] is tie_breaking


def test_reference_conformal_covers_and_rejects_bad_alpha():
    rng = np.random.default_rng(8)
    y = rng.integers(0, 2, 4000)
    f = 1.0 * (2 * y - 1) + rng.normal(size=4000) * 1.5
    for alpha in ALPHAS:
        sets = ReferenceConformal("symmetric", 2).fit(f[:2000], y[:2000], alpha=alpha).predict_sets(f[2000:])
        assert _coverage(sets, y[2000:]) >= 1 - alpha - 0.02
    with pytest.raises(ValueError, match="alpha"):
        ReferenceConformal("symmetric", 2).fit(f, y, alpha=0.0)
    with pytest.raises(ValueError):
        ReferenceConformal("lac", 2)


def test_acceptance_by_label_marks_one_label_probes():
    assert acceptance_by_label(np.array([1, 1, -1, 1]), 2) == {"accepted_per_label": {"0": 0, "1": 3},
                                                               "single_label_accepted": True}
    out = acceptance_by_label(np.array([0, 2, -1, 2]), 3)
    assert out["accepted_per_label"] == {"0": 1, "1": 0, "2": 2} and not out["single_label_accepted"]
    assert not acceptance_by_label(np.array([-1, -1]), 2)["single_label_accepted"]
