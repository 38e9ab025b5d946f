"""Every evaluation metric of the project, defined once.

Label coding: 0 = false, 1 = true, 2 = neither (binary tasks: 0/1, 1 = positive).
A prediction of -1 means "abstained" (the conformal set was empty or held more
than one label, see :mod:`evaluation.conformal`).

Definitions
-----------
- ``mcc``: Matthews correlation coefficient, numerically identical to
  ``sklearn.metrics.matthews_corrcoef`` (binary and multiclass), 0.0 in the
  degenerate cases where sklearn returns 0.0 (a constant truth or prediction,
  no statements).
- acceptance rate: ``1 - abstained / total``.
- MCC with abstention: MCC on the accepted statements only (0.0 if none).
- W-MCC: ``MCC(accepted) * acceptance rate``, the paper's
  ``MCC * (1 - abstained / total)`` (0.0 if nothing is accepted).
- accuracy: on the accepted statements (undefined -> NaN if none).
- AUROC: binary from a score of the positive class; multiclass one-vs-rest
  macro average from [N, K] probabilities (equal to sklearn's
  ``roc_auc_score(..., multi_class="ovr", average="macro")``). Classes absent
  from ``y_true`` are skipped (sklearn raises instead); NaN if no class can be
  scored. Computed on all statements (a score exists even when abstaining).
- ECE: expected calibration error with 10 equal-width bins ``(lo, hi]`` on
  the top-label confidence (binary: ``max(p, 1 - p)`` against correctness of
  ``p > 0.5``), on all statements.
- coverage of conformal sets: fraction of statements whose set contains the
  true label; per-class coverage: the same within each true class.
- bootstrap intervals: percentile intervals (default 95 %) over resamples of
  the statements with replacement (abstained statements included, so the
  acceptance rate varies between resamples too).

:func:`evaluate` returns a JSON-serialisable dict with these keys
(undefined values are ``None``):

=====================  ======================================================
``n``                  number of statements
``n_classes``          K (2 for binary probes, 3 for multiclass)
``n_accepted``         statements with a prediction other than -1
``mcc_all``            MCC of the plain prediction (argmax / ``p > 0.5``) on
                       all statements, no abstention
``accuracy_all``       accuracy of that plain prediction
``mcc``                MCC on the accepted statements of ``y_pred``
``wmcc``               ``mcc * acceptance``
``acceptance``         ``1 - abstained / n``
``accuracy``           accuracy on the accepted statements
``auroc``              see above
``ece``                see above
``coverage``           conformal set coverage (``None`` without ``sets``)
``per_class_coverage`` list of K coverages, ``None`` for absent classes
``mean_set_size``      average number of labels per conformal set
``mcc_all_ci``         ``[lo, hi]`` bootstrap interval of ``mcc_all``
``mcc_ci``             ``[lo, hi]`` bootstrap interval of ``mcc``
``wmcc_ci``            ``[lo, hi]`` bootstrap interval of ``wmcc``
``ci_level``           confidence level of the intervals (0.95)
``n_boot``, ``seed``   bootstrap settings
``bootstrap``          ``iid`` (statements resampled) or ``cluster`` (whole groups resampled), ``n_groups``
``aurc``, ``eaurc``    area under the risk-coverage curve of the plain prediction, its excess over the optimum
``selective_accuracy`` accuracy of the most confident 50 / 80 / 90 % (keys "0.5", "0.8", "0.9")
``confidence_auroc``   AUROC of the max probability for separating correct from wrong predictions
``risk_coverage``      the curve: ``{"coverage": [...], "risk": [...]}`` (one point per confidence level)
=====================  ======================================================
"""

from __future__ import annotations

import math

import numpy as np

from evaluation.selective import selective_metrics
from toolkit.errors import ToolkitError

__all__ = [
    "ABSTAIN",
    "confusion_matrix",
    "mcc_from_confusion",
    "mcc",
    "acceptance_rate",
    "abstain_mcc",
    "wmcc",
    "accuracy",
    "auroc",
    "ece",
    "as_probs",
    "plain_prediction",
    "coverage",
    "per_class_coverage",
    "mean_set_size",
    "bootstrap_ci",
    "evaluate",
]

ABSTAIN = -1


