"""Split-conformal prediction sets, so that a probe can abstain.

Label coding: 0 = false, 1 = true, 2 = neither (binary probes: 0/1).

Input is class probabilities ``probs`` [N, K] (K = 2 for binary probes,
K = 3 for multiclass), produced elsewhere by a map fitted on the training
split; :func:`binary_probs` turns a positive-class probability [N] into [N, 2].

Method (LAC, "least ambiguous set-valued classifier"):

- nonconformity of label y for a statement: ``s = 1 - p(y)``;
- on the n calibration statements, the threshold ``q`` is the k-th smallest
  score with ``k = ceil((n + 1) * (1 - alpha))`` (the finite-sample
  corrected quantile; equals ``np.quantile(scores, k / n,
  method="inverted_cdf")``). If ``k > n`` the split is too small and a
  ValueError says so;
- the set of a new statement holds every label y with ``1 - p(y) <= q``;
  for exchangeable data it contains the true label with probability
  >= 1 - alpha (marginal mode);
- Mondrian (class-conditional) mode: one threshold per class, computed on
  the calibration statements of that class only, so that the guarantee holds
  within each true class.

:func:`prediction` turns sets into labels: the single label of a one-label
set, -1 (abstain) for an empty set or a set with several labels.

The reference procedure (carlomarxdk/trilemma-of-truth, ``probes/conformal.py``), on demand
(:class:`ReferenceConformal`, ``conformal=reference``): conformal p-values
``p_y = (#{calibration scores >= s_y} + 1) / (n + 1)``, label y in the set iff ``p_y > alpha``,
with one of two nonconformity scores:

- ``symmetric``: ``exp(-(2y - 1) f)`` on a raw binary score ``f`` (its binary probes);
- ``margin``: ``(1 - (p_y - max_{k != y} p_k)) / 2`` on a probability-like vector (its multiclass
  probes; its zero-shot evaluation, on the four unnormalised group masses false / true / neither /
  abstain, so "abstain" is class 3 and a one-label set {3} counts as an accepted prediction 3).

A multi-label set abstains, or with ``tie_breaking`` becomes label 0 if ``p_0 > p_1`` else 1
(the reference's zero-shot evaluation; its probes run without it). For exchangeable data
``p_y > alpha`` covers the truth with probability >= 1 - alpha too; the difference to LAC is the
score, not the guarantee. :func:`acceptance_by_label` counts accepted predictions per label.

Example::

    cp = ConformalClassifier().fit(cal_probs, cal_labels, alpha=0.1)
    sets = cp.predict_sets(test_probs)          # bool [M, K]
    y_hat = prediction(sets)                    # int [M], -1 = abstained
    json_cell = cp.to_dict()
"""

from __future__ import annotations

import math

import numpy as np

from toolkit.errors import ToolkitError
from evaluation.metrics import acceptance_rate, coverage, mean_set_size, per_class_coverage

__all__ = [
    "ConformalClassifier",
    "ReferenceConformal",
    "acceptance_by_label",
    "binary_probs",
    "conformal_rank",
    "conformal_threshold",
    "prediction",
    "coverage",
    "acceptance_rate",
    "per_class_coverage",
    "mean_set_size",
]

CLASS_NAMES = {0: "false", 1: "true", 2: "neither"}


def binary_probs(p_pos) -> np.ndarray:
    """Positive-class probabilities [N] -> class probabilities [N, 2] = [1 - p, p]."""
    p = np.asarray(p_pos, dtype=np.float64).ravel()
    return np.stack([1.0 - p, p], axis=1)


def conformal_rank(n: int, alpha: float) -> int:
    """k = ceil((n + 1) * (1 - alpha)): the order statistic used as threshold."""
    # the small epsilon keeps e.g. (9 + 1) * 0.9 = 9.000000000000002 at 9
    return int(math.ceil((n + 1) * (1.0 - alpha) - 1e-9))


def _min_calibration_size(alpha: float) -> int:
    """Smallest n with conformal_rank(n, alpha) <= n, i.e. n >= (1 - alpha) / alpha."""
    n = max(1, int(math.floor((1.0 - alpha) / alpha)))
    while conformal_rank(n, alpha) > n:
        n += 1
    while n > 1 and conformal_rank(n - 1, alpha) <= n - 1:
        n -= 1
    return n


