"""Selective prediction (risk-coverage, AURC) and paired comparisons of two predictors.

Label coding as in :mod:`evaluation.metrics`: integer labels, a prediction of -1
means "abstained". A statement is an *error* when ``pred != y_true`` (so an
abstention counts as an error wherever these functions see one).

Tie rule (used consistently by every function here): statements with exactly
equal confidence are accepted or rejected *together*. The risk-coverage curve
has one point per distinct confidence level c: coverage = #(confidence >= c) / n,
risk = error rate among those statements. AURC gives every k inside a tie
block the risk at the end of that block; selective accuracy at coverage c is
read at the smallest curve point whose coverage is >= c.

ECE is not defined here: use :func:`evaluation.metrics.ece` (top-label,
equal-width bins ``(lo, hi]``).
"""

from __future__ import annotations

import math
from typing import Callable, Iterator

import numpy as np
from scipy.stats import binom, rankdata

__all__ = [
    "risk_coverage",
    "aurc",
    "eaurc",
    "selective_accuracy",
    "confidence_auroc",
    "selective_metrics",
    "cluster_bootstrap_indices",
    "paired_bootstrap",
    "paired_bootstrap_diff",
    "mcnemar_exact",
    "holm",
]


# ------------------------------------------------------------------ helpers
def _inputs(y_true, pred, confidence):
    """Validated 1-D arrays (y int [n], pred int [n], confidence float [n])."""
    y = np.asarray(y_true, dtype=np.int64).ravel()
    p = np.asarray(pred, dtype=np.int64).ravel()
    c = np.asarray(confidence, dtype=np.float64).ravel()
    if not (y.size == p.size == c.size):
        raise ValueError(f"lengths differ: y_true {y.size}, pred {p.size}, confidence {c.size}")
    if np.isnan(c).any():
        raise ValueError("confidence contains NaN")
    return y, p, c


def _blocks(y_true, pred, confidence):
    """Tie blocks in order of decreasing confidence.

    Returns (ends [m] int: number of statements with confidence >= the block's
    level, i.e. the 1-based position of the block's last statement; errors [m]
    int: cumulative errors up to that position). Empty arrays if n = 0.
    """
    y, p, c = _inputs(y_true, pred, confidence)
    order = np.argsort(-c, kind="stable")
    cs = c[order]
    cum_err = np.cumsum(y[order] != p[order])
    last = np.flatnonzero(np.r_[cs[1:] != cs[:-1], True]) if cs.size else np.zeros(0, int)
    return last + 1, cum_err[last]


def _nan_to_none(x):
    """float, or None for NaN (JSON has no NaN)."""
    x = float(x)
    return None if math.isnan(x) else x


# --------------------------------------------------------- risk / coverage
def risk_coverage(y_true, pred, confidence) -> dict:
    """Risk-coverage curve, one point per distinct confidence level (highest first).

    y_true, pred: int [n]; confidence: float [n] (higher = more sure).
    At level c: coverage = #(confidence >= c) / n, risk = error rate among
    them; tied statements enter together. Returns {"coverage": [m], "risk": [m]}
    (plain floats; both empty if n = 0).
    """
    ends, errs = _blocks(y_true, pred, confidence)
    n = int(ends[-1]) if ends.size else 0
    return {"coverage": (ends / max(n, 1)).tolist(), "risk": (errs / np.maximum(ends, 1)).tolist()}


def aurc(y_true, pred, confidence) -> float:
    """Area under the risk-coverage curve (Geifman & El-Yaniv): mean selective risk over k = 1..n.

    Selective risk at k = error rate of the k most confident statements; every
    k inside a tie block gets the block-end risk (the curve's point). NaN if n = 0.
    """
    ends, errs = _blocks(y_true, pred, confidence)
    if ends.size == 0:
        return float("nan")
    sizes = np.diff(np.r_[0, ends])
    return float(np.sum(sizes * errs / ends) / ends[-1])


def _optimal_aurc(n: int, n_errors: int) -> float:
    """AURC of a ranking that puts all correct statements first: mean_k max(0, k - n_correct) / k."""
    k = np.arange(1, n + 1)
    return float(np.mean(np.maximum(0, k - (n - n_errors)) / k))


def eaurc(y_true, pred, confidence) -> float:
    """Excess AURC: aurc minus the exact discrete optimum for the same errors (>= 0; NaN if n = 0).

    The optimum is mean over k = 1..n of max(0, k - n_correct) / k (its
    continuous approximation is r + (1 - r) ln(1 - r), r = error rate).
    """
    y, p, c = _inputs(y_true, pred, confidence)
    if y.size == 0:
        return float("nan")
    return aurc(y, p, c) - _optimal_aurc(y.size, int(np.sum(y != p)))


