"""Score -> probability map: a logistic regression from a probe's standardised scores to class probabilities.

Binary tasks: scores [N, 1] -> probabilities [N, 2] (false, true); multiclass: the three one-vs-all
heads' scores [N, 3] -> [N, 3] (multinomial logistic regression, the "stacker").

Scores are standardised (mean 0, std 1 per column, on the rows the map is fitted on) before the
regression, so the map does not depend on the probe's score scale: scores x 1e-7 give the same
probabilities. Which rows it is fitted on is the caller's choice (probes/pipeline.py: out-of-fold
training scores by default, so the map never sees a score of a probe fitted on the same row).
"""
from __future__ import annotations

import numpy as np
from sklearn.linear_model import LogisticRegression

from evaluation.conformal import binary_probs


class ScoreMap:
    """Fitted on scores of labelled rows; `predict_proba` gives [N, K] probabilities (K = 2 for binary)."""

    def fit(self, scores: np.ndarray, y: np.ndarray) -> "ScoreMap":
        """scores float [N, H], y int [N] in 0..K-1."""
        scores = np.asarray(scores, dtype=np.float64)
        self.mean_ = scores.mean(0)
        std = scores.std(0)
        self.scale_ = np.where(std > 0, std, 1.0)   # a constant column stays constant (0 after centring)
        model = LogisticRegression(C=1e4, max_iter=1000).fit(self._standardise(scores), y)
        self.coef_, self.intercept_ = model.coef_, model.intercept_   # [1, H] / [K, H], [1] / [K]
        return self

    def _standardise(self, scores: np.ndarray) -> np.ndarray:
        return (np.asarray(scores, dtype=np.float64) - self.mean_) / self.scale_

    def predict_proba(self, scores: np.ndarray) -> np.ndarray:
        """[N, K]: sigmoid of the one logit (binary) or softmax of the K logits, as scikit-learn's."""
        logits = self._standardise(scores) @ self.coef_.T + self.intercept_
        if logits.shape[1] == 1:
            return binary_probs(1.0 / (1.0 + np.exp(-logits[:, 0])))
        logits -= logits.max(1, keepdims=True)
        e = np.exp(logits)
        return e / e.sum(1, keepdims=True)

    def to_dict(self) -> dict:
        """JSON-serialisable state (for a result cell): standardiser and regression coefficients."""
        return {"mean": self.mean_.tolist(), "scale": self.scale_.tolist(),
                "coef": self.coef_.tolist(), "intercept": self.intercept_.tolist()}

    @classmethod
    def from_dict(cls, d: dict) -> "ScoreMap":
        m = cls()
        m.mean_, m.scale_ = np.asarray(d["mean"]), np.asarray(d["scale"])
        m.coef_, m.intercept_ = np.asarray(d["coef"]), np.asarray(d["intercept"])
        return m