def conformal_threshold(scores, alpha: float, what: str = "calibration split") -> float:
    """Finite-sample corrected (1 - alpha) quantile of nonconformity scores [n].

    Returns the k-th smallest score, k = ceil((n + 1)(1 - alpha)). Raises
    ValueError if k > n (too few calibration statements for this alpha).
    """
    s = np.sort(np.asarray(scores, dtype=np.float64).ravel())
    n = s.size
    k = conformal_rank(n, alpha)
    if k > n:
        # (k <= n holds for alpha >= 1 / (n + 1): a larger alpha needs fewer statements)
        fix = f"raise alpha to at least {math.ceil(1000 / (n + 1)) / 1000:g} or " if n else ""
        raise ConformalError(
            f"{what} has {n} statements, alpha={alpha:g} needs at least "
            f"{_min_calibration_size(alpha)}: {fix}enlarge the calibration split"
        )
    return float(s[k - 1])


def prediction(sets) -> np.ndarray:
    """Sets bool [M, K] -> int [M]: the label of one-label sets, -1 (abstain) otherwise."""
    s = np.asarray(sets, dtype=bool)
    single = s.sum(axis=1) == 1
    return np.where(single, np.argmax(s, axis=1), -1).astype(np.int64)


class ConformalError(ToolkitError):
    """A calibration split or level that cannot give valid conformal sets."""


PROCEDURES = ("lac", "reference")   # LAC sets (ConformalClassifier) | the reference code's p-values (ReferenceConformal)


def check_procedure(name: str, mondrian: bool = False) -> str:
    """`name` if it is a conformal procedure that can run with `mondrian` (class-conditional
    thresholds: LAC only), else one ConformalError line."""
    if name not in PROCEDURES:
        raise ConformalError(f"conformal={name!r}: use lac or reference")
    if name == "reference" and mondrian:
        raise ConformalError("mondrian=true has no counterpart in conformal=reference: use one of them")
    return name


class ConformalClassifier:
    """Split-conformal (LAC) set predictor on class probabilities.

    After :meth:`fit`: ``thresholds_`` float [K] is the nonconformity
    threshold per label (all equal in marginal mode); label y enters the set
    of a statement iff ``1 - p(y) <= thresholds_[y]``.
    """

    def __init__(self):
        self.alpha: float | None = None
        self.mondrian: bool = False
        self.n_classes: int | None = None
        self.thresholds_: np.ndarray | None = None
        self.n_cal_: int | None = None
        self.n_cal_per_class_: list | None = None

    def fit(self, cal_probs, cal_labels, alpha: float = 0.1, mondrian: bool = False):
        """Calibrate on probabilities [N, K] and true labels int [N] in [0, K).

        alpha: miscoverage level in (0, 1); mondrian: one threshold per class.
        Returns self. Raises ValueError if the calibration split (or a class
        of it, in Mondrian mode) is too small for alpha.
        """
        p = np.asarray(cal_probs, dtype=np.float64)
        y = np.asarray(cal_labels, dtype=np.int64).ravel()
        if p.ndim != 2:
            raise ValueError(f"cal_probs must be [N, K], got shape {p.shape}; use binary_probs() for [N]")
        if p.shape[0] != y.size:
            raise ValueError(f"cal_probs has {p.shape[0]} rows but cal_labels has {y.size}")
        if not 0.0 < alpha < 1.0:
            raise ConformalError(f"alpha={alpha}: use a miscoverage level in (0, 1), e.g. alpha=0.1")
        k = p.shape[1]
        if y.size and (y.min() < 0 or y.max() >= k):
            raise ValueError(f"cal_labels must be in [0, {k}), got {np.unique(y).tolist()}")
        scores = 1.0 - p[np.arange(y.size), y]
        counts = np.bincount(y, minlength=k)
        if mondrian:
            thr = np.array([
                conformal_threshold(
                    scores[y == c], alpha,
                    what=f"calibration split class {c} ({CLASS_NAMES.get(c, c)})")
                for c in range(k)
            ])
        else:
            thr = np.full(k, conformal_threshold(scores, alpha))
        self.alpha = float(alpha)
        self.mondrian = bool(mondrian)
        self.n_classes = int(k)
        self.thresholds_ = thr
        self.n_cal_ = int(y.size)
        self.n_cal_per_class_ = [int(c) for c in counts]
        return self

    def _check_fitted(self):
        if self.thresholds_ is None:
            raise RuntimeError("ConformalClassifier is not fitted: call fit() first")

    def predict_sets(self, probs) -> np.ndarray:
        """Probabilities [M, K] -> prediction sets bool [M, K]."""
        self._check_fitted()
        p = np.asarray(probs, dtype=np.float64)
        if p.ndim != 2 or p.shape[1] != self.n_classes:
            raise ValueError(f"probs must be [M, {self.n_classes}], got shape {p.shape}")
        return (1.0 - p) <= self.thresholds_[None, :]

    def predict(self, probs) -> np.ndarray:
        """Probabilities [M, K] -> int [M]: single label, or -1 to abstain."""
        return prediction(self.predict_sets(probs))

    def report(self, probs, labels) -> dict:
        """Coverage, acceptance, per-class coverage and mean set size on a labelled split."""
        sets = self.predict_sets(probs)
        return {
            "coverage": coverage(sets, labels),
            "acceptance": acceptance_rate(prediction(sets)),
            "per_class_coverage": per_class_coverage(sets, labels),
            "mean_set_size": mean_set_size(sets),
        }

    def to_dict(self) -> dict:
        """JSON-serialisable state (for a result cell); inverse of from_dict."""
        self._check_fitted()
        return {
            "method": "split-conformal LAC (score 1 - p(y))",
            "alpha": self.alpha,
            "mondrian": self.mondrian,
            "n_classes": self.n_classes,
            "thresholds": [float(t) for t in self.thresholds_],
            "n_cal": self.n_cal_,
            "n_cal_per_class": list(self.n_cal_per_class_),
        }

    @classmethod
    def from_dict(cls, d: dict) -> "ConformalClassifier":
        """Rebuild a fitted classifier from :meth:`to_dict` output; a state it cannot have produced (a
        key missing, NaN or out-of-range thresholds, alpha outside (0, 1)) is one ConformalError."""
        _check_state(d, {"alpha": _is_level, "mondrian": _is_bool, "n_classes": _is_n_classes}, "LAC")
        thresholds = np.asarray(_number_list(d, "thresholds"), dtype=np.float64)
        if len(thresholds) != d["n_classes"] or not ((thresholds >= -1e-9) & (thresholds <= 1 + 1e-9)).all():
            raise ConformalError(f"conformal.thresholds={d['thresholds']}: a LAC state has {d['n_classes']} "
                                 "thresholds in [0, 1] (1 - p); this one was not written by fit()")
        cp = cls()
        cp.alpha = float(d["alpha"])
        cp.mondrian = d["mondrian"]
        cp.n_classes = int(d["n_classes"])
        cp.thresholds_ = thresholds
        cp.n_cal_ = d.get("n_cal")
        cp.n_cal_per_class_ = d.get("n_cal_per_class")
        return cp


