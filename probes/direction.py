"""The probes whose score is one affine readout of the statement vector (mean_diff, random_direction, ttpd, spca):
their decision, coef_ and intercept_ in one place."""
from __future__ import annotations

import numpy as np
import torch

from probes.base import Probe
from probes.features import Features, statement_vectors


class DirectionProbe(Probe):
    """A probe whose score is one affine readout of the statement vector: decision = X @ direction + threshold,
    from the tensors `direction` float [d] and `threshold` float [] its _fit sets (raw, unstandardised
    coordinates)."""

    width_buffer = "direction"

    def _readout_state(self) -> None:
        """In a subclass's __init__, once its options are set: check them and make the readout's empty buffers."""
        self._check_params()
        self.register_buffer("direction", torch.zeros(0))
        self.register_buffer("threshold", torch.zeros(()))
        self._params: dict = {}

    @torch.no_grad()
    def _decision(self, data: Features) -> np.ndarray:
        X = statement_vectors(data, self.representation).to(self.direction.device)
        return (X.double() @ self.direction.double() + self.threshold.double()).cpu().numpy()

    @property
    def coef_(self) -> np.ndarray:
        """float [d]: decision = X @ coef_ + intercept_."""
        return self.direction.double().cpu().numpy()

    @property
    def intercept_(self) -> float:
        return float(self.threshold)
