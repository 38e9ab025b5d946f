"""The metrics block of a result cell, shared by `train_probe` (probes/pipeline.py) and `apply_probe`:
evaluation.metrics on the conformal predictions, AUROC from the raw scores, acceptance per label."""
from __future__ import annotations

import numpy as np

from evaluation.conformal import acceptance_by_label
from evaluation.metrics import auroc, evaluate, json_value, weighted_auroc
from evaluation.selective import cluster_bootstrap_indices
from evaluation.multiple_choice import truth_probe_mc
from extract.statements import TRUTHFULQA

# datapack -> (task, table, rows [M], probs [M, K], seed, n_boot) -> the metrics only its cells have
DATAPACK_METRICS = {TRUTHFULQA: truth_probe_mc}


def raw_auroc(y_true, scores) -> float | None:
    """AUROC from raw probe scores [N, heads] (one head: its score of the positive class; one head per
    class: one-vs-rest on the heads' scores); None when undefined."""
    s = np.asarray(scores, dtype=np.float64)
    return json_value(auroc(y_true, s[:, 0] if s.shape[1] == 1 else s))


def auroc_interval(y_true, scores, groups=None, n_boot: int = 1000, seed: int = 0,
                   level: float = 0.95) -> list:
    """Percentile bootstrap interval [lo, hi] of raw_auroc (y_true int [N], scores float [N, heads]): the rows,
    or whole `groups` (int [N], cluster bootstrap), resampled as the cell's other intervals (evaluation.selective.
    cluster_bootstrap_indices with default_rng(seed)); [None, None] where no resample can be scored."""
    y, s = np.asarray(y_true).ravel(), np.asarray(scores, dtype=np.float64)
    draws = cluster_bootstrap_indices(None if groups is None else np.asarray(groups), n_boot,
                                      np.random.default_rng(seed), n=y.size)
    weights = np.stack([np.bincount(rows, minlength=y.size) for rows in draws]).astype(np.float64)
    if s.shape[1] == 1:
        values = weighted_auroc(y == 1, s[:, 0], weights)
    else:   # one-vs-rest macro average over the classes scorable in each resample (as auroc)
        with np.errstate(all="ignore"):
            per_class = np.stack([weighted_auroc(y == k, s[:, k], weights) for k in range(s.shape[1])])
            values = np.where(np.isnan(per_class).all(0), np.nan, np.nanmean(per_class, axis=0))
    values = values[~np.isnan(values)]
    if values.size == 0:
        return [None, None]
    return [float(v) for v in np.percentile(values, [100 * (1 - level) / 2, 100 * (1 + level) / 2])]


def cell_auroc_interval(cell: dict) -> list:
    """A result cell's `metrics.auroc_ci`; for a cell written before it was recorded, the same interval computed
    from its test block (y, scores, groups when cluster-bootstrapped, its n_boot and seed)."""
    m = cell["metrics"]
    if "auroc_ci" in m:
        return m["auroc_ci"]
    test = cell["test"]
    groups = test["groups"] if m.get("bootstrap") == "cluster" else None
    return auroc_interval(test["y"], test["scores"], groups, m["n_boot"], m["seed"], m.get("ci_level", 0.95))


def no_signal(interval) -> bool:
    """True when an AUROC interval [lo, hi] covers 0.5, or is undefined: the probe's scores are not
    distinguishable from chance on its test rows, so its MCC on the accepted rows is no evidence."""
    lo, hi = interval
    return lo is None or hi is None or lo <= 0.5 <= hi


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
    metrics["auroc_ci"] = auroc_interval(y_true, scores, groups, n_boot, seed)
    metrics.update(acceptance_by_label(y_pred, np.asarray(probs).shape[1]))
    return metrics


def datapack_metrics(datapack: str, task: str, table, rows: np.ndarray, probs: np.ndarray, seed: int,
                     n_boot: int) -> dict:
    """The metrics a datapack adds to every cell scoring it (DATAPACK_METRICS; {} for most): e.g. probe
    MC1 / MC2 of a truth probe on TruthfulQA's answers. rows int [M]: the scored statements' table rows."""
    hook = DATAPACK_METRICS.get(datapack)
    return hook(task, table, rows, probs, seed, n_boot) if hook else {}
