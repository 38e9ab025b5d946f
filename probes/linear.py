"""Linear probe: L2-regularised logistic regression (or squared-hinge linear SVM) on one vector per
statement, with the regularisation strength chosen by grouped k-fold cross-validation.

Objective (per fit, on standardised features z_i, labels t_i in {-1, +1}, sample weights s_i):

    (1 / n) * sum_i s_i * l(t_i * (w . z_i + b))  +  ||w||^2 / (2 * C * n)

with l(m) = log(1 + exp(-m)) (logistic) or max(0, 1 - m)^2 (squared hinge). This is sklearn's
`LogisticRegression(C=C)` objective divided by C * n, so it has the same minimiser; the bias is not
penalised. Each cross-validation fit standardises on its fold's training part and balances the
classes of that part.

Solver: every fit of a `fit` call (each fold of the cross-validation and the final fit on all
training statements) at every C of the grid is solved in ONE `lightning.Trainer` fit, batched:
all fits are written in one coordinate system (the final fit's standardisation; a fold's own
standardisation is an affine map of it, which changes the penalty to a per-feature one and leaves
the minimiser the same), and solved along increasing C, each C warm-started from the previous one's
solutions, by truncated Newton: exact gradients and Hessian-vector products, each Newton step solved
by conjugate gradients preconditioned with the Cholesky factors [fits, d+1, d+1] of each fit's
Hessian taken with the final fit's curvature at the warm start (one Gram matrix per C for all fits),
Armijo backtracking on each fit. The squared hinge uses its generalised Hessian (curvature 2 where
the margin is below 1), which jumps as the support set changes, so it takes exact Newton steps: each
fit's own Hessian, factored at every iteration.
"""
from __future__ import annotations

import warnings

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.metrics import matthews_corrcoef
from torch.utils.data import DataLoader

from probes.base import (Probe, balanced_weights, check_choice, check_positive, draw_seed,
                         kfold_splits, standardiser)
from probes.grid import beyond_grid, check_C_grid, middle_of_grid
from probes.features import Features, statement_vectors
from probes.trainer import FullBatch, make_trainer, quiet_lightning

__all__ = ["LinearProbe"]

_ARMIJO = 1e-4     # sufficient-decrease constant of the backtracking line search
_HALVINGS = 40     # backtracking steps before a Newton step is given up for this iteration
_JITTER = 1e-10    # relative diagonal jitter of the preconditioner (the bias has no penalty)


def _margin_loss(margin: torch.Tensor, loss: str) -> torch.Tensor:
    if loss == "logistic":
        return F.softplus(-margin)
    return torch.clamp(1.0 - margin, min=0.0).square()


def _loss_derivatives(margin: torch.Tensor, loss: str) -> tuple[torch.Tensor, torch.Tensor]:
    """l'(m) and l''(m) elementwise (for the squared hinge, its generalised second derivative)."""
    if loss == "logistic":
        p = torch.sigmoid(-margin)
        return -p, p * (1.0 - p)
    slack = torch.clamp(1.0 - margin, min=0.0)
    return -2.0 * slack, 2.0 * (slack > 0).to(margin.dtype)


