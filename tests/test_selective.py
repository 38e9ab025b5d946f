"""evaluation.selective (and the existing top-label ECE) against independent computations."""

import json
import math

import numpy as np
import pytest
from scipy.stats import binomtest
from sklearn.metrics import roc_auc_score

from evaluation import selective as S

try:
    from evaluation.metrics import ece
except ImportError:  # before / during the move of probes.metrics
    from probes.metrics import ece


# ------------------------------------------------------------ reference code
def _random_case(rng, n=None, k=3, n_levels=None):
    """Labels, noisy predictions and confidences with many ties (few distinct levels)."""
    n = int(rng.integers(1, 80)) if n is None else n
    y = rng.integers(0, k, n)
    pred = np.where(rng.random(n) < rng.random(), y, rng.integers(0, k, n))
    levels = int(rng.integers(1, 12)) if n_levels is None else n_levels
    conf = rng.integers(0, levels, n) / levels  # exact ties
    return y, pred, conf


def _ref_curve(y, pred, conf):
    """Loop over distinct levels, highest first: coverage and risk of {confidence >= c}."""
    err = (y != pred).astype(float)
    cov, risk = [], []
    for c in sorted(set(conf.tolist()), reverse=True):
        sel = conf >= c
        cov.append(sel.mean())
        risk.append(err[sel].mean())
    return cov, risk


def _ref_aurc(y, pred, conf):
    """Mean over k = 1..n of the error rate of all statements at least as confident as the k-th."""
    err = (y != pred).astype(float)
    cs = np.sort(conf)[::-1]
    return float(np.mean([err[conf >= cs[k - 1]].mean() for k in range(1, len(y) + 1)]))


def _ref_optimal_aurc(y, pred):
    """AURC of an error sequence with every correct statement ranked first (plain loop)."""
    n_err = int(np.sum(y != pred))
    seq = [0] * (len(y) - n_err) + [1] * n_err
    total, errs = 0.0, 0
    for k, e in enumerate(seq, start=1):
        errs += e
        total += errs / k
    return total / len(seq)


def _ref_selective_accuracy(y, pred, conf, c):
    cov, risk = _ref_curve(y, pred, conf)
    for cv, r in zip(cov, risk):
        if cv >= c - 1e-12:
            return 1.0 - r
    raise AssertionError("unreachable")


def _ref_ece(y, probs, n_bins=10):
    """Top-label ECE with bins (lo, hi], 0.0 in the first bin, by a loop over bins."""
    conf = probs.max(axis=1)
    correct = (probs.argmax(axis=1) == y).astype(float)
    edges = np.linspace(0, 1, n_bins + 1)
    total = 0.0
    for b in range(n_bins):
        lo, hi = edges[b], edges[b + 1]
        m = (conf > lo) & (conf <= hi)
        if b == 0:
            m |= conf == 0.0
        if m.any():
            total += m.sum() / len(y) * abs(correct[m].mean() - conf[m].mean())
    return total


# -------------------------------------------------------- curve and AURC
def test_risk_coverage_and_aurc_match_reference_with_ties():
    rng = np.random.default_rng(0)
    for _ in range(300):
        y, pred, conf = _random_case(rng)
        curve = S.risk_coverage(y, pred, conf)
        cov, risk = _ref_curve(y, pred, conf)
        np.testing.assert_allclose(curve["coverage"], cov, rtol=0, atol=1e-12)
        np.testing.assert_allclose(curve["risk"], risk, rtol=0, atol=1e-12)
        assert curve["coverage"][-1] == 1.0
        assert S.aurc(y, pred, conf) == pytest.approx(_ref_aurc(y, pred, conf), abs=1e-12)
        e = S.eaurc(y, pred, conf)
        assert e == pytest.approx(_ref_aurc(y, pred, conf) - _ref_optimal_aurc(y, pred), abs=1e-12)
        assert e >= -1e-12


def test_aurc_without_ties_is_mean_cumulative_risk():
    rng = np.random.default_rng(1)
    for _ in range(50):
        n = int(rng.integers(1, 60))
        y, pred, _ = _random_case(rng, n=n)
        conf = rng.permutation(n) / n  # distinct
        err = (y != pred)[np.argsort(-conf)]
        expected = np.mean(np.cumsum(err) / np.arange(1, n + 1))
        assert S.aurc(y, pred, conf) == pytest.approx(expected, abs=1e-12)
        assert len(S.risk_coverage(y, pred, conf)["risk"]) == n