NONCONFORMITY = ("symmetric", "margin")


def _is_level(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0.0 < v < 1.0


def _is_bool(v) -> bool:
    return isinstance(v, bool)


def _is_n_classes(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 2


def _is_nonconformity(v) -> bool:
    return v in NONCONFORMITY


_EXPECTED = {_is_level: "a level in (0, 1)", _is_bool: "true or false", _is_n_classes: "a whole number >= 2",
             _is_nonconformity: " or ".join(NONCONFORMITY)}


def _check_state(d, checks: dict, kind: str) -> None:
    """A saved conformal state's scalar entries, each checked by its predicate (one ConformalError)."""
    if not isinstance(d, dict):
        raise ConformalError(f"conformal={d!r}: not a saved {kind} conformal state")
    for key, ok in checks.items():
        if key not in d:
            raise ConformalError(f"conformal.{key} is missing: not a saved {kind} conformal state")
        if not ok(d[key]):
            raise ConformalError(f"conformal.{key}={d[key]!r}: a saved {kind} state holds {_EXPECTED[ok]}")


def _number_list(d: dict, key: str) -> list:
    """d[key] as a non-empty list of numbers without NaN (one ConformalError otherwise)."""
    values = d.get(key)
    if not isinstance(values, list) or not values or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v) for v in values):
        shown = values if len(repr(values)) < 80 else f"{repr(values)[:80]}..."
        raise ConformalError(f"conformal.{key}={shown}: a saved conformal state holds a non-empty list of "
                             "numbers, without NaN")
    return values


def acceptance_by_label(y_pred, n_labels: int) -> dict:
    """Accepted predictions [M] (-1 = abstained) per label, and whether only one label is ever
    accepted (then MCC on the accepted statements is 0 whatever the scores: a one-label probe)."""
    yp = np.asarray(y_pred, dtype=np.int64).ravel()
    counts = np.bincount(yp[yp >= 0], minlength=n_labels)
    return {"accepted_per_label": {str(k): int(c) for k, c in enumerate(counts)},
            "single_label_accepted": bool((counts > 0).sum() == 1)}


