"""Linear probe: L2-regularised logistic regression (or squared-hinge linear SVM) on one vector per
statement, with the regularisation strength chosen by grouped k-fold cross-validation.

Objective (per fit, on standardised features z_i, labels t_i in {-1, +1}, sample weights s_i):

    (1 / n) * sum_i s_i * l(t_i * (w . z_i + b))  +  ||w||^2 / (2 * C * n)

with l(m) = log(1 + exp(-m)) (logistic) or max(0, 1 - m)^2 (squared hinge). This is sklearn's
`LogisticRegression(C=C)` objective divided by C * n, so it has the same minimiser; the bias is not
penalised. Solved full-batch with L-BFGS (strong Wolfe line search) inside a `lightning.Trainer`.

The small helpers at the top (statement vectors, class weights, grouped splits, a quiet Trainer) are
shared with `probes.mlp` and `probes.mean_diff`.
"""
from __future__ import annotations

import logging
import warnings
from contextlib import contextmanager

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from sklearn.metrics import matthews_corrcoef
from sklearn.model_selection import StratifiedGroupKFold, StratifiedKFold
from torch.utils.data import DataLoader, Dataset

from probes.base import Features, Probe

__all__ = ["LinearProbe", "statement_vectors", "check_labels", "balanced_weights", "kfold_splits",
           "holdout_split", "resolve_device", "quiet_lightning", "make_trainer", "draw_seed",
           "standardiser", "FullBatch"]

_EPS = 1e-8


# ----------------------------------------------------------------------------------------------
# shared helpers
# ----------------------------------------------------------------------------------------------
def statement_vectors(data: Features, representation: str) -> torch.Tensor:
    """float32 [N, d]: one vector per statement.

    Per-statement features (no offsets) are returned as they are: the caller loaded the layer in the
    representation the probe asked for. Bags are reduced here: "last" takes each bag's last token,
    "mean" averages its tokens (an empty bag gives zeros).
    """
    if representation not in ("last", "mean"):
        raise ValueError(f"representation must be 'last' or 'mean', got {representation!r}")
    X = data.X
    if not data.is_bags:
        return X.float()
    offsets = data.offsets.to(torch.long)
    lengths = offsets[1:] - offsets[:-1]
    if representation == "last":
        if bool((lengths == 0).any()):
            raise ValueError("an empty bag has no last token")
        return X[offsets[1:] - 1].float()
    rows = torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), lengths)
    out = torch.zeros(len(lengths), X.shape[1], dtype=torch.float32, device=X.device)
    out.index_add_(0, rows.to(X.device), X.float())
    return out / lengths.clamp(min=1).to(out)[:, None]


def check_labels(y, n: int) -> np.ndarray:
    """int64 [N] in {0, 1}; both classes must be present."""
    y = np.asarray(y).reshape(-1)
    if len(y) != n:
        raise ValueError(f"{len(y)} labels for {n} statements")
    if not np.isin(y, (0, 1)).all():
        raise ValueError("labels must be 0 / 1")
    y = y.astype(np.int64)
    if y.min() == y.max():
        raise ValueError("both classes must be present in the training split")
    return y


def balanced_weights(y: np.ndarray, class_weight: str | None) -> np.ndarray:
    """float32 [N] sample weights: n / (2 n_c) per class for "balanced" (sklearn's rule), else ones."""
    y = np.asarray(y)
    if class_weight is None or class_weight == "none":
        return np.ones(len(y), dtype=np.float32)
    if class_weight != "balanced":
        raise ValueError(f"class_weight must be 'balanced' or None, got {class_weight!r}")
    counts = np.bincount(y, minlength=2).astype(np.float64)
    w = len(y) / (2.0 * np.maximum(counts, 1.0))
    return w[y].astype(np.float32)


def draw_seed(seed: int | None) -> int:
    """`seed` itself, or a seed drawn from torch's global generator (set by `seed_everything`)."""
    if seed is not None:
        return int(seed)
    return int(torch.randint(0, 2**31 - 1, (1,)).item())


