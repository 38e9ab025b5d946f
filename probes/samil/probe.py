"""sAwMIL behind the shared Probe interface: standardised token bags, C chosen by grouped CV."""
from __future__ import annotations

import time

import numpy as np
import torch

from evaluation.metrics import auroc
from probes.base import (Probe, ProbeError, check_positive, kfold_splits, resolve_device,
                         standardiser)
from probes.features import Features
from probes.grid import beyond_grid, check_C_grid, middle_of_grid
from probes.samil.bags import matvec, segment_max
from probes.samil.estimator import PreparedBags, SAwMIL, distinct_tokens, prepare_bags


class SAwMILProbe(Probe):
    """sAwMIL on the token bags of each statement (representation "bags").

    Token vectors are standardised with the mean and std of the training instances (as the
    reference code does; without it the few high-variance residual dimensions decide the SVM and
    real-data AUROC falls to chance). C is chosen from `Cs` by grouped cross-validation on the
    training bags (folds never split a group of statements sharing an entity; each fold standardised
    on its own training part), by held-out bag AUROC (ties: the smaller C); `C` fixes it instead. While the
    chosen C lies at an end of the searched grid, the grid is extended a decade beyond it (each fold's new
    fit warm-started from its fit at that end) until the optimum is interior or the next decade would leave
    `C_limits` (lo, hi); `C_limits=None`: `Cs` as given. `params()["Cs"]` is the searched grid. `tokens` chooses the
    bag's tokens ("statement" or "all"); the other arguments are those of `SAwMIL` (`stage3_weights`
    "balanced" by default, "none" = the reference's unweighted stage 3; the solver options
    `min_pos_ratio`, `fallback`, `max_iter`, `tol`, `num_threads`, `stage3_solver`: None = SAwMIL's default). Runs on the
    accelerator's device ("auto": CUDA if present). `max_bag_size` / `train_bag_limit` (None: off) train every fit,
    each CV fold's too, on bags cut as the reference code cuts them (`capped_bags`: the first train_bag_limit bags,
    each cut to max_bag_size tokens keeping its last k); scoring always reads whole bags. As an estimator, X is `(tokens [T, d], offsets [n+1])`
    or a list of bags [n_i, d].

    With `warm_cv` (default) the grid's fits start from their neighbours' solutions: on each fold,
    the C of the grid in ascending order, each from the previous C's fit, the smallest C from the previous
    fold's fit at that C (only the first fold's first fit starts from zero); the final fit on the whole
    training split from a fold's fit at the chosen C (mapped into the split's standardised
    coordinates: the same score function). Each fit still stops on its certified duality gap, so the
    models are those of cold fits to the solver's tolerance (`warm_cv=false`: every fit from zero).
    `cv_fits_` records each fit (fold, C, objectives, gaps, seconds; the final fit as fold None).

    `params()["degenerate"]` is true when the final fit is degenerate: ||coef|| <= DEGENERATE_NORM
    or every training bag gets the same score (such a probe's metrics are those of a constant).

    Fitted state (buffers, so `state_dict()` restores the probe): coef [d], intercept [],
    mean [d], std [d]; the bag score is max over the bag's tokens of coef . (x - mean) / std + intercept.
    """

    representation = "bags"
    representations = ("bags",)
    width_buffer = "coef"

    def __init__(self, C: float | None = None, Cs=(10.0, 100.0, 1000.0), C_limits=(0.1, 1e5), cv_folds: int = 3,
                 eta: float | None = None, k: int = 2, c_scaling: str = "per_instance",
                 stage3_weights: str = "balanced", standardize: bool = True, accelerator: str = "auto", seed: int = 0,
                 tokens: str = "statement", warm_cv: bool = True, min_pos_ratio: float | None = None,
                 fallback: str | None = None, max_iter: int | None = None, tol: float | None = None,
                 num_threads: int | None = None, stage3_solver: str | None = None, max_bag_size: int | None = None,
                 train_bag_limit: int | None = None):
        super().__init__()
        self.C, self.Cs, self.cv_folds, self.eta, self.k, self.c_scaling = C, tuple(Cs), cv_folds, eta, k, c_scaling
        self.stage3_weights, self.standardize, self.accelerator = stage3_weights, standardize, accelerator
        self.seed, self.tokens, self.warm_cv, self.min_pos_ratio = seed, tokens, warm_cv, min_pos_ratio
        self.fallback, self.max_iter, self.tol, self.num_threads = fallback, max_iter, tol, num_threads
        self.stage3_solver = stage3_solver
        self.max_bag_size, self.train_bag_limit = max_bag_size, train_bag_limit
        self.C_limits = None if C_limits is None else tuple(C_limits)
        self._check_params()
        self.register_buffer("coef", torch.zeros(0, dtype=torch.float64))
        self.register_buffer("intercept", torch.zeros((), dtype=torch.float64))
        self.register_buffer("mean", torch.zeros(0))
        self.register_buffer("std", torch.ones(0))
        self._params: dict = {}

    def _check_params(self) -> None:
        super()._check_params()
        for name in ("standardize", "warm_cv"):
            if not isinstance(getattr(self, name), bool):
                raise ProbeError(f"{name}={getattr(self, name)!r}: use true or false")
        check_C_grid(self.C, self.Cs, self.C_limits)
        for c in (self.Cs if self.C is None else (self.C,)):
            SAwMIL(C=c, **self._options).check_params()
        for name in ("max_bag_size", "train_bag_limit"):
            if getattr(self, name) is not None:
                check_positive(name, getattr(self, name), integer=True)
        if self.max_bag_size is not None and self.max_bag_size < self.k:
            raise ProbeError(f"max_bag_size={self.max_bag_size} is below k={self.k}: a capped bag keeps its last k "
                             "tokens (the candidates); use max_bag_size >= k or null")

    @property
    def _options(self) -> dict:
        """The SAwMIL arguments: eta, k, c_scaling, stage3_weights, seed, and the solver options given."""
        solver = dict(min_pos_ratio=self.min_pos_ratio, fallback=self.fallback, max_iter=self.max_iter, tol=self.tol,
                      num_threads=self.num_threads, stage3_solver=self.stage3_solver)
        return dict(eta=self.eta, k=self.k, c_scaling=self.c_scaling, stage3_weights=self.stage3_weights,
                    seed=self.seed, **{k: v for k, v in solver.items() if v is not None})

    def _standardiser(self, X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        d = X.shape[1]
        return standardiser(X) if self.standardize else (torch.zeros(d), torch.ones(d))

    def _prepared(self, train: Features, y: np.ndarray) -> tuple[tuple[torch.Tensor, torch.Tensor], PreparedBags]:
        """`train`'s bags standardised on them and prepared for fits at any C: ((mean [d], std [d]), bags).
        The standardisation and distinct tokens do not depend on `y`: computed once for the statements
        (`Features.derived`), they serve every head fitted on them (a layer's one-vs-all heads, fold by fold)."""
        device = resolve_device(self.accelerator)

        def standardised_tokens(data: Features):
            mean, std = self._standardiser(data.X)
            return (mean, std), distinct_tokens((data.X - mean) / std, device=device)

        scaling, tokens = train.derived(f"samil_tokens(standardize={self.standardize}, device={device})",
                                        standardised_tokens)
        return scaling, prepare_bags(tokens, train.offsets, y, self.k)

    def _training_bags(self, data: Features, y: np.ndarray) -> tuple[Features, np.ndarray]:
        """The bags a fit is trained on: all of `data`, or as the reference trains (max_bag_size / train_bag_limit
        given): capped_bags."""
        if self.max_bag_size is None and self.train_bag_limit is None:
            return data, y
        return capped_bags(data, y, self.max_bag_size, self.k, self.train_bag_limit, self.seed)

    def _fit_one(self, C: float, split: tuple, warm=None) -> tuple[SAwMIL, torch.Tensor, torch.Tensor]:
        """SAwMIL at C on a split's bags (`_prepared`): (model, mean [d], std [d]).
        `warm`: (model, mean, std) of a neighbouring fit to start from."""
        (mean, std), bags = split
        model = SAwMIL(C=C, device=resolve_device(self.accelerator), **self._options)
        start = None
        if warm is not None:
            w_model, w_mean, w_std = warm
            start = tuple(_rescale(w, b, w_mean, w_std, mean, std) for w, b in
                          ((w_model.stage1_coef_, w_model.stage1_intercept_), (w_model.coef_, w_model.intercept_)))
        return model.fit_prepared(bags, warm_start=start), mean, std

    def _fit(self, train: Features, y: np.ndarray, folds: list | None = None) -> "SAwMILProbe":
        self.held_out_scores_ = None
        cv_auroc, held_scores, last_fold = ({}, {}, {}) if self.C is not None else self._cross_validate(train, y, folds)
        C = self.C if self.C is not None else _best_C(cv_auroc) if cv_auroc else None
        if self.C is None and not cv_auroc:
            C = middle_of_grid(self.Cs)  # too few groups for folds
        elif cv_auroc and folds:
            self.held_out_scores_ = held_scores[C]
        t0 = time.perf_counter()
        model, mean, std = self._fit_one(C, self._prepared(*self._training_bags(train, y)), warm=last_fold.get(C))
        self.mean, self.std = mean.clone(), std.clone()     # (its own buffers: the scaling is shared with other heads)
        if cv_auroc:
            self._record(None, C, model, time.perf_counter() - t0)
        self.coef, self.intercept = model.coef_.cpu(), torch.tensor(model.intercept_, dtype=torch.float64)
        options = {k: v for k, v in self._options.items() if isinstance(v, (int, float, str, type(None)))}
        train_scores = self._decision(train)
        searched = sorted(cv_auroc) if cv_auroc else self.Cs
        self._params = {**options, "eta_target": options["eta"], "C": float(C), "Cs": [float(c) for c in searched],
                        "C_limits": None if self.C_limits is None else [float(c) for c in self.C_limits],
                        "cv_auroc": {str(c): cv_auroc[c] for c in sorted(cv_auroc)}, "eta": float(model.eta_),
                        "fallback_used": bool(model.fallback_used_), "standardize": self.standardize,
                        "max_bag_size": self.max_bag_size, "train_bag_limit": self.train_bag_limit,
                        "coef_norm": model.fit_info_["stage3"]["coef_norm"],
                        "degenerate": bool(model.degenerate_ or np.ptp(train_scores) == 0.0),
                        "fit_seconds": model.fit_info_["seconds"]}
        return self

    def _cross_validate(self, train: Features, y: np.ndarray, folds: list | None = None
                        ) -> tuple[dict[float, float], dict[float, np.ndarray], dict]:
        """(held-out bag AUROC of every C searched (`Cs`, then the decades `beyond_grid` adds) over grouped
        folds (`folds`, or `cv_folds` of its own), the held-out scores [n] of each C, the last fold's fit at each C
        (the final fit starts from it; {} without `warm_cv`)); all empty when no folds are possible."""
        folds = list(folds) if folds else kfold_splits(y, train.groups, self.cv_folds, self.seed)
        if not folds:
            return {}, {}, {}
        held_all = np.concatenate([held for _, held in folds])
        self.cv_fits_ = []
        fold_fits = [{} for _ in folds]              # per fold: {C: (model, mean, std)}
        held_scores: dict[float, np.ndarray] = {}
        grid = sorted(self.Cs)
        self._fold_pass(train, y, folds, grid, fold_fits, held_scores)
        cv_auroc = {C: auroc(y[held_all], held_scores[C][held_all]) for C in grid}
        while (beyond := beyond_grid(grid, _best_C(cv_auroc), self.C_limits)) is not None:
            self._fold_pass(train, y, folds, [beyond], fold_fits, held_scores)
            grid = sorted([*grid, beyond])
            cv_auroc[beyond] = auroc(y[held_all], held_scores[beyond][held_all])
        return cv_auroc, held_scores, fold_fits[-1] if self.warm_cv else {}

    def _fold_pass(self, train: Features, y: np.ndarray, folds: list, Cs: list[float], fold_fits: list[dict],
                   held_scores: dict) -> None:
        """Fit every fold at each C of `Cs` (in order), scoring its held-out bags into `held_scores[C]` [n]. With
        `warm_cv`, a fit starts from the same fold's fit at the largest smaller C already fitted, else from the
        previous fold's fit at the same C (half of its rows are shared), else from zero. Never from a larger C:
        at a small C the weights are small and a start from a larger C's stops, within the duality-gap
        tolerance, at a visibly different direction (held-out AUROC 0.73 against 0.90 cold on planted bags)."""
        for f, (fit_idx, held_idx) in enumerate(folds):
            part, held = train.subset(fit_idx), train.subset(held_idx)
            split = self._prepared(*self._training_bags(part, y[fit_idx]))
            (mean, std), _ = split
            held_tokens = ((held.X - mean) / std).numpy()        # [T_held, d] in the fold's coordinates
            for C in Cs:
                own = fold_fits[f]
                below = [c for c in own if c < C]
                prev = own[max(below)] if below else fold_fits[f - 1].get(C) if f else None
                t0 = time.perf_counter()
                fit = self._fit_one(C, split, warm=prev if self.warm_cv else None)
                self._record(f, C, fit[0], time.perf_counter() - t0)
                held_scores.setdefault(C, np.full(len(y), np.nan))[held_idx] = \
                    fit[0].decision_function(held_tokens, held.offsets.numpy())
                own[C] = fit

    def _record(self, fold, C, model, seconds):
        info = model.fit_info_
        self.cv_fits_.append(dict(fold=fold, C=float(C), seconds=seconds, **{
            f"{st}_{k}": info[st][k] for st in ("stage1", "stage3") for k in ("objective", "duality_gap", "converged")}))

    def _decision(self, data: Features) -> np.ndarray:
        """float64 [N]: bag scores (max over each bag's token scores)."""
        scores = matvec((data.X - self.mean) / self.std, self.coef) + float(self.intercept)   # [T]
        return segment_max(scores, data.offsets, empty=float(self.intercept)).numpy()

    @property
    def coef_(self) -> np.ndarray:
        """float [d]: a token's score = x @ coef_ + intercept_ (raw coordinates; a bag's is the max of its tokens')."""
        return (self.coef.double() / self.std.double()).cpu().numpy()

    @property
    def intercept_(self) -> float:
        return float(self.intercept) - float((self.mean.double() / self.std.double()) @ self.coef.double())


def capped_bags(data: Features, y: np.ndarray, max_bag_size: int | None, k: int, limit: int | None,
                seed: int) -> tuple[Features, np.ndarray]:
    """The reference's training bags (trilemma-of-truth's sAwMIL runner): the first `limit` bags (None: all), each
    longer than `max_bag_size` cut to its last `k` tokens (the candidates) and max_bag_size - k of its other tokens
    drawn at random (seeded by (seed, bag), kept in order). Features (a fresh memo: these are not `data`'s rows)
    and y [M]."""
    n = len(data) if limit is None else min(int(limit), len(data))
    offsets = data.offsets.numpy()
    rows, lengths = [], []
    for i in range(n):
        start, end = int(offsets[i]), int(offsets[i + 1])
        if max_bag_size is None or end - start <= max_bag_size:
            keep = np.arange(start, end)
        else:
            drawn = np.random.default_rng([int(seed), i]).choice(end - start - k, size=max_bag_size - k, replace=False)
            keep = np.r_[start + np.sort(drawn), np.arange(end - k, end)]
        rows.append(keep)
        lengths.append(len(keep))
    capped = torch.zeros(n + 1, dtype=torch.long)
    capped[1:] = torch.cumsum(torch.as_tensor(lengths, dtype=torch.long), 0)
    groups = None if data.groups is None else data.groups[:n]
    return Features(data.X[torch.from_numpy(np.concatenate(rows))], capped, groups), np.asarray(y)[:n]


def _best_C(cv_auroc: dict[float, float]) -> float:
    """The C of the highest held-out AUROC; ties: the smaller C."""
    return max(cv_auroc, key=lambda c: (cv_auroc[c], -c))


def _rescale(w, b, mean, std, new_mean, new_std):
    """The linear score ``w . (x - mean) / std + b`` in the coordinates ``(x - new_mean) / new_std``:
    ``(w new_std / std, b + w . (new_mean - mean) / std)`` (the same function of ``x``)."""
    w = torch.as_tensor(w, dtype=torch.float64).cpu()
    std, new_std = std.to(torch.float64), new_std.to(torch.float64)
    return w * new_std / std, float(b) + float(w @ ((new_mean.to(torch.float64) - mean.to(torch.float64)) / std))