def test_eaurc_zero_for_perfect_ranking_and_close_to_continuous_form():
    rng = np.random.default_rng(2)
    n = 2000
    y = rng.integers(0, 2, n)
    pred = np.where(rng.random(n) < 0.7, y, 1 - y)
    conf = np.where(pred == y, 0.9, 0.6) + rng.random(n) * 0.05  # correct strictly above wrong
    assert S.eaurc(y, pred, conf) == pytest.approx(0.0, abs=1e-12)
    r = np.mean(pred != y)
    assert S.aurc(y, pred, conf) == pytest.approx(r + (1 - r) * np.log(1 - r), abs=5e-3)


def test_hand_example():
    # confidence 0.9 (right), 0.8 (wrong), 0.8 (right), 0.5 (wrong)
    y = np.array([1, 1, 0, 0])
    pred = np.array([1, 0, 0, 1])
    conf = np.array([0.9, 0.8, 0.8, 0.5])
    curve = S.risk_coverage(y, pred, conf)
    assert curve == {"coverage": [0.25, 0.75, 1.0], "risk": [0.0, 1 / 3, 0.5]}
    assert S.aurc(y, pred, conf) == pytest.approx((0 + 1 / 3 + 1 / 3 + 0.5) / 4)
    assert S.eaurc(y, pred, conf) == pytest.approx((0 + 1 / 3 + 1 / 3 + 0.5) / 4 - (0 + 0 + 1 / 3 + 0.5) / 4)
    # coverage 0.5 -> cut after 2 statements crosses the 0.8 block -> first 3 statements
    assert S.selective_accuracy(y, pred, conf, coverages=(0.25, 0.5, 1.0)) == pytest.approx(
        {"0.25": 1.0, "0.5": 2 / 3, "1": 0.5})


# ---------------------------------------------------- selective accuracy
def test_selective_accuracy_matches_reference():
    rng = np.random.default_rng(3)
    covs = (0.1, 0.5, 0.7, 0.8, 0.9, 1.0)
    for _ in range(200):
        y, pred, conf = _random_case(rng)
        got = S.selective_accuracy(y, pred, conf, coverages=covs)
        assert list(got) == [f"{c:g}" for c in covs]
        for c in covs:
            assert got[f"{c:g}"] == pytest.approx(_ref_selective_accuracy(y, pred, conf, c), abs=1e-12)


def test_selective_accuracy_exact_cut_without_float_error():
    # 0.7 * 10 = 7.000000000000001 in floating point: must still take exactly 7
    y = np.zeros(10, int)
    pred = np.array([0] * 7 + [1] * 3)
    conf = np.arange(10, 0, -1) / 10
    assert S.selective_accuracy(y, pred, conf, coverages=(0.7, 0.8))["0.7"] == 1.0
    assert S.selective_accuracy(y, pred, conf, coverages=(0.8,))["0.8"] == pytest.approx(7 / 8)
    with pytest.raises(ValueError):
        S.selective_accuracy(y, pred, conf, coverages=(0.0,))


# ---------------------------------------------------------- confidence AUROC
def test_confidence_auroc_matches_sklearn():
    try:
        from evaluation.metrics import auroc
    except ImportError:
        from probes.metrics import auroc
    rng = np.random.default_rng(4)
    checked = 0
    for _ in range(200):
        y, pred, conf = _random_case(rng)
        ok = (y == pred).astype(int)
        got = S.confidence_auroc(y, pred, conf)
        if ok.min() == ok.max():
            assert math.isnan(got)
            continue
        assert got == pytest.approx(roc_auc_score(ok, conf), abs=1e-12)
        assert got == pytest.approx(auroc(ok, conf), abs=1e-12)
        checked += 1
    assert checked > 100


def test_confidence_auroc_nan_when_all_correct_or_all_wrong():
    y = np.array([0, 1, 2])
    assert math.isnan(S.confidence_auroc(y, y, [0.2, 0.5, 0.9]))
    assert math.isnan(S.confidence_auroc(y, (y + 1) % 3, [0.2, 0.5, 0.9]))


# ---------------------------------------------------------- selective_metrics
@pytest.mark.parametrize("k", [2, 3])
def test_selective_metrics_from_probs(k):
    rng = np.random.default_rng(5 + k)
    n = 200
    probs = rng.dirichlet(np.ones(k), size=n)
    y = np.where(rng.random(n) < 0.6, probs.argmax(1), rng.integers(0, k, n))
    out = S.selective_metrics(y, probs)
    json.dumps(out, allow_nan=False)
    pred, conf = probs.argmax(1), probs.max(1)
    assert out["aurc"] == pytest.approx(_ref_aurc(y, pred, conf))
    assert out["eaurc"] == pytest.approx(_ref_aurc(y, pred, conf) - _ref_optimal_aurc(y, pred))
    assert out["confidence_auroc"] == pytest.approx(roc_auc_score(y == pred, conf))
    assert out["selective_accuracy"]["0.8"] == pytest.approx(_ref_selective_accuracy(y, pred, conf, 0.8))
    assert out["risk_coverage"] == S.risk_coverage(y, pred, conf)
    if k == 2:
        assert S.selective_metrics(y, probs[:, 1]) == out  # 1-D = probability of class 1


