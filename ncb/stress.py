"""Stress metrics of high / low NCB groups: accuracy under each (interference, level), its drop from the clean
accuracy and the gap high - low, with 95 % intervals from one cluster bootstrap over subject entities.

A target counts with its own clean answer: the direct setting's groups hold valid targets only (clean
accuracy 1, drop = 1 - accuracy); another setting (ncb.settings) may get a group's clean statement wrong,
and its drop is the paired mean of clean - stressed correctness, resampled with the same entities.
"""
from __future__ import annotations

import numpy as np
import pandas as pd
from omegaconf import DictConfig
from tqdm import tqdm

from toolkit.disk import atomic_write
from evaluation.selective import bootstrap_p, cluster_bootstrap_indices


def stress_results(frame: pd.DataFrame, correct: np.ndarray, groups: dict, targets: pd.DataFrame,
                   entities: np.ndarray, cfg: DictConfig, clean: pd.Series | None = None) -> list[dict]:
    """One entry per (interference, level, fraction), in the templates' order: {interference, level, fraction,
    high: {n, n_entities, p_y_mean, ncb_mean, clean_accuracy, accuracy, accuracy_ci, drop, drop_ci}, low: {...},
    gap, gap_ci, gap_p}.

    frame: the stress inputs; correct bool [P] the prediction on each is right; groups {fraction: (high rows,
    low rows)}; targets: ncb.run.belief_targets indexed by row; entities str [N] of the table; clean: bool
    by target row, the prediction on the clean statement right (None: every group member's is)."""
    results = []
    variants = [(i, str(level)) for i, levels in cfg.stress.interferences.items() for level in levels]
    for interference, level in tqdm(variants, desc="stress bootstrap", unit="variant", leave=False):
        chosen = ((frame["interference"] == interference) & (frame["level"] == level)).to_numpy()
        ok = pd.Series(correct[chosen], index=frame["target_row"].to_numpy()[chosen])
        for fraction, (high, low) in groups.items():
            high, low = high[np.isin(high, ok.index)], low[np.isin(low, ok.index)]
            before = [np.ones(len(m), dtype=bool) if clean is None else clean[m].to_numpy() for m in (high, low)]
            stats = _accuracies(ok[high].to_numpy(), ok[low].to_numpy(), *before, entities[high], entities[low],
                                int(cfg.n_boot), int(cfg.seed))
            for side, members in (("high", high), ("low", low)):
                stats[side] = {"n": int(len(members)), "n_entities": int(len(set(entities[members]))),
                               "p_y_mean": _mean(targets.loc[members, "p_y"]),
                               "ncb_mean": _mean(targets.loc[members, "ncb"]), **stats[side]}
            results.append({"interference": interference, "level": level, "fraction": fraction, **stats})
    return results


def _accuracies(high: np.ndarray, low: np.ndarray, high_clean: np.ndarray, low_clean: np.ndarray, high_entities,
                low_entities, n_boot: int, seed: int) -> dict:
    """Accuracy of each group (bool arrays, stressed; *_clean the same targets' clean answers), clean
    accuracy, drop = clean accuracy - accuracy, gap = high - low accuracy, with percentile 95 % intervals
    from one cluster bootstrap over the entities of both groups, and the gap's two-sided bootstrap p-value
    (gap_p, unadjusted)."""
    values = np.concatenate([high, low]).astype(np.float64)
    before = np.concatenate([high_clean, low_clean]).astype(np.float64)
    is_high = np.arange(len(values)) < len(high)
    draws = []        # per resample: accuracy high, low; drop high, low
    if len(values):
        for idx in cluster_bootstrap_indices(np.concatenate([high_entities, low_entities]), n_boot, seed):
            sides = [is_high[idx], ~is_high[idx]]
            acc = [values[idx][s].mean() if s.any() else np.nan for s in sides]
            draws.append(acc + [before[idx][s].mean() - a if s.any() else np.nan for s, a in zip(sides, acc)])
    draws = np.asarray(draws, dtype=np.float64).reshape(-1, 4)

    def interval(x):
        x = x[~np.isnan(x)]
        return [float(v) for v in np.percentile(x, [2.5, 97.5])] if len(x) else None

    acc, clean = [_mean(high), _mean(low)], [_mean(high_clean), _mean(low_clean)]
    out = {}
    for k, side in enumerate(("high", "low")):
        out[side] = {"clean_accuracy": clean[k], "accuracy": acc[k], "accuracy_ci": interval(draws[:, k]),
                     "drop": None if acc[k] is None else clean[k] - acc[k], "drop_ci": interval(draws[:, 2 + k])}
    out["gap"] = None if None in acc else acc[0] - acc[1]
    gaps = draws[:, 0] - draws[:, 1]
    out["gap_ci"] = interval(gaps)
    out["gap_p"] = None if out["gap"] is None else bootstrap_p(gaps[~np.isnan(gaps)])   # raw: Holm in the report
    return out


def _mean(x) -> float | None:
    x = np.asarray(x, dtype=np.float64)
    return float(x.mean()) if len(x) else None


def write_csv(path, frame: pd.DataFrame) -> None:
    """A table as CSV (no index), atomically."""
    data = frame.to_csv(index=False).encode()
    atomic_write(path, lambda f: f.write(data))
