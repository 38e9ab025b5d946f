"""Mean-difference probe (closed form, no Trainer).

direction  w = mu1 - mu0                               covariance="none"
           w = Sigma^-1 (mu1 - mu0)                    covariance="shrinkage" (Fisher / LDA direction)
bias       b = -(w . mu1 + w . mu0) / 2                threshold halfway between the projected class means

Sigma is the pooled WITHIN-class covariance: every statement is centred on the mean of its own class
before the second moments are taken, so the class separation itself never enters Sigma (a covariance
of the uncentred or globally centred data would contain the rank-one term (mu1 - mu0)(mu1 - mu0)^T and
shrink the very direction the probe looks for). Sigma is the Ledoit-Wolf shrinkage estimate
(1 - a) S + a * (tr S / d) I of that centred data, with sklearn's `ledoit_wolf` formula for a,
computed in float64 torch on the probe's device.
"""
from __future__ import annotations

import numpy as np
import torch

from probes.base import check_choice, resolve_device, standardiser
from probes.direction import DirectionProbe
from probes.features import Features, statement_vectors

__all__ = ["MeanDiffProbe", "within_class_ledoit_wolf"]


def within_class_ledoit_wolf(X: torch.Tensor, y) -> tuple[torch.Tensor, float]:
    """(Sigma float64 [d, d], shrinkage a): Ledoit-Wolf estimate of the pooled within-class covariance.

    X: [N, d] (any float dtype, any device), y: [N] in {0, 1}. Each class is centred on its own mean;
    the estimate equals `sklearn.covariance.ledoit_wolf(Z, assume_centered=True)` on the centred Z.
    """
    Z = X.to(torch.float64)
    yt = torch.as_tensor(np.asarray(y), device=Z.device, dtype=torch.long)
    n, d = Z.shape
    mu = torch.stack([Z[yt == c].mean(0) for c in (0, 1)])
    Z = Z - mu[yt]
    S = (Z.T @ Z) / n
    trace = torch.diagonal(S).sum()
    m = trace / d                                                 # target scale tr(S) / d
    sq_norms = Z.square().sum(1)
    beta_ = sq_norms.square().sum()                               # sum_k ||z_k||^4
    delta_ = S.square().sum()                                     # ||S||_F^2
    beta = (beta_ / n - delta_) / (d * n)
    delta = (delta_ - 2.0 * m * trace + d * m * m) / d            # ||S - m I||_F^2 / d
    beta = torch.minimum(beta, delta)
    a = 0.0 if float(beta) == 0.0 else float(beta / delta)
    Sigma = (1.0 - a) * S
    Sigma.diagonal().add_(a * m)
    return Sigma, a


class MeanDiffProbe(DirectionProbe):
    """Class-mean-difference direction, optionally whitened by a shrunk within-class covariance.

    Args:
        covariance: "none" (w = mu1 - mu0) or "shrinkage" (w = Sigma^-1 (mu1 - mu0), Ledoit-Wolf).
        representation: "last" or "mean" statement vectors; tokens: "statement" or "all" (see LinearProbe).
        standardize: compute on per-feature standardised vectors (mean / std of the training split),
            folded back so that `coef_` acts on raw vectors. Changes "none" to a mean difference in
            standard-deviation units and makes the shrinkage target scale-aware; default False.
        accelerator: device of the closed-form computation ("auto" -> cuda when available).
    """

    def __init__(self, covariance: str = "shrinkage", representation: str = "last",
                 standardize: bool = False, accelerator: str = "auto", tokens: str = "statement"):
        super().__init__()
        self.covariance, self.representation, self.standardize = covariance, representation, standardize
        self.accelerator, self.tokens = accelerator, tokens
        self._readout_state()

    def _check_params(self) -> None:
        super()._check_params()
        check_choice("covariance", self.covariance, ("none", "shrinkage"))

    @torch.no_grad()
    def _fit(self, train: Features, y: np.ndarray, folds: list | None = None) -> "MeanDiffProbe":   # (folds: unused)
        device = resolve_device(self.accelerator)
        X = statement_vectors(train, self.representation)
        X = X.to(device=device, dtype=torch.float64)
        mean, std = (None, None)
        if self.standardize:
            mean, std = (t.to(X) for t in standardiser(X))
            X = (X - mean) / std
        yt = torch.as_tensor(y, device=device)
        mu0, mu1 = X[yt == 0].mean(0), X[yt == 1].mean(0)
        delta = mu1 - mu0
        params = {"covariance": self.covariance, "representation": self.representation,
                  "standardize": bool(self.standardize)}
        if self.covariance == "shrinkage":
            Sigma, a = within_class_ledoit_wolf(X, y)
            w = self._solve(Sigma, delta)
            params["shrinkage"] = round(a, 8)
        else:
            w = delta
        b = -0.5 * (w @ mu1 + w @ mu0)
        if self.standardize:  # fold the standardisation into (w, b): w.(x - m)/s + b
            w = w / std
            b = b - w @ mean
        self.direction = w.float().cpu()
        self.threshold = b.float().cpu()
        params["norm"] = round(float(w.norm()), 8)
        self._params = params
        return self

    @staticmethod
    def _solve(Sigma: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
        """Sigma^-1 rhs by Cholesky; a tiny ridge is added if Sigma is numerically singular
        (shrinkage 0 with d > N)."""
        scale = float(torch.diagonal(Sigma).mean()) or 1.0
        eye = torch.eye(len(Sigma), dtype=Sigma.dtype, device=Sigma.device)
        for rel in (0.0, 1e-10, 1e-8, 1e-6, 1e-4):
            L, info = torch.linalg.cholesky_ex(Sigma + (rel * scale) * eye if rel else Sigma)
            if int(info) == 0:
                return torch.cholesky_solve(rhs[:, None], L)[:, 0]
        return torch.linalg.lstsq(Sigma, rhs[:, None]).solution[:, 0]