def test_selective_metrics_edge_cases():
    # n = 1
    out = S.selective_metrics([1], [[0.3, 0.7]])
    assert out["aurc"] == 0.0 and out["eaurc"] == 0.0 and out["confidence_auroc"] is None
    assert out["risk_coverage"] == {"coverage": [1.0], "risk": [0.0]}
    assert out["selective_accuracy"] == {"0.5": 1.0, "0.8": 1.0, "0.9": 1.0}
    # all tied, 2 of 4 wrong: a single curve point, every k gets the full risk
    y, pred, conf = np.array([0, 1, 0, 1]), np.array([0, 0, 0, 0]), np.full(4, 0.6)
    assert S.risk_coverage(y, pred, conf) == {"coverage": [1.0], "risk": [0.5]}
    assert S.aurc(y, pred, conf) == 0.5
    assert S.eaurc(y, pred, conf) == pytest.approx(0.5 - (0 + 0 + 1 / 3 + 0.5) / 4)
    assert S.confidence_auroc(y, pred, conf) == 0.5
    assert S.selective_accuracy(y, pred, conf)["0.5"] == 0.5
    # all correct
    y = np.arange(6) % 3
    assert S.aurc(y, y, np.linspace(0.4, 0.9, 6)) == 0.0
    assert S.eaurc(y, y, np.linspace(0.4, 0.9, 6)) == 0.0
    # empty
    empty = S.selective_metrics(np.zeros(0, int), np.zeros((0, 3)))
    assert empty["aurc"] is None and empty["risk_coverage"] == {"coverage": [], "risk": []}
    json.dumps(empty, allow_nan=False)
    with pytest.raises(ValueError):
        S.aurc([0, 1], [0, 1], [0.5, float("nan")])


# ------------------------------------------------------------------------ ECE
@pytest.mark.parametrize("k", [2, 3, 5])
def test_ece_matches_torchmetrics(k):
    torch = pytest.importorskip("torch")
    tm = pytest.importorskip("torchmetrics.classification")
    rng = np.random.default_rng(10 + k)
    metric = tm.MulticlassCalibrationError(num_classes=k, n_bins=10, norm="l1")
    for _ in range(20):
        n = int(rng.integers(5, 300))
        # continuous probabilities (torchmetrics bins [lo, hi), so avoid exact edges)
        probs = rng.dirichlet(np.full(k, rng.uniform(0.2, 3.0)), size=n)
        y = np.where(rng.random(n) < 0.7, probs.argmax(1), rng.integers(0, k, n))
        want = float(metric(torch.tensor(probs), torch.tensor(y)))
        metric.reset()
        assert ece(y, probs) == pytest.approx(want, abs=1e-6)