def kfold_splits(y: np.ndarray, groups: np.ndarray | None, n_splits: int, seed: int):
    """(train_idx, test_idx) pairs: class-stratified k-fold, grouped (no group in two folds) when
    `groups` is given. Fewer folds when there are too few groups / minority-class members;
    an empty list when fewer than 2 folds are possible."""
    y = np.asarray(y)
    n_min = int(np.bincount(y, minlength=2).min())
    if groups is not None:
        n_groups = len(np.unique(groups))
        k = min(n_splits, n_groups, n_min)
        if k < 2:
            return []
        splitter = StratifiedGroupKFold(n_splits=k, shuffle=True, random_state=seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "least populated class ..." on tiny data
            folds = list(splitter.split(np.zeros(len(y)), y, groups))
    else:
        k = min(n_splits, n_min)
        if k < 2:
            return []
        folds = list(StratifiedKFold(n_splits=k, shuffle=True, random_state=seed).split(np.zeros(len(y)), y))
    # a fold whose training part misses a class cannot be fitted
    return [(tr, te) for tr, te in folds if len(np.unique(y[tr])) == 2 and len(te) > 0]


def holdout_split(y: np.ndarray, groups: np.ndarray | None, fraction: float, seed: int):
    """(fit_idx, val_idx): about `fraction` of the statements held out, class-stratified, and grouped
    (whole groups held out) when `groups` is given."""
    n_splits = max(2, int(round(1.0 / fraction)))
    folds = kfold_splits(y, groups, n_splits, seed)
    if not folds:  # too few groups: hold out statements
        folds = kfold_splits(y, None, n_splits, seed)
    if not folds:
        raise ValueError("too few statements of the minority class for a held-out split")
    return folds[0]


def resolve_device(accelerator: str) -> torch.device:
    """The device a closed-form probe computes on: "auto" -> cuda when available, else cpu."""
    acc = str(accelerator).lower()
    if acc == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if acc in ("gpu", "cuda"):
        return torch.device("cuda")
    return torch.device(acc)


@contextmanager
def quiet_lightning():
    """Silence the Trainer's per-fit info lines and data-loader hints (the caller shows progress)."""
    names = ("lightning", "lightning.pytorch", "lightning.fabric", "pytorch_lightning")
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*does not have many workers.*")
            warnings.filterwarnings("ignore", message=".*number of training batches.*")
            warnings.filterwarnings("ignore", message=".*GPU available but not used.*")
            warnings.filterwarnings("ignore", message=".*srun.*")
            warnings.filterwarnings("ignore", message=".*LeafSpec.*")  # lightning 2.6 on torch >= 2.10
            yield
    finally:
        for lg, lvl in zip(loggers, levels):
            lg.setLevel(lvl)


def make_trainer(accelerator: str, max_epochs: int, callbacks=None, **kwargs) -> L.Trainer:
    """A single-device Trainer without logger / checkpoints / progress bar / model summary."""
    return L.Trainer(accelerator=accelerator, devices=1, max_epochs=max_epochs, callbacks=callbacks,
                     logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, num_sanity_val_steps=0, log_every_n_steps=1,
                     **kwargs)


def standardiser(X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Column mean and (population) std of X, std floored so constant columns divide by 1."""
    mean = X.double().mean(0)
    std = X.double().std(0, unbiased=False)
    std = torch.where(std > _EPS * max(float(std.max()), 1.0), std, torch.ones_like(std))
    return mean.float(), std.float()


class FullBatch(Dataset):
    """A data set of one item: the whole training split (for full-batch optimisers)."""

    def __init__(self, *tensors: torch.Tensor):
        self.tensors = tensors

    def __len__(self) -> int:
        return 1

    def __getitem__(self, i):
        return self.tensors


# ----------------------------------------------------------------------------------------------
# the probe
# ----------------------------------------------------------------------------------------------
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
                 seed: int | None = None):
        super().__init__()
        if loss not in ("logistic", "hinge"):
            raise ValueError(f"loss must be 'logistic' or 'hinge', got {loss!r}")
        if representation not in ("last", "mean"):
            raise ValueError(f"representation must be 'last' or 'mean', got {representation!r}")
        if cv_metric not in ("mcc", "log_loss"):
            raise ValueError(f"cv_metric must be 'mcc' or 'log_loss', got {cv_metric!r}")
        self.representation = representation
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
