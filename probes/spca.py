"""Supervised PCA as the Trilemma of Truth reference code defines it (probes/spca.py and runners/runner_spca.py of
carlomarxdk/trilemma-of-truth): an eigenbasis of class-aware second moments, then a logistic regression on the
whitened leading components.

On standardised training vectors z (per-feature mean / std, the reference's StandardScaler), with n_c rows, mean
mu_c and OAS-shrunk covariance S_c (sklearn's `oas` of the class-centred rows, assume_centered) per class c,
mu the overall mean:

    S_w = sum_c n_c S_c / n                                   within-class covariance
    S_b = sum_c n_c (mu_c - mu)(mu_c - mu)^T / n              between-class covariance
    M   = S_w + S_b + reg I,   M v_j = lambda_j v_j,  lambda_1 >= lambda_2 >= ...
    u_j = (z . v_j) / sqrt(lambda_j),  j = 1..k               whitened scores of the k leading components
    decision = w . u + b,   (w, b) = argmin sum_i log(1 + exp(-t_i (w . u_i + b))) + ||w||^2 / (2 C)

(sklearn's LogisticRegression(C), unweighted, the reference's base model), folded into one affine map of x.
With the empirical covariance (cov_type="empirical") S_w + S_b is the total covariance, so the basis is ordinary
PCA's and only the classifier sees the labels; OAS shrinkage of each class makes the two differ.

k (n_components) is chosen, when not given, as the reference does: the held-out average precision of each k of
the grid on `cv_folds` folds, then the smallest k whose mean is within one standard error (std / sqrt(folds)) of
the best; our folds are grouped (probes.base.kfold_splits, statements sharing an entity in one fold) where the
reference's are plain 3-fold KFold. Grid values >= d are dropped (the reference's eigensolver refuses them).
"""
from __future__ import annotations

import numpy as np
import torch
from sklearn.covariance import oas
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import average_precision_score

from probes.base import (ProbeError, check_choice, check_positive, draw_seed, kfold_splits, resolve_device,
                         standardiser)
from probes.direction import DirectionProbe
from probes.features import Features, statement_vectors

__all__ = ["SupervisedPCAProbe", "spca_basis"]