def selective_accuracy(y_true, pred, confidence, coverages=(0.5, 0.8, 0.9)) -> dict:
    """Accuracy of the most confident statements at target coverages c in (0, 1].

    Read at the smallest risk-coverage point with coverage >= c, i.e. the
    ceil(c * n) most confident statements plus the rest of the tie block that
    crosses the cut. Keys are ``f"{c:g}"`` ("0.5"); values NaN if n = 0.
    """
    ends, errs = _blocks(y_true, pred, confidence)
    out = {}
    for cov in coverages:
        if not 0.0 < cov <= 1.0:
            raise ValueError(f"coverage must be in (0, 1], got {cov}")
        if ends.size == 0:
            out[f"{cov:g}"] = float("nan")
            continue
        need = math.ceil(round(cov * ends[-1], 9))  # round: 0.7 * 10 is 7.000000000000001
        i = int(np.searchsorted(ends, need, side="left"))
        out[f"{cov:g}"] = float(1.0 - errs[i] / ends[i])
    return out


def confidence_auroc(y_true, pred, confidence) -> float:
    """AUROC of confidence for telling correct (positive) from wrong predictions.

    Mann-Whitney statistic, ties count 1/2 (= sklearn's roc_auc_score on
    (pred == y_true, confidence)). NaN if all predictions are correct or all wrong.
    """
    y, p, c = _inputs(y_true, pred, confidence)
    ok = y == p
    n_pos = int(ok.sum())
    n_neg = ok.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    ranks = rankdata(c)  # average ranks for ties
    return float((ranks[ok].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def selective_metrics(y_true, probs) -> dict:
    """All selective-prediction metrics from class probabilities.

    y_true: int [n]; probs: [n, K] (binary: [n, 2]; a 1-D [n] array is read as
    the probability of class 1). pred = argmax (first on ties), confidence =
    max probability. Returns {"aurc", "eaurc", "selective_accuracy" (dict),
    "confidence_auroc", "risk_coverage": {"coverage", "risk"}}: plain floats
    and lists, None where undefined (NaN).
    """
    pr = np.asarray(probs, dtype=np.float64)
    if pr.ndim == 1:
        pr = np.stack([1.0 - pr, pr], axis=1)
    if pr.ndim != 2:
        raise ValueError(f"expected probabilities of shape [n, K], got {pr.shape}")
    y = np.asarray(y_true, dtype=np.int64).ravel()
    pred = np.argmax(pr, axis=1) if pr.shape[0] else np.zeros(0, np.int64)
    conf = pr.max(axis=1) if pr.shape[0] else np.zeros(0)
    acc = selective_accuracy(y, pred, conf)
    return {
        "aurc": _nan_to_none(aurc(y, pred, conf)),
        "eaurc": _nan_to_none(eaurc(y, pred, conf)),
        "selective_accuracy": {k: _nan_to_none(v) for k, v in acc.items()},
        "confidence_auroc": _nan_to_none(confidence_auroc(y, pred, conf)),
        "risk_coverage": risk_coverage(y, pred, conf),
    }


# ------------------------------------------------------ paired comparisons
def cluster_bootstrap_indices(groups, n_boot: int, rng, n: int | None = None) -> Iterator[np.ndarray]:
    """Yield ``n_boot`` bootstrap index arrays (int) into the n rows.

    groups None: i.i.d. resampling of the n rows (``n`` must be given), each
    array has n indices. Otherwise groups [n] (any hashable labels, e.g. an
    entity id): draw as many groups as there are, with replacement, and take
    all rows of each drawn group (array lengths vary). rng: a
    ``np.random.Generator`` or a seed.
    """
    rng = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
    if groups is None:
        if n is None:
            raise ValueError("n is required when groups is None")
        for _ in range(n_boot):
            yield rng.integers(0, n, size=n)
        return
    g = np.asarray(groups).ravel()
    if n is not None and n != g.size:
        raise ValueError(f"groups has {g.size} rows but n = {n}")
    _, inv = np.unique(g, return_inverse=True)
    order = np.argsort(inv, kind="stable")  # rows grouped together
    counts = np.bincount(inv)
    starts = np.cumsum(counts) - counts
    n_groups = counts.size
    for _ in range(n_boot):
        draw = rng.integers(0, n_groups, size=n_groups)
        sizes = counts[draw]
        offsets = np.cumsum(sizes) - sizes
        pos = np.arange(sizes.sum()) - np.repeat(offsets - starts[draw], sizes)
        yield order[pos]


def paired_bootstrap(difference: Callable[[np.ndarray], float], n: int, groups=None,
                     n_boot: int = 1000, seed: int = 0, level: float = 0.95) -> dict:
    """Paired bootstrap of a difference between two predictors scored on the same n rows.

    difference(rows int [m]) -> float: the difference computed on those rows (a resample); rows are
    resampled with replacement, or whole groups (see :func:`cluster_bootstrap_indices`).
    Returns {"diff": on all rows, "ci": [lo, hi] percentile interval at ``level``, "p_value":
    two-sided, :func:`bootstrap_p` (about the level at which the percentile interval starts to
    exclude 0, never below 2 / (B + 1)), "n_boot": resamples with a defined (non-NaN) difference, "level"}.
    """
    diff = float(difference(np.arange(n)))
    rng = np.random.default_rng(seed)
    d = np.array([float(difference(i)) for i in cluster_bootstrap_indices(groups, n_boot, rng, n=n)])
    d = d[~np.isnan(d)]
    if d.size == 0:
        return {"diff": diff, "ci": [float("nan")] * 2, "p_value": float("nan"),
                "n_boot": 0, "level": float(level)}
    lo, hi = np.percentile(d, [100 * (1 - level) / 2, 100 * (1 + level) / 2])
    return {"diff": diff, "ci": [float(lo), float(hi)], "p_value": bootstrap_p(d),
            "n_boot": int(d.size), "level": float(level)}


def bootstrap_p(draws: np.ndarray) -> float:
    """Two-sided bootstrap p-value of a difference from its resampled values [B] (NaN-free):
    2 * (1 + min(#(d <= 0), #(d >= 0))) / (B + 1), capped at 1; NaN without draws. The add-one
    Monte Carlo form (Davison & Hinkley 1997, ch. 4) never returns 0: with B resamples no p is below
    2 / (B + 1), so a Holm adjustment over m tests sees at least m * 2 / (B + 1), not 0 (choose B
    with 2 m / (B + 1) < alpha for a family of m)."""
    if len(draws) == 0:
        return float("nan")
    crossing = min(int(np.sum(draws <= 0)), int(np.sum(draws >= 0)))
    return float(min(1.0, 2.0 * (1 + crossing) / (len(draws) + 1)))


def paired_bootstrap_diff(y_true, pred_a, pred_b, metric_fn: Callable, groups=None,
                          n_boot: int = 1000, seed: int = 0, level: float = 0.95) -> dict:
    """:func:`paired_bootstrap` of metric_fn(y, pred_a) - metric_fn(y, pred_b).

    y_true, pred_a, pred_b: int [n] (predictions may be -1 = abstain); metric_fn(y, pred) -> float.
    """
    y = np.asarray(y_true, dtype=np.int64).ravel()
    a = np.asarray(pred_a, dtype=np.int64).ravel()
    b = np.asarray(pred_b, dtype=np.int64).ravel()
    if not (y.size == a.size == b.size):
        raise ValueError(f"lengths differ: y_true {y.size}, pred_a {a.size}, pred_b {b.size}")
    return paired_bootstrap(lambda i: float(metric_fn(y[i], a[i])) - float(metric_fn(y[i], b[i])), y.size,
                            groups, n_boot, seed, level)


def mcnemar_exact(y_true, pred_a, pred_b) -> dict:
    """McNemar's exact test on the statements that both predictors accept (pred != -1).

    b = a right and b wrong, c = a wrong and b right; two-sided exact p-value
    of b ~ Binomial(b + c, 1/2): min(1, 2 * P(X <= min(b, c))) (1.0 if
    b + c = 0). Returns {"b", "c", "n_both" (statements both accept), "p_value"}.
    """
    y = np.asarray(y_true, dtype=np.int64).ravel()
    a = np.asarray(pred_a, dtype=np.int64).ravel()
    bb = np.asarray(pred_b, dtype=np.int64).ravel()
    if not (y.size == a.size == bb.size):
        raise ValueError(f"lengths differ: y_true {y.size}, pred_a {a.size}, pred_b {bb.size}")
    both = (a != -1) & (bb != -1)
    ra, rb = a[both] == y[both], bb[both] == y[both]
    b_cnt, c_cnt = int(np.sum(ra & ~rb)), int(np.sum(~ra & rb))
    m = b_cnt + c_cnt
    p = 1.0 if m == 0 else min(1.0, 2.0 * float(binom.cdf(min(b_cnt, c_cnt), m, 0.5)))
    return {"b": b_cnt, "c": c_cnt, "n_both": int(both.sum()), "p_value": p}


def holm(p_values) -> np.ndarray:
    """Holm's step-down family-wise adjustment of the p-values [m] of one family of tests.

    Sorted ascending p_(1) <= ... <= p_(m): adjusted p_(i) = max over j <= i of min(1, (m - j + 1) p_(j));
    rejecting where the adjusted p < alpha controls the family-wise error rate at alpha under any
    dependence between the tests. NaN entries are not tests: they stay NaN and do not count in m.
    Returns float [m] in the input's order.
    """
    p = np.asarray(p_values, dtype=np.float64).ravel()
    out = np.full(p.size, np.nan)
    tested = np.flatnonzero(~np.isnan(p))
    order = tested[np.argsort(p[tested], kind="stable")]
    m = order.size
    out[order] = np.minimum(1.0, np.maximum.accumulate((m - np.arange(m)) * p[order]))
    return out