def test_ece_matches_binning_definition_on_bin_edges():
    rng = np.random.default_rng(20)
    for _ in range(100):
        n = int(rng.integers(1, 50))
        top = rng.choice([0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 0.55, 0.75], size=n)  # many on edges
        probs = np.stack([top, 1 - top], axis=1)
        flip = rng.random(n) < 0.5
        probs[flip] = probs[flip][:, ::-1]
        y = rng.integers(0, 2, n)
        assert ece(y, probs) == pytest.approx(_ref_ece(y, probs), abs=1e-12)
    # 3 classes on edges (top 0.4 falls in (0.3, 0.4]) and an all-zero row (confidence 0.0 -> first bin)
    probs = np.array([[0.4, 0.3, 0.3], [0.2, 0.2, 0.6], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    y = np.array([0, 1, 0, 0])
    assert ece(y, probs) == pytest.approx(_ref_ece(y, probs), abs=1e-12)
    assert ece(y, probs) == pytest.approx((abs(1 - 0.4) + abs(0 - 0.6) + abs(1 - 0.0) + 0.0) / 4)


# -------------------------------------------------------------------- McNemar
def test_mcnemar_matches_scipy_binomtest():
    rng = np.random.default_rng(30)
    for _ in range(200):
        n = int(rng.integers(0, 120))
        y = rng.integers(0, 3, n)
        a = np.where(rng.random(n) < rng.random(), y, rng.integers(-1, 3, n))
        b = np.where(rng.random(n) < rng.random(), y, rng.integers(-1, 3, n))
        out = S.mcnemar_exact(y, a, b)
        both = (a != -1) & (b != -1)
        ra, rb = a[both] == y[both], b[both] == y[both]
        assert out["b"] == int(np.sum(ra & ~rb)) and out["c"] == int(np.sum(~ra & rb))
        assert out["n_both"] == int(both.sum())
        m = out["b"] + out["c"]
        want = 1.0 if m == 0 else binomtest(out["b"], m, 0.5, alternative="two-sided").pvalue
        assert out["p_value"] == pytest.approx(want, rel=1e-9, abs=1e-300)


def test_mcnemar_known_values():
    # b = 0, c = 6 -> p = 2 / 2^6
    y = np.zeros(10, int)
    a = np.array([1] * 6 + [0] * 4)
    b = np.zeros(10, int)
    out = S.mcnemar_exact(y, a, b)
    assert (out["b"], out["c"]) == (0, 6) and out["p_value"] == pytest.approx(2 / 64)
    assert S.mcnemar_exact(y, b, b)["p_value"] == 1.0


# ------------------------------------------------------------------ bootstrap
def _accuracy(y, pred):
    keep = pred != -1
    return float(np.mean(y[keep] == pred[keep])) if keep.any() else float("nan")


def test_cluster_bootstrap_resamples_whole_groups():
    rng = np.random.default_rng(40)
    sizes = rng.integers(1, 6, 15)
    groups = rng.permutation(np.repeat(np.arange(15) * 7 + 3, sizes))  # arbitrary labels, shuffled rows
    labels, size_of = np.unique(groups, return_counts=True)
    for idx in S.cluster_bootstrap_indices(groups, 200, np.random.default_rng(0)):
        drawn = groups[idx]
        got_labels, got_counts = np.unique(drawn, return_counts=True)
        per = dict(zip(labels, size_of))
        mult = [c // per[g] for g, c in zip(got_labels, got_counts)]
        assert all(c % per[g] == 0 for g, c in zip(got_labels, got_counts))  # whole groups only
        assert sum(mult) == 15  # as many groups drawn as there are
        for g in got_labels:  # every row of a drawn group is present
            assert set(idx[drawn == g]) == set(np.flatnonzero(groups == g))
    iid = list(S.cluster_bootstrap_indices(None, 5, 1, n=9))
    assert all(i.shape == (9,) and i.min() >= 0 and i.max() < 9 for i in iid)
    again = list(S.cluster_bootstrap_indices(None, 5, 1, n=9))
    assert all((u == v).all() for u, v in zip(iid, again))
    with pytest.raises(ValueError):
        next(S.cluster_bootstrap_indices(None, 5, 1))


def test_cluster_interval_wider_than_iid_for_correlated_groups():
    rng = np.random.default_rng(41)
    n_groups, size = 30, 10
    groups = np.repeat(np.arange(n_groups), size)
    y = np.zeros(n_groups * size, int)
    # every row of a group has the same outcome for a and for b
    a = np.repeat(np.where(rng.random(n_groups) < 0.7, 0, 1), size)
    b = np.repeat(np.where(rng.random(n_groups) < 0.5, 0, 1), size)
    iid = S.paired_bootstrap_diff(y, a, b, _accuracy, n_boot=400, seed=0)
    clu = S.paired_bootstrap_diff(y, a, b, _accuracy, groups=groups, n_boot=400, seed=0)
    assert iid["diff"] == clu["diff"] == pytest.approx(_accuracy(y, a) - _accuracy(y, b))
    w_iid = iid["ci"][1] - iid["ci"][0]
    w_clu = clu["ci"][1] - clu["ci"][0]
    assert w_clu > 2.0 * w_iid  # ~ sqrt(10) in theory


def test_paired_bootstrap_identical_predictions_is_exactly_zero():
    rng = np.random.default_rng(42)
    y = rng.integers(0, 3, 50)
    a = np.where(rng.random(50) < 0.6, y, rng.integers(-1, 3, 50))
    for groups in (None, rng.integers(0, 7, 50)):
        out = S.paired_bootstrap_diff(y, a, a.copy(), _accuracy, groups=groups, n_boot=200, seed=3)
        assert out["diff"] == 0.0 and out["ci"] == [0.0, 0.0] and out["p_value"] == 1.0
        assert out["n_boot"] == 200


def test_paired_bootstrap_detects_clear_difference_and_is_seeded():
    rng = np.random.default_rng(43)
    y = rng.integers(0, 2, 400)
    a = y.copy()
    b = np.where(rng.random(400) < 0.6, y, 1 - y)
    out = S.paired_bootstrap_diff(y, a, b, _accuracy, n_boot=300, seed=1)
    assert out["ci"][0] > 0 and out["p_value"] < 0.01
    assert out["ci"][0] <= out["diff"] <= out["ci"][1]
    assert S.paired_bootstrap_diff(y, a, b, _accuracy, n_boot=300, seed=1) == out
    # n = 1: every resample is the single row
    one = S.paired_bootstrap_diff([1], [1], [0], _accuracy, n_boot=20)
    assert one["diff"] == 1.0 and one["ci"] == [1.0, 1.0]


def test_cell_intervals_resample_whole_groups():
    """evaluation.metrics.bootstrap_ci with groups (the cells' cluster bootstrap) matches an explicit
    resampling of whole groups, and is wider than the i.i.d. interval when groups share outcomes."""
    from evaluation.metrics import bootstrap_ci, mcc_from_confusion, _joint_counts

    rng = np.random.default_rng(3)
    groups = np.repeat(np.arange(80), 8)
    y = rng.integers(0, 2, groups.size)
    right = np.repeat(rng.random(80) < 0.8, 8)           # a group is all right or all wrong
    pred = np.where(right, y, 1 - y)
    iid = bootstrap_ci(y, pred, 2, n_boot=4000, seed=0)["mcc"]
    cluster = bootstrap_ci(y, pred, 2, n_boot=4000, seed=0, groups=groups)["mcc"]
    explicit = [mcc_from_confusion(_joint_counts(y[i], pred[i], 2)[:, :2])
                for i in S.cluster_bootstrap_indices(groups, 4000, np.random.default_rng(1))]
    lo, hi = np.percentile(explicit, [2.5, 97.5])
    assert abs(cluster[0] - lo) < 0.03 and abs(cluster[1] - hi) < 0.03
    assert (cluster[1] - cluster[0]) > 2 * (iid[1] - iid[0])


# ------------------------------------------------------- multiplicity (Holm)
def test_holm_on_a_hand_example():
    # sorted: 0.005 (x4 = 0.02), 0.01 (x3 = 0.03), 0.03 (x2 = 0.06), 0.04 (x1, raised to the running max 0.06)
    np.testing.assert_allclose(S.holm([0.01, 0.04, 0.03, 0.005]), [0.03, 0.06, 0.06, 0.02])
    np.testing.assert_allclose(S.holm([0.6, 0.7]), [1.0, 1.0])        # capped at 1
    out = S.holm([np.nan, 0.01, 0.04])                                 # NaN: no test, not counted in m
    assert math.isnan(out[0]) and out[1:].tolist() == pytest.approx([0.02, 0.04])
    assert S.holm([]).size == 0


def test_holm_decisions_equal_the_step_down_procedure():
    """Adjusted p <= alpha exactly where Holm's step-down test rejects: walk the sorted p-values and reject
    H_(j) while p_(j) <= alpha / (m - j + 1) (1-based j), stop at the first that is not."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        m = int(rng.integers(1, 30))
        p = rng.random(m) ** rng.uniform(1, 6)      # many small p-values
        adjusted = S.holm(p)
        for alpha in (0.01, 0.05, 0.1):
            reject = np.zeros(m, bool)
            for j, i in enumerate(np.argsort(p, kind="stable")):
                if p[i] > alpha / (m - j):
                    break
                reject[i] = True
            assert ((adjusted <= alpha) == reject).all()
        assert (adjusted >= p).all() and (adjusted <= 1).all()


def test_bootstrap_p_never_reaches_zero_so_holm_sees_the_resample_count():
    """A difference no resample crosses has p = 2 / (B + 1) (add-one Monte Carlo p), not 0: Holm over m such
    tests then gives m * 2 / (B + 1), so B = 1000 cannot make 45 comparisons significant at 0.05."""
    draws = np.full(1000, 0.3)
    assert S.bootstrap_p(draws) == pytest.approx(2 / 1001)
    assert S.holm(np.full(45, S.bootstrap_p(draws))).min() == pytest.approx(45 * 2 / 1001)
    assert S.bootstrap_p(np.r_[np.full(9, -0.1), np.full(991, 0.2)]) == pytest.approx(2 * 10 / 1001)
    assert S.bootstrap_p(np.zeros(50)) == 1.0 and np.isnan(S.bootstrap_p(np.array([])))
