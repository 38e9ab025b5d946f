"""Fitting and calibrating a probe's heads: the one place `train_probe` and the Python API share.

A probe has one head per class it separates (a binary task: one head, its positive class; the
multiclass task: one head per class, one-vs-all). A `HeadBank` fits each head once per (layer, rows,
split, seed) and hands it to every task that uses it: on the same statements, `true_vs_all`,
`false_vs_all` and `neither_vs_all` use the heads of classes 1, 0 and 2, and `multiclass` stacks
all three, so a layer of the sweep fits three heads (plus their out-of-fold copies), not six.

Sharing never changes a number: each head is seeded by (seed, class, fold) alone, and the grouped
folds of the out-of-fold calibration scores are stratified on the label column (0/1/2), not on a
task's target, so a head and its out-of-fold scores are the same whichever tasks ask for them, and a
cell computed alone equals the same cell derived in a sweep (tests/test_train_probe.py).
"""
from __future__ import annotations

import copy
import logging

import lightning as L
import numpy as np

from evaluation.calibration import ScoreMap
from evaluation.conformal import ConformalClassifier, ReferenceConformal
from probes.base import Probe, kfold_splits
from probes.features import Features

log = logging.getLogger(__name__)
CALIBRATIONS = ("out_of_fold", "out_of_fold_cv", "in_sample")   # what the score map is fitted on (see HeadBank)


def head_seed(seed: int, cls: int, fold: int = -1) -> int:
    """The seed of the head of class `cls` fitted on all training rows (fold -1) or on a fold's part."""
    return int(np.random.SeedSequence([int(seed), int(cls), int(fold) + 1]).generate_state(1)[0])


