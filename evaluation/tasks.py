"""Tasks and label coding: which statements a task uses and the target each one gets.

Labels (extract.statements): 0 = false, 1 = true, 2 = neither. Binary tasks code the positive
class as 1; `multiclass` keeps the three labels.
"""
from __future__ import annotations

import numpy as np

from toolkit.errors import ToolkitError
from extract.statements import FALSE, NEITHER, TRUE

TASKS = ("true_vs_all", "false_vs_all", "neither_vs_all", "true_vs_false", "multiclass")
POSITIVE = {"true_vs_all": TRUE, "false_vs_all": FALSE, "neither_vs_all": NEITHER, "true_vs_false": TRUE}


class TaskError(ToolkitError):
    """A task the store's labels cannot support."""


def task_targets(labels: np.ndarray, task: str) -> tuple[np.ndarray, np.ndarray]:
    """Statements used by `task` (int64 [M], indices into `labels`) and their targets int64 [M]:
    1 = positive class for binary tasks; 0 false / 1 true / 2 neither for multiclass."""
    if task not in TASKS:
        raise TaskError(f"unknown task {task!r}: choose one of {', '.join(TASKS)}")
    labels = np.asarray(labels, dtype=np.int64)
    rows = np.flatnonzero(labels != NEITHER) if task == "true_vs_false" else np.arange(len(labels))
    y = labels[rows] if task == "multiclass" else (labels[rows] == POSITIVE[task]).astype(np.int64)
    needed = (FALSE, TRUE, NEITHER) if task == "multiclass" else (0, 1)
    present = set(np.unique(y).tolist())
    if not set(needed) <= present:
        have = sorted(set(labels.tolist()))
        raise TaskError(f"task {task} needs statements of every class {list(needed)} but the store's labels are "
                        f"{have} (0 false, 1 true, 2 neither): choose a task these labels support")
    return rows, y
