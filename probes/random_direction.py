"""Random-direction control: a probe that learns no direction (experiments' floor beside mean_diff).

direction  u ~ N(0, I) in per-feature standardised coordinates (mean / std of the training rows), then
           u <- sign(u . (mu1 - mu0)) u                 oriented towards the positive class
bias       b = -(u . mu1 + u . mu0) / 2                 halfway between the projected class means

so it is calibrated exactly like `mean_diff` (covariance="none", standardize=true) but for the direction,
which no label chose: what a fitted probe earns above it is what its direction adds. (u, b) are folded
back so that `coef_` acts on raw vectors.
"""
from __future__ import annotations

import numpy as np
import torch

from probes.base import check_positive, resolve_device, standardiser
from probes.direction import DirectionProbe
from probes.features import Features, statement_vectors

__all__ = ["RandomDirectionProbe"]


class RandomDirectionProbe(DirectionProbe):
    """A random direction, oriented and thresholded on the training rows.

    Args:
        seed: the direction's seed; None draws from torch's global generator (the pipeline seeds it per
            head and fold, probes.fitting.head_seed), an int from a generator of its own.
        representation: "last" or "mean" statement vectors; tokens: "statement" or "all" (see LinearProbe).
        accelerator: device of the computation ("auto" -> cuda when available).
    """

    def __init__(self, seed: int | None = None, representation: str = "last", accelerator: str = "auto",
                 tokens: str = "statement"):
        super().__init__()
        self.seed, self.representation, self.accelerator, self.tokens = seed, representation, accelerator, tokens
        self._readout_state()

    def _check_params(self) -> None:
        super()._check_params()
        if self.seed is not None:
            check_positive("seed", self.seed, integer=True, allow_zero=True)

    @torch.no_grad()
    def _fit(self, train: Features, y: np.ndarray, folds: list | None = None) -> "RandomDirectionProbe":
        device = resolve_device(self.accelerator)
        X = statement_vectors(train, self.representation).to(device=device, dtype=torch.float64)
        mean, std = (t.to(X) for t in standardiser(X))
        Z = (X - mean) / std
        generator = None if self.seed is None else torch.Generator().manual_seed(int(self.seed))
        u = torch.randn(Z.shape[1], generator=generator, dtype=torch.float64).to(device)
        u = u / u.norm()
        yt = torch.as_tensor(y, device=device)
        mu0, mu1 = Z[yt == 0].mean(0), Z[yt == 1].mean(0)
        if float(u @ (mu1 - mu0)) < 0:
            u = -u
        b = -0.5 * (u @ mu1 + u @ mu0)
        w = u / std                                  # u.(x - m)/s + b = (u/s).x + b - (u/s).m
        self.direction = w.float().cpu()
        self.threshold = (b - w @ mean).float().cpu()
        self._params = {"seed": self.seed, "representation": self.representation,
                        "separation": round(float(u @ (mu1 - mu0)), 8)}
        return self
