"""The interface every probe shares, and the features it is fitted on.

A probe is a LightningModule with three methods:

    fit(train: Features, y: int [N] in {0, 1}) -> self     fitted on the training split only
    decision_function(data: Features) -> float [N]         higher = more of the positive class
    params() -> dict                                       chosen hyperparameters (JSON-serialisable)

Calibration, conformal abstention and metrics are computed from the scores by shared code
(probes/pipeline.py), never inside a probe. Probes trained by gradient descent run a
`lightning.Trainer` inside `fit`; `accelerator` ("auto", "cpu", "gpu") chooses the device.
"""
from __future__ import annotations

from dataclasses import dataclass

import lightning as L
import numpy as np
import torch


@dataclass
class Features:
    """One layer's representation of N statements.

    X        float32 [N, d] one vector per statement (representation last / mean), or
             float32 [T, d] token vectors when `offsets` is given (representation bags)
    offsets  int64 [N+1] or None: statement i owns rows offsets[i]:offsets[i+1] of X
    groups   int64 [N] or None: group of each statement (statements sharing an entity share a
             group), for grouped cross-validation inside `fit`
    """
    X: torch.Tensor
    offsets: torch.Tensor | None = None
    groups: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.X) if self.offsets is None else len(self.offsets) - 1

    @property
    def is_bags(self) -> bool:
        return self.offsets is not None

    def subset(self, index: np.ndarray) -> "Features":
        """The statements `index` (int [M]), in that order."""
        index = np.asarray(index, dtype=np.int64)
        groups = None if self.groups is None else self.groups[index]
        if self.offsets is None:
            return Features(self.X[torch.from_numpy(index)], None, groups)
        starts, ends = self.offsets[:-1][index], self.offsets[1:][index]
        lengths = ends - starts
        rows = torch.repeat_interleave(starts - torch.cumsum(lengths, 0) + lengths, lengths) + torch.arange(int(lengths.sum()))
        offsets = torch.zeros(len(index) + 1, dtype=torch.long)
        offsets[1:] = torch.cumsum(lengths, 0)
        return Features(self.X[rows], offsets, groups)


class Probe(L.LightningModule):
    """Base class: subclasses set `representation` and implement fit / decision_function, and put
    their chosen hyperparameters in `self._params`. `state_dict()` carries the fitted tensors and
    `params()`, and a freshly built probe of the same settings loads it."""

    representation = "last"  # "last" | "mean" | "bags"

    def fit(self, train: Features, y: np.ndarray) -> "Probe":
        raise NotImplementedError

    def decision_function(self, data: Features) -> np.ndarray:
        raise NotImplementedError

    def params(self) -> dict:
        return dict(getattr(self, "_params", {}))

    def get_extra_state(self):
        return {"params": self.params()}

    def set_extra_state(self, state) -> None:
        self._params = dict(state.get("params", {}))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        resize_placeholders(self, state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def resize_placeholders(module: torch.nn.Module, state_dict: dict, prefix: str) -> None:
    """Before `load_state_dict`: give the module's own unfitted (empty) parameters and buffers the
    shapes stored in `state_dict`, so a fresh probe can load a fitted one's state."""
    for name, tensor in list(module._parameters.items()) + list(module._buffers.items()):
        stored = state_dict.get(prefix + name)
        if tensor is None or stored is None or stored.shape == tensor.shape or tensor.numel() != 0:
            continue
        fresh = torch.zeros(stored.shape, dtype=tensor.dtype, device=tensor.device)
        if name in module._parameters:
            module._parameters[name] = torch.nn.Parameter(fresh, requires_grad=tensor.requires_grad)
        else:
            module._buffers[name] = fresh
