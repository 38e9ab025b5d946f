"""Linear probe: L2-regularised logistic regression (or squared-hinge linear SVM) on one vector per
statement, with the regularisation strength chosen by grouped k-fold cross-validation.

Objective (per fit, on standardised features z_i, labels t_i in {-1, +1}, sample weights s_i):

    (1 / n) * sum_i s_i * l(t_i * (w . z_i + b))  +  ||w||^2 / (2 * C * n)

with l(m) = log(1 + exp(-m)) (logistic) or max(0, 1 - m)^2 (squared hinge). This is sklearn's
`LogisticRegression(C=C)` objective divided by C * n, so it has the same minimiser; the bias is not
penalised. Solved full-batch with L-BFGS (strong Wolfe line search) inside a `lightning.Trainer`.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.metrics import matthews_corrcoef
from torch.utils.data import DataLoader

from probes.base import (FullBatch, Probe, balanced_weights, check_choice, check_labels, check_positive, draw_seed,
                         kfold_splits, make_trainer, quiet_lightning, standardiser)
from probes.features import Features, statement_vectors

__all__ = ["LinearProbe"]


def _margin_loss(margin: torch.Tensor, loss: str) -> torch.Tensor:
    if loss == "logistic":
        return F.softplus(-margin)
    return torch.clamp(1.0 - margin, min=0.0).square()


class LinearProbe(Probe):
    """Logistic regression / squared-hinge linear SVM on standardised statement vectors.

    Args:
        C: inverse L2 strength (sklearn's convention); None -> chosen from `Cs` by cross-validation.
        Cs: grid searched when `C` is None.
        loss: "logistic" (logistic regression) or "hinge" (linear SVM, squared hinge).
        representation: "last" (last token) or "mean" (token mean) statement vectors.
        tokens: "statement" (statement-text tokens) or "all" (BOS and chat-template tokens too).
        class_weight: "balanced" (n / (2 n_c) per class) or None.
        cv_folds: folds of the (grouped, stratified) cross-validation on the training split.
        cv_metric: "log_loss" (class-balanced held-out loss: log-loss, or squared hinge for
            loss="hinge"; smooth, the default) or "mcc" (held-out MCC at threshold 0, ties -> lower
            held-out loss). Both are reported by `params()`.
        max_iter: L-BFGS iterations per optimiser step; max_epochs: optimiser steps (a further
            step continues only when max_iter was reached).
        tol: L-BFGS gradient tolerance.
        accelerator: passed to the Trainer ("auto", "cpu", "gpu").
        seed: seed of the fold assignment; None -> drawn from torch's global generator.
    """

    def __init__(self, C: float | None = None, Cs=(0.001, 0.01, 0.1, 1.0, 10.0), loss: str = "logistic",
                 representation: str = "last", class_weight: str | None = "balanced",
                 cv_folds: int = 5, cv_metric: str = "log_loss", max_iter: int = 500,
                 max_epochs: int = 2, tol: float = 1e-6, accelerator: str = "auto",
                 seed: int | None = None, tokens: str = "statement"):
        super().__init__()
        self._set_input(representation, tokens)
        check_choice("loss", loss, ("logistic", "hinge"))
        check_choice("cv_metric", cv_metric, ("mcc", "log_loss"))
        for c in ([] if C is None else [C]) + list(Cs):
            check_positive("C" if C is not None else "Cs", c)
        check_positive("cv_folds", cv_folds, integer=True)
        check_positive("max_iter", max_iter, integer=True)
        self.C = None if C is None else float(C)
        self.Cs = tuple(float(c) for c in Cs)
        self.loss = loss
        self.class_weight = class_weight
        self.cv_folds = int(cv_folds)
        self.cv_metric = cv_metric
        self.max_iter = int(max_iter)
        self.max_epochs = int(max_epochs)
        self.tol = float(tol)
        self.accelerator = accelerator
        self.seed = seed
        self.register_buffer("mean", torch.zeros(0))
        self.register_buffer("std", torch.ones(0))
        self.weight = torch.nn.Parameter(torch.zeros(0))
        self.bias = torch.nn.Parameter(torch.zeros(()))
        self._C_fit = 1.0
        self._params: dict = {}

    # -- Lightning hooks (one full-batch L-BFGS fit) -------------------------------------------
    # Manual optimisation: each training step is one L-BFGS `step` (up to `max_iter` iterations with
    # line search) on the full batch; a plain closure keeps the per-evaluation overhead small.
    automatic_optimization = False

    def _objective(self, Z: torch.Tensor, t: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        n = Z.shape[0]
        margin = t * (Z @ self.weight + self.bias)
        return (s * _margin_loss(margin, self.loss)).sum() / n + self.weight.square().sum() / (2.0 * self._C_fit * n)

    def training_step(self, batch, batch_idx):
        Z, t, s = batch
        opt = self.optimizers()

        def closure():
            opt.zero_grad()
            value = self._objective(Z, t, s)
            self.manual_backward(value)
            return value

        value = opt.step(closure=closure)
        return value.detach()

    def configure_optimizers(self):
        return torch.optim.LBFGS([self.weight, self.bias], lr=1.0, max_iter=self.max_iter,
                                 history_size=20, tolerance_grad=self.tol, tolerance_change=1e-10,
                                 line_search_fn="strong_wolfe")

    def _solve(self, Z: torch.Tensor, y: np.ndarray, s: np.ndarray, C: float,
               w0: torch.Tensor | None = None, b0: float = 0.0) -> tuple[torch.Tensor, float, int]:
        """Minimise the objective on standardised Z (float32 [n, d]); returns (w, b, iterations)."""
        d = Z.shape[1]
        self._C_fit = float(C)
        self.weight = torch.nn.Parameter(torch.zeros(d) if w0 is None else w0.detach().cpu().clone())
        self.bias = torch.nn.Parameter(torch.tensor(float(b0)))
        t = torch.from_numpy(2.0 * y.astype(np.float32) - 1.0)
        loader = DataLoader(FullBatch(Z, t, torch.from_numpy(s)), batch_size=None)
        with quiet_lightning():
            trainer = make_trainer(self.accelerator, self.max_epochs)
            trainer.fit(self, loader)
        state = trainer.optimizers[0].state.get(self.weight, {})
        n_iter = int(state.get("n_iter", 0))
        return self.weight.detach().cpu().clone(), float(self.bias.detach().cpu()), n_iter

    # -- Probe interface --------------------------------------------------------------------------
    def fit(self, train: Features, y) -> "LinearProbe":
        X = statement_vectors(train, self.representation).cpu()
        y = check_labels(y, len(X))
        groups = None if train.groups is None else np.asarray(train.groups)
        s_all = balanced_weights(y, self.class_weight)
        cv_mcc, cv_loss, C = None, None, self.C
        if C is None:
            folds = kfold_splits(y, groups, self.cv_folds, draw_seed(self.seed))
            if len(self.Cs) == 1 or not folds:
                C = self.Cs[len(self.Cs) // 2]
            else:
                C, cv_mcc, cv_loss = self._cross_validate(X, y, folds)
        mean, std = standardiser(X)
        w, b, n_iter = self._solve((X - mean) / std, y, s_all, C)
        self.mean, self.std = mean, std
        self.weight = torch.nn.Parameter(w, requires_grad=False)
        self.bias = torch.nn.Parameter(torch.tensor(b), requires_grad=False)
        self._params = {"C": C, "loss": self.loss, "representation": self.representation,
                        "class_weight": self.class_weight, "n_iter": n_iter}
        if cv_mcc is not None:
            self._params.update({"Cs": list(self.Cs), "cv_metric": self.cv_metric,
                                 "cv_mcc": cv_mcc, "cv_loss": cv_loss,
                                 "C_at_grid_edge": C in (min(self.Cs), max(self.Cs))})
        return self

    def _cross_validate(self, X: torch.Tensor, y: np.ndarray, folds) -> tuple[float, list, list]:
        order = np.argsort(self.Cs)  # warm start along increasing C
        mcc = np.zeros((len(folds), len(self.Cs)))
        loss = np.zeros((len(folds), len(self.Cs)))
        for f, (tr, te) in enumerate(folds):
            mean, std = standardiser(X[tr])
            Ztr, Zte = (X[tr] - mean) / std, (X[te] - mean) / std
            s_tr = balanced_weights(y[tr], self.class_weight)
            s_te = torch.from_numpy(balanced_weights(y[te], self.class_weight)).double()
            t_te = torch.from_numpy(2.0 * y[te] - 1.0).double()
            w, b = None, 0.0
            for j in order:
                w, b, _ = self._solve(Ztr, y[tr], s_tr, self.Cs[j], w, b)
                score = (Zte @ w + b).double()
                mcc[f, j] = matthews_corrcoef(y[te], (score > 0).numpy().astype(int))
                loss[f, j] = float((s_te * _margin_loss(t_te * score, self.loss)).sum() / s_te.sum())
        mean_mcc, mean_loss = mcc.mean(0), loss.mean(0)
        if self.cv_metric == "mcc":
            best = max(range(len(self.Cs)), key=lambda j: (round(mean_mcc[j], 12), -mean_loss[j]))
        else:
            best = int(np.argmin(mean_loss))
        return self.Cs[best], mean_mcc.round(6).tolist(), mean_loss.round(6).tolist()

    @torch.no_grad()
    def decision_function(self, data: Features) -> np.ndarray:
        if self.weight.numel() == 0:
            raise RuntimeError("LinearProbe is not fitted")
        X = statement_vectors(data, self.representation).to(self.mean.device)
        return (((X - self.mean) / self.std) @ self.weight + self.bias).double().cpu().numpy()

    # -- the direction in the original (unstandardised) feature space ----------------------------
    @property
    def coef_(self) -> np.ndarray:
        """float [d]: w such that decision = X @ coef_ + intercept_."""
        return (self.weight / self.std).detach().double().cpu().numpy()

    @property
    def intercept_(self) -> float:
        return float(self.bias - (self.mean / self.std) @ self.weight)