# --------------------------------------------------------------------------- MCC
def confusion_matrix(y_true, y_pred, n_classes: int) -> np.ndarray:
    """Counts C[i, j] of statements with true label i and predicted label j.

    y_true, y_pred: int [N] with values in [0, n_classes). Returns int [K, K].
    """
    yt = np.asarray(y_true, dtype=np.int64).ravel()
    yp = np.asarray(y_pred, dtype=np.int64).ravel()
    return np.bincount(yt * n_classes + yp, minlength=n_classes * n_classes).reshape(
        n_classes, n_classes
    )


def mcc_from_confusion(conf) -> np.ndarray | float:
    """MCC from confusion matrices [..., K, K] (rows: true, cols: predicted).

    Vectorised over leading dimensions; same arithmetic as sklearn, and 0.0
    where sklearn returns 0.0 (zero variance of truth or prediction).
    """
    c = np.asarray(conf, dtype=np.float64)
    t_sum = c.sum(axis=-1)  # [..., K] true counts
    p_sum = c.sum(axis=-2)  # [..., K] predicted counts
    n_correct = np.trace(c, axis1=-2, axis2=-1)
    n = p_sum.sum(axis=-1)
    cov_ytyp = n_correct * n - (t_sum * p_sum).sum(axis=-1)
    cov_ypyp = n * n - (p_sum * p_sum).sum(axis=-1)
    cov_ytyt = n * n - (t_sum * t_sum).sum(axis=-1)
    denom = cov_ytyt * cov_ypyp
    ok = denom != 0
    out = np.where(ok, cov_ytyp / np.sqrt(np.where(ok, denom, 1.0)), 0.0)
    return float(out) if out.ndim == 0 else out


def mcc(y_true, y_pred) -> float:
    """Matthews correlation coefficient, identical to sklearn's matthews_corrcoef.

    y_true, y_pred: [N] labels of any integer values (the union of labels is
    used, as in sklearn). Returns 0.0 for N = 0 or a constant truth/prediction.
    """
    yt = np.asarray(y_true).ravel()
    yp = np.asarray(y_pred).ravel()
    if yt.shape != yp.shape:
        raise ValueError(f"y_true has {yt.size} labels but y_pred has {yp.size}")
    if yt.size == 0:
        return 0.0
    _, inv = np.unique(np.concatenate([yt, yp]), return_inverse=True)
    k = int(inv.max()) + 1
    return float(mcc_from_confusion(confusion_matrix(inv[: yt.size], inv[yt.size:], k)))


# ------------------------------------------------------------------- abstention
def acceptance_rate(y_pred) -> float:
    """1 - abstained / total for predictions [N] where -1 means abstained (0.0 if N = 0)."""
    yp = np.asarray(y_pred).ravel()
    if yp.size == 0:
        return 0.0
    return float(np.mean(yp != ABSTAIN))


def abstain_mcc(y_true, y_pred) -> float:
    """MCC on the accepted statements (y_pred != -1); 0.0 if nothing is accepted."""
    yt = np.asarray(y_true).ravel()
    yp = np.asarray(y_pred).ravel()
    keep = yp != ABSTAIN
    return mcc(yt[keep], yp[keep])


def wmcc(y_true, y_pred) -> float:
    """W-MCC = MCC(accepted) * acceptance rate = MCC * (1 - abstained / total)."""
    return abstain_mcc(y_true, y_pred) * acceptance_rate(y_pred)


def accuracy(y_true, y_pred) -> float:
    """Accuracy on the accepted statements [N] (y_pred != -1); NaN if none accepted."""
    yt = np.asarray(y_true).ravel()
    yp = np.asarray(y_pred).ravel()
    keep = yp != ABSTAIN
    if not keep.any():
        return float("nan")
    return float(np.mean(yt[keep] == yp[keep]))


# ------------------------------------------------------- probabilities / scores
def as_probs(scores_or_probs) -> np.ndarray:
    """[N] probabilities of the positive class or [N, K] probabilities -> [N, K].

    A 1-D input must lie in [0, 1] (map raw probe scores to probabilities first).
    """
    p = np.asarray(scores_or_probs, dtype=np.float64)
    if p.ndim == 1:
        if p.size and (np.nanmin(p) < 0.0 or np.nanmax(p) > 1.0):
            raise ValueError(
                "1-D scores must be probabilities of the positive class in [0, 1]; "
                "map raw probe scores to probabilities first"
            )
        return np.stack([1.0 - p, p], axis=1)
    if p.ndim != 2:
        raise ValueError(f"expected probabilities of shape [N] or [N, K], got {p.shape}")
    return p


