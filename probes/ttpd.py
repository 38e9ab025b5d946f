"""TTPD, Training of Truth and Polarity Direction (Buerger, Hamprecht & Nadler 2024, "Truth is Universal:
Robust Detection of Lies in LLMs", arXiv:2407.12831; the Trilemma of Truth reference code runs it as a
baseline, probes/ttpd.py and runners/runner_ttpd.py of carlomarxdk/trilemma-of-truth).

The paper models a statement's activation as

    z_i = mu + tau_i t_G + tau_i p_i t_P + noise        tau_i = +1 true / -1 false, p_i = +1 affirmative / -1 negated

(z: standardised vectors of the training rows, as the reference, centred on their mean) and fits, in order,

    (t_G, t_P)  = argmin sum_i || z_i - mu - tau_i t_G - tau_i p_i t_P ||^2      ordinary least squares, closed form:
                  [t_G; t_P] = (A^T A)^-1 A^T Z with A = [tau, tau * p]  [N, 2]   (A = [tau] when one polarity only)
    p_dir       = the weights of an unpenalised logistic regression of "affirmative" on z   (polarity direction)
    (a, c)      = an unpenalised logistic regression of the label on the 2-D projection (z . t_G, z . p_dir)

decision(x) = a_1 (z . t_G) + a_2 (z . p_dir) + c with z = (x - mean) / std, folded into one affine map of x
(`coef_`, `intercept_`). t_P (the polarity-sensitive truth direction) is kept for inspection, not for scoring,
as in the paper. The fit needs each training statement's polarity (`Features.negation`); scoring does not.
"""
from __future__ import annotations

import warnings

import numpy as np
import torch
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LogisticRegression

from probes.base import ProbeError, check_positive, resolve_device, standardiser
from probes.direction import DirectionProbe
from probes.features import Features, statement_vectors

__all__ = ["TTPDProbe", "truth_directions"]


def truth_directions(Z: torch.Tensor, tau: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(t_G, t_P) float64 [d] each: the least-squares solution of Z - mean(Z) = tau t_G + tau p t_P.

    Z [N, d]; tau [N] in {-1, +1} (truth); p [N] in {-1, +1} (polarity). With one polarity only the design is
    [tau] alone and t_P is zeros (the paper's rule)."""
    Zc = Z.double() - Z.double().mean(0)
    tau, p = tau.double(), p.double()
    both = bool((p > 0).any() and (p < 0).any())
    A = torch.stack([tau, tau * p], 1) if both else tau[:, None]
    W = torch.linalg.solve(A.T @ A, A.T @ Zc)                      # [k, d]
    return W[0], W[1] if both else torch.zeros_like(W[0])


def _logistic(X: np.ndarray, y: np.ndarray, C: float | None, max_iter: int) -> tuple[np.ndarray, float, bool, int]:
    """(weights [k], intercept, converged, iterations) of sklearn's logistic regression (C None: unpenalised, C=inf)."""
    model = LogisticRegression(C=np.inf if C is None else float(C), max_iter=max_iter)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConvergenceWarning)
        model.fit(X, y)
    converged = not any(issubclass(w.category, ConvergenceWarning) for w in caught)
    return model.coef_[0], float(model.intercept_[0]), converged, int(model.n_iter_[0])


class TTPDProbe(DirectionProbe):
    """TTPD: logistic regression on the projection onto the general truth direction and the polarity direction.

    Args:
        polarity_C: inverse L2 strength of the polarity logistic regression; None: unpenalised (the paper and
            the reference). With d > N the two polarities are separable and the unpenalised fit only stops at
            max_iter (its direction still converges); `params()["polarity_converged"]` says which.
        max_iter: iterations of each logistic regression (sklearn's lbfgs).
        standardize: z = per-feature standardised vectors of the training rows (the reference's StandardScaler);
            False: only centred (the paper's original code).
        representation: "last" or "mean" statement vectors; tokens: "statement" or "all" (see LinearProbe).
        accelerator: device of the least-squares step ("auto" -> cuda when available).

    `n_iter_`: lbfgs iterations of the 2-D logistic regression.
    """

    def __init__(self, polarity_C: float | None = None, max_iter: int = 1000, standardize: bool = True,
                 representation: str = "last", accelerator: str = "auto", tokens: str = "statement"):
        super().__init__()
        self.polarity_C, self.max_iter, self.standardize = polarity_C, max_iter, standardize
        self.representation, self.accelerator, self.tokens = representation, accelerator, tokens
        self._check_params()
        for name in ("mean", "std", "truth_direction", "polarity_truth", "polarity_direction", "direction"):
            self.register_buffer(name, torch.zeros(0))
        self.register_buffer("threshold", torch.zeros(()))
        self._params: dict = {}

    def _check_params(self) -> None:
        super()._check_params()
        if self.polarity_C is not None:
            check_positive("polarity_C", self.polarity_C)
        check_positive("max_iter", self.max_iter, integer=True)

    @torch.no_grad()
    def _fit(self, train: Features, y: np.ndarray, folds: list | None = None) -> "TTPDProbe":   # (folds: unused)
        if train.negation is None:
            raise ProbeError("probe=ttpd needs each training statement's polarity: give Features with `negation` "
                             "(bool [N], as train_probe sets from the store's negation column)")
        device = resolve_device(self.accelerator)
        X = statement_vectors(train, self.representation).to(device=device, dtype=torch.float64)
        mean, std = (t.to(X) for t in standardiser(X))
        if not self.standardize:
            std = torch.ones_like(std)
        Z = (X - mean) / std
        negated = np.asarray(train.negation, dtype=bool)
        tau = torch.as_tensor(2.0 * y - 1.0, device=device)
        p = torch.as_tensor(np.where(negated, -1.0, 1.0), device=device)
        t_G, t_P = truth_directions(Z, tau, p)
        Zn = Z.cpu().numpy()
        if negated.all() or not negated.any():
            p_dir, polarity_converged = np.zeros(Z.shape[1]), True
        else:
            p_dir, _, polarity_converged, _ = _logistic(Zn, (~negated).astype(np.int64), self.polarity_C, self.max_iter)
        basis = np.stack([t_G.cpu().numpy(), p_dir], 1)              # [d, 2]
        a, c, converged, self.n_iter_ = _logistic(Zn @ basis, y, None, self.max_iter)
        w = torch.as_tensor(basis @ a, device=device) / std           # a . (B^T (x - m) / s) + c
        self.mean, self.std = mean.float().cpu(), std.float().cpu()
        self.truth_direction, self.polarity_truth = t_G.float().cpu(), t_P.float().cpu()
        self.polarity_direction = torch.as_tensor(p_dir, dtype=torch.float32)
        self.direction = w.float().cpu()
        self.threshold = torch.as_tensor(c - float(w @ mean), dtype=torch.float32)
        self._params = {"representation": self.representation, "standardize": bool(self.standardize),
                        "polarity_C": self.polarity_C, "n_negated": int(negated.sum()),
                        "n_affirmative": int((~negated).sum()), "projection_weights": [round(float(v), 8) for v in a],
                        "polarity_converged": bool(polarity_converged), "converged": bool(converged)}
        return self
