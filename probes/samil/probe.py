"""sAwMIL behind the shared Probe interface: standardised token bags, C chosen by grouped CV."""
from __future__ import annotations

import numpy as np
import torch

from evaluation.metrics import auroc
from probes.base import Probe, ProbeError, check_labels, kfold_splits, resolve_device, standardiser
from probes.features import Features
from probes.samil.bags import matvec, segment_max
from probes.samil.estimator import SAwMIL


class SAwMILProbe(Probe):
    """sAwMIL on the token bags of each statement (representation "bags").

    Token vectors are standardised with the mean and std of the training instances (as the
    reference code does; without it the few high-variance residual dimensions decide the SVM and
    real-data AUROC falls to chance). C is chosen from `Cs` by grouped cross-validation on the
    training bags (folds never split a group of statements sharing an entity; each fold standardised
    on its own training part), by held-out bag AUROC; `C` fixes it instead. `tokens` chooses the
    bag's tokens ("statement" or "all"); the other arguments are those of `SAwMIL` (`stage3_weights`
    "balanced" by default, "none" = the reference's unweighted stage 3). Runs on the accelerator's
    device ("auto": CUDA if present).

    `params()["degenerate"]` is true when the final fit is degenerate: ||coef|| <= DEGENERATE_NORM
    or every training bag gets the same score (such a probe's metrics are those of a constant).

    Fitted state (buffers, so `state_dict()` restores the probe): coef [d], intercept [],
    mean [d], std [d]; the bag score is max over the bag's tokens of coef . (x - mean) / std + intercept.
    """

    def __init__(self, C: float | None = None, Cs=(10.0, 100.0, 1000.0), cv_folds: int = 3,
                 eta: float | None = None, k: int = 2, c_scaling: str = "per_instance",
                 stage3_weights: str = "balanced", standardize: bool = True, accelerator: str = "auto", seed: int = 0,
                 tokens: str = "statement", **solver):
        super().__init__()
        self._set_input("bags", tokens, representations=("bags",))
        if not isinstance(standardize, bool):
            raise ProbeError(f"standardize={standardize!r}: use true or false")
        self.C, self.Cs, self.cv_folds, self.standardize = C, tuple(Cs), cv_folds, standardize
        self.options = dict(eta=eta, k=k, c_scaling=c_scaling, stage3_weights=stage3_weights, seed=seed, **solver)
        for c in (self.Cs if C is None else (C,)):
            SAwMIL(C=c, **self.options).check_params()  # bad options fail now, not at the first fit
        self.solve_device = resolve_device(accelerator)
        self.register_buffer("coef", torch.zeros(0, dtype=torch.float64))
        self.register_buffer("intercept", torch.zeros((), dtype=torch.float64))
        self.register_buffer("mean", torch.zeros(0))
        self.register_buffer("std", torch.ones(0))
        self._params: dict = {}

    def _fit_one(self, C: float, train: Features, y: np.ndarray) -> tuple[SAwMIL, torch.Tensor, torch.Tensor]:
        """SAwMIL at C on `train`'s bags, standardised on them: (model, mean [d], std [d])."""
        d = train.X.shape[1]
        mean, std = standardiser(train.X) if self.standardize else (torch.zeros(d), torch.ones(d))
        model = SAwMIL(C=C, device=self.solve_device, **self.options)
        return model.fit((train.X - mean) / std, train.offsets, y), mean, std

    def fit(self, train: Features, y) -> "SAwMILProbe":
        y = check_labels(y, len(train))
        cv_auroc = {} if self.C is not None else self._cross_validate(train, y)
        C = self.C if self.C is not None else max(self.Cs, key=lambda c: (cv_auroc.get(c, -1.0), -c))
        if self.C is None and not cv_auroc:
            C = self.Cs[len(self.Cs) // 2]  # too few groups for folds: the middle of the grid
        model, self.mean, self.std = self._fit_one(C, train, y)
        self.coef, self.intercept = model.coef_.cpu(), torch.tensor(model.intercept_, dtype=torch.float64)
        options = {k: v for k, v in self.options.items() if isinstance(v, (int, float, str, type(None)))}
        train_scores = self.decision_function(train)
        self._params = {**options, "eta_target": options["eta"], "C": float(C), "Cs": [float(c) for c in self.Cs],
                        "cv_auroc": {str(c): a for c, a in cv_auroc.items()}, "eta": float(model.eta_),
                        "fallback_used": bool(model.fallback_used_), "standardize": self.standardize,
                        "coef_norm": model.fit_info_["stage3"]["coef_norm"],
                        "degenerate": bool(model.degenerate_ or np.ptp(train_scores) == 0.0),
                        "fit_seconds": model.fit_info_["seconds"]}
        return self

    def _cross_validate(self, train: Features, y: np.ndarray) -> dict[float, float]:
        """Held-out bag AUROC of every C of `Cs` over grouped folds ({} when no folds are possible)."""
        folds = kfold_splits(y, train.groups, self.cv_folds, self.options["seed"])
        if not folds:
            return {}
        held_all = np.concatenate([held for _, held in folds])
        result = {}
        for C in self.Cs:
            scores = np.empty(len(y))
            for fit_idx, held_idx in folds:
                model, mean, std = self._fit_one(C, train.subset(fit_idx), y[fit_idx])
                held = train.subset(held_idx)
                scores[held_idx] = model.decision_function(((held.X - mean) / std).numpy(), held.offsets.numpy())
            result[C] = auroc(y[held_all], scores[held_all])
        return result

    def decision_function(self, data: Features) -> np.ndarray:
        """float64 [N]: bag scores (max over each bag's token scores)."""
        if self.coef.numel() == 0:
            raise RuntimeError("SAwMILProbe is not fitted")
        scores = matvec((data.X - self.mean) / self.std, self.coef) + float(self.intercept)   # [T]
        return segment_max(scores, data.offsets, empty=float(self.intercept)).numpy()
