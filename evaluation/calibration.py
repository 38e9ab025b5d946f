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
        self.model_ = LogisticRegression(C=1e4, max_iter=1000).fit(self._standardise(scores), y)
        return self

    def _standardise(self, scores: np.ndarray) -> np.ndarray:
        return (np.asarray(scores, dtype=np.float64) - self.mean_) / self.scale_

    def predict_proba(self, scores: np.ndarray) -> np.ndarray:
        probs = self.model_.predict_proba(self._standardise(scores))
        return binary_probs(probs[:, 1]) if probs.shape[1] == 2 else probs

    def to_dict(self) -> dict:
        """JSON-serialisable state (for a result cell): standardiser and regression coefficients."""
        return {"mean": self.mean_.tolist(), "scale": self.scale_.tolist(),
                "coef": self.model_.coef_.tolist(), "intercept": self.model_.intercept_.tolist()}
