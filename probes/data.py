"""From a store to what a probe sees: tasks (which statements, which binary or 3-class target) and
one layer's features (last token, mean, or bags of tokens)."""
from __future__ import annotations

import numpy as np
import torch

from extract.statements import FALSE, NEITHER, TRUE
from extract.store import KIND_SPECIAL, KIND_STATEMENT, KIND_TEMPLATE, ActivationStore
from probes.base import Features

TASKS = ("true_vs_all", "false_vs_all", "neither_vs_all", "true_vs_false", "multiclass")
_POSITIVE = {"true_vs_all": TRUE, "false_vs_all": FALSE, "neither_vs_all": NEITHER, "true_vs_false": TRUE}
TOKEN_KINDS = {"statement": (KIND_STATEMENT,), "all": (KIND_SPECIAL, KIND_TEMPLATE, KIND_STATEMENT)}


class TaskError(ValueError):
    """A task the store's labels cannot support."""


def task_targets(labels: np.ndarray, task: str) -> tuple[np.ndarray, np.ndarray]:
    """Statements used by `task` (int64 [M], indices into `labels`) and their targets int64 [M]:
    1 = positive class for binary tasks; 0 false / 1 true / 2 neither for multiclass."""
    if task not in TASKS:
        raise TaskError(f"unknown task {task!r}: choose one of {', '.join(TASKS)}")
    labels = np.asarray(labels, dtype=np.int64)
    rows = np.flatnonzero(labels != NEITHER) if task == "true_vs_false" else np.arange(len(labels))
    y = labels[rows] if task == "multiclass" else (labels[rows] == _POSITIVE[task]).astype(np.int64)
    needed = (FALSE, TRUE, NEITHER) if task == "multiclass" else (0, 1)
    present = set(np.unique(y).tolist())
    if not set(needed) <= present:
        have = sorted(set(labels.tolist()))
        raise TaskError(f"task {task} needs statements of every class {list(needed)} but the store's labels are "
                        f"{have} (0 false, 1 true, 2 neither): choose a task these labels support")
    return rows, y


def layer_features(store: ActivationStore, layer: int, representation: str, tokens: str = "statement") -> Features:
    """Features of every statement of the store at one layer (one read of that layer).

    representation: last (last token of the chosen kinds) | mean | bags (all tokens of those kinds)
    tokens: statement (statement text only) | all (BOS and chat-template tokens too, as the reference)
    """
    kinds = TOKEN_KINDS[tokens]
    if representation == "bags":
        X, offsets = store.bags(layer, kinds)
        return Features(torch.from_numpy(X), torch.from_numpy(offsets))
    if representation == "last":
        return Features(torch.from_numpy(store.last_token(layer, kinds)))
    if representation == "mean":
        return Features(torch.from_numpy(store.mean(layer, kinds)))
    raise ValueError(f"unknown representation {representation!r}: use last, mean or bags")