def plain_prediction(scores_or_probs) -> np.ndarray:
    """Prediction without abstention: argmax over [N, K], or ``p > 0.5`` for [N]. int [N]."""
    p = np.asarray(scores_or_probs, dtype=np.float64)
    if p.ndim == 1:
        return (p > 0.5).astype(np.int64)
    return np.argmax(p, axis=1).astype(np.int64)


def _binary_auroc(pos, score) -> float:
    """Mann-Whitney AUROC with ties counted 1/2 (= sklearn's trapezoidal ROC AUC)."""
    pos = np.asarray(pos, dtype=bool).ravel()
    s = np.asarray(score, dtype=np.float64).ravel()
    n_pos = int(pos.sum())
    n_neg = pos.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    _, inv, counts = np.unique(s, return_inverse=True, return_counts=True)
    upper = np.cumsum(counts)  # 1-based rank of the last element of each tie group
    avg_rank = upper - (counts - 1) / 2.0
    rank_sum = avg_rank[inv][pos].sum()
    return float((rank_sum - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def weighted_auroc(pos, score, weights) -> np.ndarray:
    """:func:`_binary_auroc` of bool [N] `pos` by float [N] `score` under each row of float [B, N] `weights`
    (how often each statement was drawn by a bootstrap resample): float [B], NaN where a resample has no
    positive or no negative. Equal to the AUROC of the resample's rows, in one pass for all B."""
    pos = np.asarray(pos, dtype=bool).ravel()
    w = np.asarray(weights, dtype=np.float64)
    _, tie = np.unique(np.asarray(score, dtype=np.float64).ravel(), return_inverse=True)
    neg = np.zeros((int(tie.max()) + 1 if tie.size else 0, len(w)))
    np.add.at(neg, tie[~pos], w[:, ~pos].T)                           # negative weight per tie group [U, B]
    credit = (np.cumsum(neg, axis=0) - 0.5 * neg)[tie[pos]].T          # negatives below + half the tied [B, P]
    w_pos, w_neg = w[:, pos].sum(1), w[:, ~pos].sum(1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where((w_pos > 0) & (w_neg > 0), (w[:, pos] * credit).sum(1) / (w_pos * w_neg), np.nan)


def auroc(y_true, scores_or_probs) -> float:
    """Area under the ROC curve.

    Binary: ``scores_or_probs`` is [N] (any monotone score of the positive
    class) or [N, 2]. Multiclass: [N, K] probabilities, one-vs-rest macro
    average over the classes present in ``y_true`` (with at least one
    statement outside them). NaN when undefined.
    """
    yt = np.asarray(y_true).ravel()
    s = np.asarray(scores_or_probs, dtype=np.float64)
    if s.ndim == 1:
        return _binary_auroc(yt == 1, s)
    if s.shape[1] == 2:
        return _binary_auroc(yt == 1, s[:, 1])
    per_class = [_binary_auroc(yt == k, s[:, k]) for k in range(s.shape[1])]
    per_class = [a for a in per_class if not math.isnan(a)]
    return float(np.mean(per_class)) if per_class else float("nan")


def ece(y_true, scores_or_probs, n_bins: int = 10) -> float:
    """Expected calibration error of the top label, ``n_bins`` equal-width bins (lo, hi].

    scores_or_probs: [N] probability of the positive class or [N, K]
    probabilities. ECE = sum_b (n_b / N) * |accuracy_b - mean confidence_b|.
    NaN if N = 0.
    """
    yt = np.asarray(y_true).ravel()
    p = as_probs(scores_or_probs)
    if yt.size == 0:
        return float("nan")
    conf = p.max(axis=1)
    correct = (plain_prediction(scores_or_probs) == yt).astype(np.float64)
    edges = np.linspace(0.0, 1.0, n_bins + 1)
    b = np.digitize(conf, edges[1:-1], right=True)
    acc_sum = np.bincount(b, weights=correct, minlength=n_bins)
    conf_sum = np.bincount(b, weights=conf, minlength=n_bins)
    return float(np.abs(acc_sum - conf_sum).sum() / yt.size)


# -------------------------------------------------------------- conformal sets
def coverage(sets, y_true) -> float:
    """Fraction of statements whose set (bool [N, K]) contains the true label [N]."""
    s = np.asarray(sets, dtype=bool)
    yt = np.asarray(y_true, dtype=np.int64).ravel()
    if yt.size == 0:
        return float("nan")
    return float(np.mean(s[np.arange(yt.size), yt]))


def per_class_coverage(sets, y_true) -> list:
    """Coverage within each true class: list of K floats (NaN for absent classes)."""
    s = np.asarray(sets, dtype=bool)
    yt = np.asarray(y_true, dtype=np.int64).ravel()
    hit = s[np.arange(yt.size), yt]
    out = []
    for k in range(s.shape[1]):
        m = yt == k
        out.append(float(np.mean(hit[m])) if m.any() else float("nan"))
    return out


def mean_set_size(sets) -> float:
    """Average number of labels per set (bool [N, K]); NaN if N = 0."""
    s = np.asarray(sets, dtype=bool)
    return float(s.sum(axis=1).mean()) if s.shape[0] else float("nan")


# ------------------------------------------------------------------- bootstrap
def _joint_counts(y_true, y_pred, n_classes: int) -> np.ndarray:
    """Counts [K, K + 1] of (true, predicted) pairs; column K holds abstentions."""
    yt = np.asarray(y_true, dtype=np.int64).ravel()
    yp = np.asarray(y_pred, dtype=np.int64).ravel()
    yp = np.where(yp == ABSTAIN, n_classes, yp)
    w = n_classes + 1
    return np.bincount(yt * w + yp, minlength=n_classes * w).reshape(n_classes, w)


def bootstrap_ci(y_true, y_pred, n_classes: int | None = None, n_boot: int = 1000,
                 seed: int = 0, level: float = 0.95, groups=None) -> dict:
    """Percentile bootstrap intervals for MCC (on accepted) and W-MCC.

    y_true: int [N] in [0, K); y_pred: int [N] in [0, K) or -1 (abstained).
    Statements are resampled with replacement, abstained ones included. As
    MCC and W-MCC depend on a resample only through its (true, predicted)
    count table, each resample's table is drawn directly from the
    multinomial distribution with the observed cell frequencies, which has
    exactly the distribution of the table of N statements drawn with
    replacement (1000 resamples cost microseconds, whatever N).

    groups: int [N] or None. Given, the resampling unit is the group (cluster bootstrap: whole
    groups, e.g. all statements about one city, drawn with replacement); each resample's table is
    the sum of the drawn groups' tables.

    Returns {"mcc": (lo, hi), "wmcc": (lo, hi)}; (0.0, 0.0) if N = 0.
    """
    yt = np.asarray(y_true, dtype=np.int64).ravel()
    yp = np.asarray(y_pred, dtype=np.int64).ravel()
    n = yt.size
    if n == 0:
        return {"mcc": (0.0, 0.0), "wmcc": (0.0, 0.0)}
    if n_classes is None:
        n_classes = int(max(yt.max(), yp.max())) + 1
    k = n_classes
    rng = np.random.default_rng(seed)
    if groups is None:
        counts = _joint_counts(yt, yp, k)
        tables = rng.multinomial(n, counts.ravel() / n, size=n_boot).reshape(n_boot, k, k + 1)
    else:
        _, g = np.unique(np.asarray(groups).ravel(), return_inverse=True)
        if g.size != n:
            raise ValueError(f"groups has {g.size} entries for {n} statements")
        n_groups = int(g.max()) + 1
        w = k + 1
        per_group = np.bincount(g * k * w + yt * w + np.where(yp == ABSTAIN, k, yp),
                                minlength=n_groups * k * w).reshape(n_groups, k * w)
        draws = rng.multinomial(n_groups, np.full(n_groups, 1.0 / n_groups), size=n_boot)   # [B, G]
        tables = (draws @ per_group).reshape(n_boot, k, w)
    m = mcc_from_confusion(tables[:, :, :k])
    acc = tables[:, :, :k].sum(axis=(1, 2)) / np.maximum(tables.sum(axis=(1, 2)), 1)
    w = m * acc
    q = [100 * (1 - level) / 2, 100 * (1 + level) / 2]
    lo_m, hi_m = np.percentile(m, q)
    lo_w, hi_w = np.percentile(w, q)
    return {"mcc": (float(lo_m), float(hi_m)), "wmcc": (float(lo_w), float(hi_w))}


def resampling_groups(bootstrap: str, groups):
    """`groups` for bootstrap="cluster" (resample whole groups), None for "iid"; else a one-line error."""
    if bootstrap not in ("cluster", "iid"):
        raise ToolkitError(f"bootstrap={bootstrap!r}: use cluster (resample subject entities) or iid (statements)")
    return None if bootstrap == "iid" else np.asarray(groups)


# ------------------------------------------------------------------ entry point
def json_value(x):
    """Plain float / None (for NaN) / list thereof."""
    if isinstance(x, (list, tuple)):
        return [json_value(v) for v in x]
    if x is None:
        return None
    x = float(x)
    return None if math.isnan(x) else x


def evaluate(y_true, y_pred, scores_or_probs, sets=None, seed: int = 0,
             n_boot: int = 1000, level: float = 0.95, groups=None) -> dict:
    """All metrics of one probe on one evaluation split (keys: module docstring).

    y_true: int [N] in [0, K).
    y_pred: int [N] in [0, K) or -1 (abstained), e.g. from
        ``evaluation.conformal.prediction``; ``None`` = the plain prediction.
    scores_or_probs: [N] probability of the positive class (binary) or
        [N, K] class probabilities.
    sets: optional bool [N, K] conformal prediction sets.
    groups: optional int [N] (e.g. subject entity): bootstrap intervals resample whole groups
        (cluster bootstrap) instead of statements; `bootstrap` says which was used.
    Selective prediction of the plain prediction (evaluation.selective): aurc, eaurc,
    selective_accuracy, confidence_auroc and the risk_coverage curve.
    Returns a dict of plain floats / ints / lists / None.
    """
    yt = np.asarray(y_true, dtype=np.int64).ravel()
    probs = as_probs(scores_or_probs)
    k = probs.shape[1]
    if probs.shape[0] != yt.size:
        raise ValueError(f"y_true has {yt.size} labels but probabilities have {probs.shape[0]} rows")
    if yt.size and (yt.min() < 0 or yt.max() >= k):
        raise ValueError(f"y_true must be in [0, {k}), got labels {np.unique(yt).tolist()}")
    plain = plain_prediction(scores_or_probs)
    yp = plain if y_pred is None else np.asarray(y_pred, dtype=np.int64).ravel()
    if yp.size != yt.size:
        raise ValueError(f"y_true has {yt.size} labels but y_pred has {yp.size}")
    if yp.size and (yp.min() < ABSTAIN or yp.max() >= k):
        raise ValueError(f"y_pred must be in [0, {k}) or -1, got {np.unique(yp).tolist()}")

    ci = bootstrap_ci(yt, yp, k, n_boot=n_boot, seed=seed, level=level, groups=groups)
    ci_all = bootstrap_ci(yt, plain, k, n_boot=n_boot, seed=seed, level=level, groups=groups)
    out = {
        "n": int(yt.size),
        "n_classes": int(k),
        "n_accepted": int(np.sum(yp != ABSTAIN)),
        "mcc_all": json_value(mcc(yt, plain)),
        "accuracy_all": json_value(accuracy(yt, plain)),
        "mcc": json_value(abstain_mcc(yt, yp)),
        "wmcc": json_value(wmcc(yt, yp)),
        "acceptance": json_value(acceptance_rate(yp)),
        "accuracy": json_value(accuracy(yt, yp)),
        "auroc": json_value(auroc(yt, probs if k > 2 else probs[:, 1])),
        "ece": json_value(ece(yt, probs)),
        "coverage": None,
        "per_class_coverage": None,
        "mean_set_size": None,
        "mcc_all_ci": json_value(ci_all["mcc"]),
        "mcc_ci": json_value(ci["mcc"]),
        "wmcc_ci": json_value(ci["wmcc"]),
        "ci_level": float(level),
        "n_boot": int(n_boot),
        "bootstrap": "iid" if groups is None else "cluster",
        "n_groups": None if groups is None else int(len(np.unique(groups))),
        "seed": int(seed),
        **selective_metrics(yt, probs),
    }
    if sets is not None:
        s = np.asarray(sets, dtype=bool)
        if s.shape != probs.shape:
            raise ValueError(f"sets have shape {s.shape}, expected {probs.shape}")
        out["coverage"] = json_value(coverage(s, yt))
        out["per_class_coverage"] = json_value(per_class_coverage(s, yt))
        out["mean_set_size"] = json_value(mean_set_size(s))
    return out