class LinearProbe(Probe):
    """Logistic regression / squared-hinge linear SVM on standardised statement vectors.

    Args:
        C: inverse L2 strength (sklearn's convention); None -> chosen from `Cs` by cross-validation.
        Cs: grid searched when `C` is None.
        C_limits: (lo, hi): while the CV optimum lies at an end of the searched grid, the grid is extended a
            decade beyond that end (warm-started from the end's fits) until the optimum is interior or the
            next decade would leave [lo, hi]; None: `Cs` as given. `params()["Cs"]` is the searched grid.
        loss: "logistic" (logistic regression) or "hinge" (linear SVM, squared hinge).
        representation: "last" (last token) or "mean" (token mean) statement vectors.
        tokens: "statement" (statement-text tokens) or "all" (BOS and chat-template tokens too).
        class_weight: "balanced" (n / (2 n_c) per class) or None.
        cv_folds: folds of the (grouped, stratified) cross-validation on the training split.
        cv_metric: "log_loss" (class-balanced held-out loss: log-loss, or squared hinge for
            loss="hinge"; smooth, the default) or "mcc" (held-out MCC at threshold 0, ties -> lower
            held-out loss). Both are reported by `params()`.
        max_iter: Newton iterations per C and optimiser step; max_epochs: optimiser steps (a further
            step continues only the fits that reached max_iter).
        tol: a fit has converged when its preconditioned gradient (about its distance to the
            minimiser, in standardised-weight units) is below tol in every coordinate.
        accelerator: passed to the Trainer ("auto", "cpu", "gpu").
        seed: seed of the fold assignment; None -> drawn from torch's global generator.

    After a cross-validated `fit`, `cv_scores_` (float64 [K, N]) holds the held-out decision values of the
    training statements at each C of the searched grid (K values, increasing: `params()["Cs"]`; NaN for
    statements no fold held out); `n_iter_` counts the final fit's Newton iterations.
    """

    def __init__(self, C: float | None = None, Cs=(0.001, 0.01, 0.1, 1.0, 10.0), C_limits=(1e-6, 1e4),
                 loss: str = "logistic",
                 representation: str = "last", class_weight: str | None = "balanced",
                 cv_folds: int = 5, cv_metric: str = "log_loss", max_iter: int = 500,
                 max_epochs: int = 2, tol: float = 1e-6, accelerator: str = "auto",
                 seed: int | None = None, tokens: str = "statement"):
        super().__init__()
        self.C, self.Cs, self.loss, self.representation = C, tuple(Cs), loss, representation
        self.C_limits = None if C_limits is None else tuple(C_limits)
        self.class_weight, self.cv_folds, self.cv_metric, self.max_iter = class_weight, cv_folds, cv_metric, max_iter
        self.max_epochs, self.tol, self.accelerator, self.seed, self.tokens = max_epochs, tol, accelerator, seed, tokens
        self._check_params()
        self.register_buffer("mean", torch.zeros(0))
        self.register_buffer("std", torch.ones(0))
        self.weight = torch.nn.Parameter(torch.zeros(0))
        self.bias = torch.nn.Parameter(torch.zeros(()))
        self._params: dict = {}

    def _check_params(self) -> None:
        super()._check_params()
        check_choice("loss", self.loss, ("logistic", "hinge"))
        check_choice("cv_metric", self.cv_metric, ("mcc", "log_loss"))
        check_C_grid(self.C, self.Cs, self.C_limits)
        for name in ("cv_folds", "max_iter", "max_epochs"):
            check_positive(name, getattr(self, name), integer=True)
        check_positive("tol", self.tol)

    # -- Lightning hooks: the whole path of batched Newton solves in one Trainer fit ---------------
    # Each training step (one per epoch) solves every fit at every C of `_path_Cs`; a further epoch
    # continues only the (C, fit) pairs that stopped at max_iter, and none runs once all converged.
    automatic_optimization = False

    def configure_optimizers(self):
        return None

    @torch.no_grad()
    def training_step(self, batch, batch_idx):
        fits = _Fits(*batch, loss=self.loss)
        if self._path is None:  # first epoch: along increasing C, each warm-started from the last
            theta = (torch.zeros(fits.weights.shape[1], fits.A.shape[1], dtype=fits.A.dtype, device=fits.A.device)
                     if self._start is None else self._start.to(fits.A.device))
            self._path, self._done, self._iters = [], [], []
            for C in self._path_Cs:
                todo = torch.ones(len(theta), dtype=torch.bool, device=theta.device)
                theta, done, iters = self._newton(fits, fits.penalty / C, theta, todo)
                self._path.append(theta)
                self._done.append(done)
                self._iters.append(iters)
        else:
            for j, C in enumerate(self._path_Cs):
                if not bool(self._done[j].all()):
                    self._path[j], done, iters = self._newton(fits, fits.penalty / C, self._path[j], ~self._done[j])
                    self._done[j] = self._done[j] | done
                    self._iters[j] = self._iters[j] + iters
        if all(bool(d.all()) for d in self._done):
            self.trainer.should_stop = True

    def _newton(self, fits: "_Fits", lam: torch.Tensor, theta: torch.Tensor, todo: torch.Tensor):
        """Truncated Newton on every fit at one C: lam [S, p] penalty diagonal at this C (0 for the
        bias), theta [S, p] start, todo bool [S] fits to solve.
        Returns (theta [S, p], converged bool [S], Newton iterations int64 [S])."""
        margin = fits.margins(theta)
        chol = None if self.loss == "hinge" else fits.preconditioner(margin[:, -1], lam)
        iters = torch.zeros(len(theta), dtype=torch.long, device=theta.device)
        active = todo
        for _ in range(self.max_iter):
            grad, curvature = fits.gradient(margin, lam, theta)
            if self.loss == "hinge":  # its generalised Hessian jumps with the support set: exact Newton
                chol = fits.hessians(curvature, lam)
            active = active & (_precondition(chol, grad).abs().amax(1) > self.tol)
            if not bool(active.any()):
                break
            step = _conjugate_gradients(fits, curvature, lam, grad, chol, active)
            theta, margin = _line_search(fits, lam, theta, margin, grad, step, active)
            iters += active.long()
        else:
            grad = fits.gradient(margin, lam, theta)[0]
            active = active & (_precondition(chol, grad).abs().amax(1) > self.tol)
        return theta, todo & ~active, iters

    def _solve_path(self, X: torch.Tensor, y: np.ndarray, folds: list, Cs: list[float],
                    start: torch.Tensor | None = None):
        """Fit every fold of `folds` and all of X (the last fit) at every C of `Cs` (increasing), the first C
        from `start` [len(folds) + 1, d+1] (the fits' weights in the coordinates of A; None: zeros).

        X float32 [N, d]. Returns (mean, std) float32 [d] of X, A float64 [N, d+1] (X standardised
        by them, and ones), path float64 [len(Cs), len(folds) + 1, d+1] (each fit's weights and bias
        in the coordinates of A) and the last fit's Newton iterations [len(Cs)].
        """
        n, d = X.shape
        mean, std = standardiser(X)
        A = torch.cat([(X.double() - mean.double()) / std.double(), torch.ones(n, 1, dtype=torch.float64)], 1)
        fits = [(tr, te) for tr, te in folds] + [(np.arange(n), np.zeros(0, dtype=np.int64))]
        weights = torch.zeros(n, len(fits), dtype=torch.float64)
        penalty = torch.zeros(len(fits), d + 1, dtype=torch.float64)
        held_out = np.full(n, len(folds))                 # the fold holding each row out (len(folds): none)
        for s, (tr, te) in enumerate(fits):
            # the fit's own standardisation z' = (x - m) / v = z * std / v + const: w' = w * v / std
            scale = std.double() / standardiser(X[tr])[1].double()
            weights[tr, s] = torch.from_numpy(balanced_weights(y[tr], self.class_weight)).double() / len(tr)
            penalty[s, :d] = 1.0 / (len(tr) * scale.square())
            held_out[te] = s
        group = torch.from_numpy(2 * held_out + y)
        first = [int(np.flatnonzero(group.numpy() == g)[0]) if (group == g).any() else 0
                 for g in range(2 * len(fits))]
        group_weights = weights[first].T.contiguous()      # [S, G]: the weight of group g's rows in fit s
        t = torch.from_numpy(2.0 * y - 1.0)
        self._path_Cs, self._path, self._start = list(Cs), None, start
        loader = DataLoader(FullBatch(A, t, weights, penalty, group_weights, group), batch_size=None)
        with quiet_lightning(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*configure_optimizers.*returned `None`.*")
            make_trainer(self.accelerator, self.max_epochs).fit(self, loader)
        path = torch.stack([theta.cpu() for theta in self._path])
        iters = [int(i[-1]) for i in self._iters]
        del self._path, self._done, self._iters, self._start
        return mean, std, A, path, iters

    # -- Probe interface --------------------------------------------------------------------------
    def _fit(self, train: Features, y: np.ndarray, folds: list | None = None) -> "LinearProbe":
        X = statement_vectors(train, self.representation).cpu()
        groups = None if train.groups is None else np.asarray(train.groups)
        Cs = tuple(float(c) for c in self.Cs)
        C, given, folds = None if self.C is None else float(self.C), folds, []
        self.held_out_scores_ = None
        if C is None:
            folds = list(given) if given else kfold_splits(y, groups, self.cv_folds, draw_seed(self.seed))
            if len(Cs) == 1 or not folds:
                C, folds = middle_of_grid(Cs), []
        grid = sorted(set(Cs)) if folds else [C]
        mean, std, A, path, iters = self._solve_path(X, y, folds, grid)
        self._params = {"loss": self.loss, "representation": self.representation, "class_weight": self.class_weight}
        if folds:
            C = self._cross_validate(A, y, folds, grid, path)
            while (beyond := beyond_grid(grid, C, self.C_limits)) is not None:   # bracket the optimum
                edge = grid.index(C)
                extra, extra_iters = self._solve_path(X, y, folds, [beyond], start=path[edge])[3:]
                at = edge + (beyond > C)
                grid.insert(at, beyond)
                path = torch.cat([path[:at], extra, path[at:]])
                iters.insert(at, extra_iters[0])
                C = self._cross_validate(A, y, folds, grid, path)
            if given:
                self.held_out_scores_ = self.cv_scores_[grid.index(C)]
        final = path[grid.index(C), -1]
        self.mean, self.std = mean, std
        self.weight = torch.nn.Parameter(final[:-1].float(), requires_grad=False)
        self.bias = torch.nn.Parameter(final[-1].float(), requires_grad=False)
        self.n_iter_ = iters[grid.index(C)]
        self._params.update(C=C, n_iter=self.n_iter_)
        return self

    def _cross_validate(self, A: torch.Tensor, y: np.ndarray, folds: list, Cs: list[float],
                        path: torch.Tensor) -> float:
        """The C of the searched grid `Cs` (increasing) chosen by `cv_metric` from the held-out scores of the
        fold fits in path [len(Cs), F+1, p]; sets `cv_scores_` and the CV entries of `_params`."""
        scores = np.full((len(Cs), len(A)), np.nan)
        mcc = np.zeros((len(folds), len(Cs)))
        loss = np.zeros((len(folds), len(Cs)))
        for f, (_, te) in enumerate(folds):
            s_te = torch.from_numpy(balanced_weights(y[te], self.class_weight)).double()
            t_te = torch.from_numpy(2.0 * y[te] - 1.0)
            for j, c in enumerate(Cs):
                score = A[te] @ path[j, f]
                scores[j, te] = score.numpy()
                mcc[f, j] = matthews_corrcoef(y[te], (score > 0).numpy().astype(int))
                loss[f, j] = float((s_te * _margin_loss(t_te * score, self.loss)).sum() / s_te.sum())
        mean_mcc, mean_loss = mcc.mean(0), loss.mean(0)
        if self.cv_metric == "mcc":
            best = max(range(len(Cs)), key=lambda j: (round(mean_mcc[j], 12), -mean_loss[j]))
        else:
            best = int(np.argmin(mean_loss))
        self.cv_scores_ = scores
        C = Cs[best]
        self._params.update({"Cs": list(Cs), "cv_metric": self.cv_metric,
                             "cv_mcc": mean_mcc.round(6).tolist(), "cv_loss": mean_loss.round(6).tolist(),
                             "C_limits": None if self.C_limits is None else [float(c) for c in self.C_limits],
                             "C_at_grid_edge": C in (min(Cs), max(Cs))})
        return C

    @torch.no_grad()
    def _decision(self, data: Features) -> np.ndarray:
        X = statement_vectors(data, self.representation).to(self.mean.device).double()
        # float64: a row's score does not depend on the rows scored beside it (float32 kernels differ by batch size)
        return (((X - self.mean.double()) / self.std.double()) @ self.weight.double() + self.bias.double()).cpu().numpy()

    # -- the direction in the original (unstandardised) feature space ----------------------------
    @property
    def coef_(self) -> np.ndarray:
        """float [d]: w such that decision = X @ coef_ + intercept_."""
        return (self.weight / self.std).detach().double().cpu().numpy()

    @property
    def intercept_(self) -> float:
        return float(self.bias - (self.mean / self.std) @ self.weight)


class _Fits:
    """The batched problem on the Trainer's device: S fits sharing the rows of A.

    A float64 [n, p] (standardised vectors and a column of ones, p = d + 1; its float32 copies serve the
    Hessian-vector products, float64 the gradients, objective and preconditioner), t [n] (+-1),
    weights [n, S] (s_i / n_s on fit s's training rows, 0 elsewhere), penalty [S, p] (penalty
    diagonal at C = 1, 0 for the bias), group_weights [S, G] (the weight of group g's rows in fit s)
    and group int64 [n] (rows of one group, one class held out by the same fold, share their weight
    in every fit).
    """

    def __init__(self, A, t, weights, penalty, group_weights, group, loss: str):
        self.A, self.t, self.weights, self.penalty = A, t, weights, penalty
        self.group_weights, self.group, self.loss = group_weights, group, loss
        self.A32 = A.float()
        self.At32 = self.A32.T.contiguous()

    def margins(self, theta: torch.Tensor) -> torch.Tensor:
        """[n, S]: t_i * (A theta_s)_i."""
        return self.t[:, None] * (self.A @ theta.T)

    def objective(self, margin: torch.Tensor, lam: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
        """[S] objective values at theta [S, p] whose margins are margin [n, S]."""
        return (self.weights * _margin_loss(margin, self.loss)).sum(0) + 0.5 * (lam * theta.square()).sum(1)

    def gradient(self, margin, lam, theta) -> tuple[torch.Tensor, torch.Tensor]:
        """(gradient [S, p], row curvature [n, S] float32: weights * l'')."""
        slope, curvature = _loss_derivatives(margin, self.loss)
        grad = (self.weights * self.t[:, None] * slope).T @ self.A + lam * theta
        return grad, (self.weights * curvature).float()

    def hessian_times(self, curvature: torch.Tensor, lam: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
        """float32 [S, p]: H_s v_s = A^T diag(curvature_s) A v_s + lam_s * v_s for V float32 [S, p]."""
        return (curvature.T * (V @ self.At32)) @ self.A32 + lam * V

    def preconditioner(self, margin: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
        """Cholesky factors [S, p, p] (factored in float64, applied in float32) of each fit's Hessian
        with the last fit's curvature at margin [n] in place of its own:
        sum_g group_weights[s, g] A_g^T diag(l''_g) A_g + diag(lam_s); one Gram matrix per group
        (accumulated in float32: it only preconditions) serves all fits."""
        h = _loss_derivatives(margin, self.loss)[1]
        P = torch.diag_embed(lam)
        for g in range(self.group_weights.shape[1]):
            rows = self.group == g
            Ag = self.A32[rows] * h[rows, None].sqrt().float()
            P += self.group_weights[:, g, None, None] * (Ag.T @ Ag).double()
        return _cholesky(P)

    def hessians(self, curvature: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
        """float32 Cholesky factors [S, p, p] of each fit's own Hessian A^T diag(curvature_s) A +
        diag(lam_s) (curvature [n, S]; only rows of positive curvature are summed)."""
        P = torch.diag_embed(lam)
        for s in range(len(lam)):
            rows = curvature[:, s] > 0
            Ag = self.A[rows]
            P[s] += (Ag * curvature[rows, s, None].double()).T @ Ag
        return _cholesky(P)


def _cholesky(P: torch.Tensor) -> torch.Tensor:
    """float32 Cholesky factors of P float64 [S, p, p], with a relative diagonal jitter (the bias has
    no penalty, and the squared hinge may have no curvature)."""
    diagonal = P.diagonal(dim1=1, dim2=2)
    diagonal += _JITTER * diagonal.amax(1, keepdim=True)
    return torch.linalg.cholesky(P).float()


def _precondition(chol: torch.Tensor, R: torch.Tensor) -> torch.Tensor:
    """float32 [S, p]: P_s^{-1} r_s for every fit, chol [S, p, p] float32 Cholesky factors of P, R [S, p]."""
    return torch.cholesky_solve(R.float()[:, :, None], chol)[:, :, 0]


def _conjugate_gradients(fits: _Fits, curvature, lam, grad, chol, active) -> torch.Tensor:
    """Newton steps [S, p] (float64): H_s x_s = -g_s (see `_Fits.hessian_times`; curvature [n, S],
    lam / grad [S, p]) by preconditioned conjugate gradients in float32 for the active fits, each to
    the relative residual min(0.5, sqrt(|g_s|)) (superlinear Newton convergence)."""
    lam = lam.float()
    r = -grad.float()
    gnorm = r.norm(dim=1)
    target = torch.clamp(gnorm.sqrt(), max=0.5) * gnorm
    x = torch.zeros_like(r)
    z = _precondition(chol, r)
    p = torch.where(active[:, None], z, 0.0)
    rz = (r * z).sum(1)
    live = active.clone()
    for _ in range(r.shape[1]):
        Hp = fits.hessian_times(curvature, lam, p)
        pHp = (p * Hp).sum(1)
        live = live & (pHp > 0)
        a = torch.where(live, rz / torch.where(live, pHp, 1.0), 0.0)
        x = x + a[:, None] * p
        r = r - a[:, None] * Hp
        live = live & (r.norm(dim=1) > target)
        if not bool(live.any()):
            break
        z = _precondition(chol, r)
        rz_new = (r * z).sum(1)
        p = torch.where(live[:, None], z + (rz_new / torch.where(live, rz, 1.0))[:, None] * p, 0.0)
        rz = rz_new
    return x.double()


def _line_search(fits: _Fits, lam, theta, margin, grad, step, active) -> tuple[torch.Tensor, torch.Tensor]:
    """Backtracking (Armijo) along step [S, p] for the active fits; returns (theta, margin)."""
    direction = fits.margins(step)                                            # [n, S]
    start = fits.objective(margin, lam, theta)
    decrease = _ARMIJO * (grad * step).sum(1)
    alpha = torch.where(active, 1.0, 0.0).to(theta)
    for _ in range(_HALVINGS):
        ok = fits.objective(margin + alpha * direction, lam, theta + alpha[:, None] * step) <= start + alpha * decrease
        if bool(ok.all()):
            break
        alpha = torch.where(ok, alpha, 0.5 * alpha)
    alpha = torch.where(ok, alpha, 0.0)
    return theta + alpha[:, None] * step, margin + alpha * direction