def spca_basis(Z: torch.Tensor, y: np.ndarray, cov_type: str = "oas", reg: float = 1e-8
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(eigenvalues float64 [d] descending, eigenvectors [d, d] as columns) of M = S_w + S_b + reg I (see the
    module docstring) for rows Z [N, d] with labels y [N] in {0, 1}."""
    Z = Z.double()
    yt = torch.as_tensor(np.asarray(y), device=Z.device)
    n, d = Z.shape
    mu = Z.mean(0)
    M = reg * torch.eye(d, dtype=Z.dtype, device=Z.device)
    for c in (0, 1):
        Zc = Z[yt == c]
        centred = Zc - Zc.mean(0)
        if cov_type == "oas":
            S = torch.as_tensor(oas(centred.cpu().numpy(), assume_centered=True)[0], device=Z.device)
        else:
            S = centred.T @ centred / len(Zc)
        gap = (Zc.mean(0) - mu)[:, None]
        M += len(Zc) / n * (S + gap @ gap.T)
    values, vectors = torch.linalg.eigh(0.5 * (M + M.T))
    return values.flip(0), vectors.flip(1)


def _classifier(U: np.ndarray, y: np.ndarray, C: float, max_iter: int) -> LogisticRegression:
    return LogisticRegression(C=float(C), max_iter=max_iter).fit(U, y)


class SupervisedPCAProbe(DirectionProbe):
    """Supervised PCA: logistic regression on the k leading whitened components of M = S_w + S_b.

    Args:
        n_components: k; None -> chosen from `grid` by grouped cross-validation with the one-standard-error rule.
        grid: the k searched (the reference's: 1, 10, 100, 500, 1000, 1500, 2000); values >= d are dropped.
        cov_type: "oas" (the reference's default) or "empirical" per-class covariances.
        reg: ridge added to M's diagonal (the reference's cov_reg).
        C: inverse L2 strength of the logistic regression (the reference's lr_reg).
        cv_folds: folds of the search; seed: their seed (None -> drawn from torch's global generator).
        max_iter: lbfgs iterations of each logistic regression.
        representation: "last" or "mean" statement vectors; tokens: "statement" or "all" (see LinearProbe).
        accelerator: device of the eigendecompositions ("auto" -> cuda when available).

    Given `folds` (fit(..., folds=)), the search runs on them and `held_out_scores_` holds each held part's
    scores at the chosen k. `n_iter_`: lbfgs iterations of the final logistic regression.
    """

    def __init__(self, n_components: int | None = None, grid=(1, 10, 100, 500, 1000, 1500, 2000),
                 cov_type: str = "oas", reg: float = 1e-8, C: float = 1.0, cv_folds: int = 3,
                 seed: int | None = None, max_iter: int = 3000, representation: str = "last",
                 accelerator: str = "auto", tokens: str = "statement"):
        super().__init__()
        self.n_components, self.grid, self.cov_type, self.reg, self.C = n_components, tuple(grid), cov_type, reg, C
        self.cv_folds, self.seed, self.max_iter = cv_folds, seed, max_iter
        self.representation, self.accelerator, self.tokens = representation, accelerator, tokens
        self._readout_state()

    def _check_params(self) -> None:
        super()._check_params()
        check_choice("cov_type", self.cov_type, ("oas", "empirical"))
        for k in ([] if self.n_components is None else [self.n_components]) + list(self.grid):
            check_positive("n_components" if self.n_components is not None else "grid", k, integer=True)
        check_positive("reg", self.reg, allow_zero=True)
        check_positive("C", self.C)
        for name in ("cv_folds", "max_iter"):
            check_positive(name, getattr(self, name), integer=True)

    def _fit_at(self, X: torch.Tensor, y: np.ndarray, ks: list[int]) -> dict[int, tuple[torch.Tensor, float]]:
        """{k: (w float64 [d], b)} with decision X @ w + b, for each k, from one eigendecomposition of X's rows."""
        mean, std = (t.to(X) for t in standardiser(X))
        values, vectors = spca_basis((X - mean) / std, y, self.cov_type, float(self.reg))
        U = ((X - mean) / std) @ vectors[:, :max(ks)] / values[:max(ks)].clamp(min=1e-12).sqrt()
        fits = {}
        for k in ks:
            model = _classifier(U[:, :k].cpu().numpy(), y, self.C, self.max_iter)
            a = torch.as_tensor(model.coef_[0], device=X.device)
            w = vectors[:, :k] @ (a / values[:k].clamp(min=1e-12).sqrt()) / std
            fits[k] = (w, float(model.intercept_[0]) - float(w @ mean))
            self.n_iter_ = int(model.n_iter_[0])     # (of the last fit: the final one after a search)
        return fits

    @torch.no_grad()
    def _fit(self, train: Features, y: np.ndarray, folds: list | None = None) -> "SupervisedPCAProbe":
        X = statement_vectors(train, self.representation).to(device=resolve_device(self.accelerator),
                                                               dtype=torch.float64)
        d = X.shape[1]
        ks = [self.n_components] if self.n_components is not None else sorted({k for k in self.grid if k < d} or {1})
        ks = [min(k, d) for k in ks]
        params = {"cov_type": self.cov_type, "C": float(self.C), "representation": self.representation}
        k, shared = ks[0], folds is not None
        if len(ks) > 1:
            if folds is None:
                groups = None if train.groups is None else np.asarray(train.groups)
                folds = kfold_splits(y, groups, int(self.cv_folds), draw_seed(self.seed))
            if not folds:
                raise ProbeError(f"probe=spca: too few statements or groups for {self.cv_folds} search folds: set "
                                 "n_components")
            k, params["grid"], params["cv_average_precision"], held = self._search(X, y, ks, folds)
            if shared:
                self.held_out_scores_ = held[k]
        (w, b), = self._fit_at(X, y, [k]).values()
        self.direction = w.float().cpu()
        self.threshold = torch.as_tensor(b, dtype=torch.float32)
        self._params = {**params, "n_components": int(k)}
        return self

    def _search(self, X: torch.Tensor, y: np.ndarray, ks: list[int], folds: list):
        """(chosen k, grid, mean held-out average precision per k, {k: held-out scores [N], NaN elsewhere})."""
        ap = np.zeros((len(folds), len(ks)))
        held = {k: np.full(len(y), np.nan) for k in ks}
        for f, (fit, out) in enumerate(folds):
            for j, (k, (w, b)) in enumerate(self._fit_at(X[fit], y[fit], ks).items()):
                scores = (X[out] @ w + b).cpu().numpy()
                held[k][out] = scores
                ap[f, j] = average_precision_score(y[out], scores) if len(np.unique(y[out])) == 2 else np.nan
        mean, se = np.nanmean(ap, 0), np.nanstd(ap, 0) / np.sqrt(len(folds))
        best = int(np.nanargmax(mean))
        chosen = next(k for k, m in zip(ks, mean) if m >= mean[best] - se[best])
        return chosen, ks, [round(float(m), 6) for m in mean], held
