"""Score -> probability map: a logistic regression from a probe's scores to class probabilities.

Binary tasks: scores [N, 1] -> probabilities [N, 2] (false, true); multiclass: the three one-vs-all
heads' scores [N, 3] -> [N, 3] (multinomial logistic regression, the "stacker").
"""
from __future__ import annotations

import numpy as np
from sklearn.linear_model import LogisticRegression

from evaluation.conformal import binary_probs


class ScoreMap:
    """Fitted on training scores; `predict_proba` gives [N, K] probabilities (K = 2 for binary)."""

    def fit(self, scores: np.ndarray, y: np.ndarray) -> "ScoreMap":
        """scores float [N, H], y int [N] in 0..K-1."""
        self.model_ = LogisticRegression(C=1e4, max_iter=1000).fit(scores, y)
        return self

    def predict_proba(self, scores: np.ndarray) -> np.ndarray:
        probs = self.model_.predict_proba(scores)
        return binary_probs(probs[:, 1]) if probs.shape[1] == 2 else probs
