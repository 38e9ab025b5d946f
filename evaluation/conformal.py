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

Example::

    cp = ConformalClassifier().fit(cal_probs, cal_labels, alpha=0.1)
    sets = cp.predict_sets(test_probs)          # bool [M, K]
    y_hat = prediction(sets)                    # int [M], -1 = abstained
    json_cell = cp.to_dict()
"""

from __future__ import annotations

import math

import numpy as np

from extract.errors import ToolkitError
from evaluation.metrics import acceptance_rate, coverage, mean_set_size, per_class_coverage

__all__ = [
    "ConformalClassifier",
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
        raise ConformalError(
            f"{what} has {n} statements, alpha={alpha:g} needs at least "
            f"{_min_calibration_size(alpha)}: lower alpha or enlarge the calibration split"
        )
    return float(s[k - 1])


def prediction(sets) -> np.ndarray:
    """Sets bool [M, K] -> int [M]: the label of one-label sets, -1 (abstain) otherwise."""
    s = np.asarray(sets, dtype=bool)
    single = s.sum(axis=1) == 1
    return np.where(single, np.argmax(s, axis=1), -1).astype(np.int64)


class ConformalError(ToolkitError):
    """A calibration split or level that cannot give valid conformal sets."""


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
        """Rebuild a fitted classifier from :meth:`to_dict` output."""
        cp = cls()
        cp.alpha = float(d["alpha"])
        cp.mondrian = bool(d["mondrian"])
        cp.n_classes = int(d["n_classes"])
        cp.thresholds_ = np.asarray(d["thresholds"], dtype=np.float64)
        cp.n_cal_ = d.get("n_cal")
        cp.n_cal_per_class_ = d.get("n_cal_per_class")
        return cp