class HeadBank:
    """The heads of one probe on one set of statements (one layer), each fitted once, on demand.

    template: the unfitted probe (deep-copied per head); features: the statements' features [M, ...]
    with their groups; labels: int [M] class of each statement (the datapack's label column, or any
    0..K-1 coding): head c is fitted on the target labels == c; train: int positions of the training
    statements; calibration_folds: grouped folds for out-of-fold scores (0 = none); seed.

    share_folds: a probe that chooses a hyperparameter by cross-validation runs it on these folds
    (`fit(..., folds=)`), and its fold fits at the chosen value give the out-of-fold scores
    (`held_out_scores_`) instead of one refitted copy per fold, each with its own CV: a quarter of
    the fits with 3 folds, at the cost of a selection leak (the chosen value saw the held-out rows;
    calibration="out_of_fold_cv"). Probes without such a choice (mlp, mean_diff, a fixed C) refit.
    """

    def __init__(self, template: Probe, features: Features, labels: np.ndarray, train: np.ndarray,
                 calibration_folds: int, seed: int, share_folds: bool = False):
        self.template, self.train, self.seed = template, np.asarray(train), int(seed)
        self.features = features.sharing()    # (what heads compute from the same statements, computed once)
        self.share_folds = bool(share_folds)
        self.labels = np.asarray(labels, dtype=np.int64)
        self._heads: dict[int, Probe] = {}
        self._scores: dict[int, np.ndarray] = {}
        self._oof: dict[int, np.ndarray] = {}
        self.folds = self._folds(calibration_folds) if calibration_folds else []

    def _folds(self, n_folds: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Grouped folds of the training statements, stratified on the labels; only folds whose fitting
        part holds every class present in training (so every head can be fitted on every fold)."""
        y = self.labels[self.train]
        groups = None if self.features.groups is None else self.features.groups[self.train]
        classes = np.unique(y)
        folds = [(fit, held) for fit, held in kfold_splits(y, groups, n_folds, self.seed)
                 if len(np.unique(y[fit])) == len(classes)]
        if not folds:
            log.warning("too few groups for out-of-fold calibration scores: the map is fitted in sample")
        return folds

    def _fit(self, cls: int, rows: np.ndarray, fold: int) -> Probe:
        L.seed_everything(head_seed(self.seed, cls, fold), workers=True, verbose=False)
        target = (self.labels[rows] == cls).astype(np.int64)
        folds = {"folds": self.folds} if self.share_folds and fold == -1 and self.folds else {}
        return copy.deepcopy(self.template).fit(self.features.subset(rows), target, **folds)

    def head(self, cls: int) -> Probe:
        """The head of class `cls` fitted on every training statement."""
        if cls not in self._heads:
            self._heads[cls] = self._fit(cls, self.train, -1)
            self._scores[cls] = np.asarray(self._heads[cls].decision_function(self.features), dtype=np.float64)
        return self._heads[cls]

    def scores(self, classes: list[int]) -> np.ndarray:
        """float [M, len(classes)]: the heads' raw scores of every statement."""
        for c in classes:
            self.head(c)
        return np.stack([self._scores[c] for c in classes], axis=1)

    def out_of_fold(self, classes: list[int]) -> tuple[np.ndarray, np.ndarray] | None:
        """(positions [M'], scores [M', len(classes)]): the training statements held out by the folds,
        each scored by copies of the heads fitted on its fold's fitting part; None without folds."""
        if not self.folds:
            return None
        for c in classes:
            shared = getattr(self.head(c), "held_out_scores_", None) if self.share_folds else None
            if c not in self._oof and shared is not None:
                self._oof[c] = np.concatenate([shared[held] for _, held in self.folds])
            elif c not in self._oof:
                self._oof[c] = np.concatenate([
                    np.asarray(self._fit(c, self.train[fit], f).decision_function(self.features.subset(self.train[held])),
                               dtype=np.float64) for f, (fit, held) in enumerate(self.folds)])
        rows = np.concatenate([self.train[held] for _, held in self.folds])
        return rows, np.stack([self._oof[c] for c in classes], axis=1)


def calibrate(scores: np.ndarray, y: np.ndarray, train: np.ndarray, cal: np.ndarray,
              oof: tuple[np.ndarray, np.ndarray] | None, n_folds: int, calibration: str, alpha: float,
              conformal: str = "lac", mondrian: bool = False):
    """Scores -> probabilities -> conformal sets, as every cell does.

    scores float [M, H] raw head scores of all statements; y int [M] task targets; train / cal int
    positions; oof: out-of-fold (positions, scores) from `n_folds` folds, used for the map when
    calibration="out_of_fold" / "out_of_fold_cv" (None: the map is fitted on the heads' own training scores).
    Returns (score_map, conformal predictor, the cell's calibration summary); the predictor reads
    `conformal_input(scores, probs, conformal)`."""
    use_oof = calibration.startswith("out_of_fold") and oof is not None
    map_rows, map_scores = oof if use_oof else (train, scores[train])
    score_map = ScoreMap().fit(map_scores, y[map_rows])
    kind = calibration if use_oof else (
        "in_sample" if calibration == "in_sample" else "in_sample (too few groups for out-of-fold scores)")
    summary = {"kind": kind, "n_folds": n_folds if use_oof else 0, "n_rows": int(len(map_rows)),
               "map": score_map.to_dict()}
    classes = int(y.max()) + 1
    values = conformal_input(scores, score_map.predict_proba(scores), conformal)
    if conformal == "reference":  # exp(-(2y-1) f) on raw binary scores; margin on the stacker's probabilities
        predictor = ReferenceConformal("symmetric" if classes == 2 else "margin", classes).fit(
            values[cal], y[cal], alpha=alpha)
    else:
        predictor = ConformalClassifier().fit(values[cal], y[cal], alpha=alpha, mondrian=mondrian)
    return score_map, predictor, summary


def conformal_input(scores: np.ndarray, probs: np.ndarray, conformal: str) -> np.ndarray:
    """What the conformal predictor reads: the raw score [N] of a binary head under the reference
    procedure, the class probabilities [N, K] otherwise."""
    return scores[:, 0] if conformal == "reference" and probs.shape[1] == 2 else probs
