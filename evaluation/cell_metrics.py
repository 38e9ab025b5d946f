"""The metrics block of a result cell, shared by `train_probe` (probes/pipeline.py) and `apply_probe`:
evaluation.metrics on the conformal predictions, AUROC from the raw scores, acceptance per label."""
from __future__ import annotations

import numpy as np

from evaluation.conformal import acceptance_by_label
from evaluation.metrics import auroc, evaluate, json_value
from evaluation.multiple_choice import truth_probe_mc
from extract.statements import TRUTHFULQA

# datapack -> (task, table, rows [M], probs [M, K], seed, n_boot) -> the metrics only its cells have
DATAPACK_METRICS = {TRUTHFULQA: truth_probe_mc}


def raw_auroc(y_true, scores) -> float | None:
    """AUROC from raw probe scores [N, heads] (one head: its score of the positive class; one head per
    class: one-vs-rest on the heads' scores); None when undefined."""
    s = np.asarray(scores, dtype=np.float64)
    return json_value(auroc(y_true, s[:, 0] if s.shape[1] == 1 else s))


def cell_metrics(y_true, scores, probs, y_pred, sets, groups=None, seed: int = 0, n_boot: int = 1000) -> dict:
    """The metrics block of a result cell (train_probe's and apply_probe's): `evaluate` on the class
    probabilities, the conformal predictions and sets; `auroc` from the raw scores (`auroc_probs` from
    the probabilities); the accepted predictions per label.

    y_true int [N]; scores float [N, heads]; probs float [N, K]; y_pred int [N] (-1 = abstained);
    sets bool [N, K]; groups int [N] for the cluster bootstrap, None for the i.i.d. one
    (see `resampling_groups`)."""
    metrics = evaluate(y_true, y_pred, probs, sets=sets, seed=seed, n_boot=n_boot, groups=groups)
    metrics["auroc_probs"] = metrics["auroc"]
    metrics["auroc"] = raw_auroc(y_true, scores)
    metrics.update(acceptance_by_label(y_pred, np.asarray(probs).shape[1]))
    return metrics


def datapack_metrics(datapack: str, task: str, table, rows: np.ndarray, probs: np.ndarray, seed: int,
                     n_boot: int) -> dict:
    """The metrics a datapack adds to every cell scoring it (DATAPACK_METRICS; {} for most): e.g. probe
    MC1 / MC2 of a truth probe on TruthfulQA's answers. rows int [M]: the scored statements' table rows."""
    hook = DATAPACK_METRICS.get(datapack)
    return hook(task, table, rows, probs, seed, n_boot) if hook else {}
