"""Fitted probes you can keep: a result cell's heads saved beside it, loaded back without Hydra or
the store.

    results/.../layer=<k>/seed=<s>.json                the cell (config, score map, conformal state)
    results/.../layer=<k>/seed=<s>.probe.safetensors   the fitted heads' tensors (head<i>.<name>)

`load_probe(path)` (either file) returns a `FittedProbe` that scores raw activations of the stored
layer exactly as the cell did: X [n, d] statement vectors (last / mean representation, as the
cell's probe read them; the probe applies its own standardiser), or `(X [T, d], offsets [n+1])`
token bags for samil. numpy arrays and torch tensors are accepted, so activations from other tools
(nnsight, TransformerLens) can be probed too.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from hydra.utils import get_class
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from evaluation.calibration import ScoreMap
from evaluation.cells import CellError, atomic_write, read_cell
from evaluation.conformal import ConformalClassifier, ReferenceConformal
from probes.base import Probe
from probes.features import Features

SUFFIX = ".probe.safetensors"


def artifact_path(cell: Path) -> Path:
    """The heads' file beside a cell: seed=<s>.json -> seed=<s>.probe.safetensors."""
    return Path(cell).with_name(Path(cell).stem + SUFFIX)


def save_heads(path: Path, heads: list[Probe]) -> None:
    """Every tensor of every head's state_dict, as `head<i>.<name>`, atomically."""
    tensors = {f"head{i}.{k}": v.detach().cpu().contiguous() for i, head in enumerate(heads)
               for k, v in head.state_dict().items() if isinstance(v, torch.Tensor)}
    data = save_tensors(tensors)
    atomic_write(path, lambda f: f.write(data))


class FittedProbe:
    """A cell's fitted and calibrated probe (see the module docstring for the input X)."""

    def __init__(self, cell: dict, heads: list[Probe]):
        self.cell, self.heads = cell, heads
        self.layer, self.store = cell["layer"], cell.get("store", {})
        self.representation, self.tokens = heads[0].representation, heads[0].tokens
        self.score_map = ScoreMap.from_dict(cell["calibration"]["map"])
        conformal = cell["conformal"]
        self.reference = "calibration_scores" in conformal
        self.conformal = (ReferenceConformal if self.reference else ConformalClassifier).from_dict(conformal)

    def _features(self, X) -> Features:
        if isinstance(X, Features):
            return X
        if isinstance(X, tuple):
            tokens, offsets = (torch.as_tensor(np.asarray(a)) for a in X)
            return Features(tokens.float(), offsets.long())
        return Features(torch.as_tensor(np.asarray(X, dtype=np.float32)))

    def decision_function(self, X) -> np.ndarray:
        """float [n, heads]: one score per head (one head for binary tasks, one per class for multiclass)."""
        data = self._features(X)
        return np.stack([np.asarray(h.decision_function(data), dtype=np.float64) for h in self.heads], axis=1)

    def predict_proba(self, X) -> np.ndarray:
        """float [n, K] class probabilities (K = 2 for binary tasks)."""
        return self.score_map.predict_proba(self.decision_function(X))

    def _conformal_input(self, X) -> np.ndarray:
        scores = self.decision_function(X)
        probs = self.score_map.predict_proba(scores)
        return scores[:, 0] if self.reference and probs.shape[1] == 2 else probs

    def predict_set(self, X) -> np.ndarray:
        """bool [n, K] conformal prediction sets."""
        return self.conformal.predict_sets(self._conformal_input(X))

    def predict(self, X) -> np.ndarray:
        """int [n]: the label of a one-label set, -1 (abstain) otherwise."""
        return self.conformal.predict(self._conformal_input(X))


def load_probe(path) -> FittedProbe:
    """The fitted probe of a result cell; `path` is the cell's .json or its .probe.safetensors."""
    path = Path(path)
    cell_file = path.with_name(path.name[: -len(SUFFIX)] + ".json") if path.name.endswith(SUFFIX) else path
    cell, weights = read_cell(cell_file), artifact_path(cell_file)
    if not weights.is_file():
        raise CellError(f"{cell_file} has no saved probe ({weights.name}): rerun train_probe with overwrite=true")
    tensors = load_tensors(weights.read_bytes())
    options = {k: v for k, v in cell["config"]["probe"].items() if k not in ("name", "_target_")}
    target = str(cell["config"]["probe"]["_target_"])
    cls = get_class(target) if target.startswith("probes.") else None
    if not (isinstance(cls, type) and issubclass(cls, Probe)):
        raise CellError(f"{cell_file}: probe class {target!r} is not a probe of this toolkit")
    heads = []
    for i, params in enumerate(cell["probe_params"].values()):
        head = cls(**options, accelerator="cpu")
        state = {k.split(".", 1)[1]: v for k, v in tensors.items() if k.startswith(f"head{i}.")}
        if "_extra_state" in head.state_dict():
            state["_extra_state"] = {"params": params}
        head.load_state_dict(state)
        heads.append(head.eval())
    return FittedProbe(cell, heads)