def nonconformity(values: np.ndarray, labels: np.ndarray, score: str) -> np.ndarray:
    """The reference's nonconformity of `labels` [N]: ``symmetric`` on raw scores [N], ``margin`` on
    probabilities [N, K] (float64, the reference's arithmetic, so ties with it are exact)."""
    y = np.asarray(labels, dtype=np.int64).ravel()
    v = np.asarray(values, dtype=np.float64)
    if score == "symmetric":
        return np.exp(-(2 * y - 1) * v.ravel())
    rows = np.arange(len(y))
    others = v.copy()
    others[rows, y] = -np.inf
    return (1.0 - (v[rows, y] - others.max(axis=1))) / 2


class ReferenceConformal:
    """The reference's inductive conformal predictor (module docstring): p-values, ``p > alpha``.

    Input `values`: raw binary scores [N] (``symmetric``) or probabilities [N, K] (``margin``).
    After :meth:`fit`: ``calibration_scores_`` float [n] (sorted).
    """

    def __init__(self, score: str, n_classes: int, tie_breaking: bool = False):
        if score not in NONCONFORMITY:
            raise ValueError(f"score must be one of {NONCONFORMITY}, got {score!r}")
        self.score, self.n_classes, self.tie_breaking = score, int(n_classes), bool(tie_breaking)
        self.alpha: float | None = None
        self.calibration_scores_: np.ndarray | None = None

    def fit(self, cal_values, cal_labels, alpha: float = 0.1) -> "ReferenceConformal":
        if not 0.0 < alpha < 1.0:
            raise ConformalError(f"alpha={alpha}: use a miscoverage level in (0, 1), e.g. alpha=0.1")
        y = np.asarray(cal_labels, dtype=np.int64).ravel()
        if len(y) == 0:
            raise ConformalError("the calibration split is empty: enlarge it")
        self.alpha = float(alpha)
        self.calibration_scores_ = np.sort(nonconformity(cal_values, y, self.score))
        return self

    def p_values(self, values) -> np.ndarray:
        """[M, n_classes]: p_y = (#{calibration scores >= s_y} + 1) / (n + 1) for every label y."""
        if self.calibration_scores_ is None:
            raise RuntimeError("ReferenceConformal is not fitted: call fit() first")
        cal = self.calibration_scores_
        m = len(np.asarray(values))
        out = np.empty((m, self.n_classes))
        for c in range(self.n_classes):
            s = nonconformity(values, np.full(m, c), self.score)
            out[:, c] = (len(cal) - np.searchsorted(cal, s, side="left") + 1) / (len(cal) + 1)
        return out

    def predict_sets(self, values) -> np.ndarray:
        """bool [M, n_classes]: the labels with p-value above alpha."""
        return self.p_values(values) > self.alpha

    def predict(self, values) -> np.ndarray:
        """int [M]: a one-label set's label; empty -> -1; several -> -1, or with tie_breaking 0 if
        p_0 > p_1 else 1."""
        p = self.p_values(values)
        sets = p > self.alpha
        pred = prediction(sets)
        if self.tie_breaking:
            pred = np.where(sets.sum(1) > 1, np.where(p[:, 0] > p[:, 1], 0, 1), pred)
        return pred.astype(np.int64)

    def to_dict(self) -> dict:
        """JSON-serialisable summary (for a result cell)."""
        return {"method": f"reference ICP (p-values, {self.score} nonconformity"
                          f"{', tie-breaking' if self.tie_breaking else ''})",
                "alpha": self.alpha, "n_classes": self.n_classes, "tie_breaking": self.tie_breaking,
                "nonconformity": self.score, "n_cal": int(len(self.calibration_scores_)),
                "calibration_scores": self.calibration_scores_.tolist()}

    @classmethod
    def from_dict(cls, d: dict) -> "ReferenceConformal":
        """Rebuild a fitted predictor from :meth:`to_dict` output; a state it cannot have produced (a key
        missing, NaN or unsorted calibration scores, alpha outside (0, 1)) is one ConformalError."""
        _check_state(d, {"alpha": _is_level, "tie_breaking": _is_bool, "n_classes": _is_n_classes,
                         "nonconformity": _is_nonconformity}, "reference")
        scores = np.asarray(_number_list(d, "calibration_scores"), dtype=np.float64)
        if bool((np.diff(scores) < 0).any()):
            raise ConformalError("conformal.calibration_scores are not sorted: this state was not written by fit()")
        cp = cls(d["nonconformity"], d["n_classes"], d["tie_breaking"])
        cp.alpha, cp.calibration_scores_ = float(d["alpha"]), scores
        return cp
