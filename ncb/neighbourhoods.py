"""Neighbour-Consistency Belief (Xu et al., arXiv:2601.05905): neighbourhoods, scores and groups.

A method gives every statement the probability p it assigns to the statement's correct label. The
neighbourhood of a target is the other statements about the same subject entity (`object_1`) in the
same split part (train / calibration / test), whatever their polarity or truth. Then

    ncb(target)       = P(y) * exp(mean_i log p_i)      (geometric mean of the neighbours' p)
    ncb_arith(target) = P(y) * mean_i p_i

with P(y) the target's own p and every p clipped at `clip` (1e-10) from below, as the reference
(zjunlp/belief, calc_belief_score.py) does before its logarithms. NCB is read only where the method's
plain prediction for the target is right ("valid"). High / low groups are the top / bottom fraction
of the valid targets by NCB; with `balance_by_py` the targets are first cut into equal-count bins of
P(y) and the same number of high and low targets is taken inside each bin, so the two groups have the
same P(y) distribution (bin for bin) and NCB cannot stand in for plain confidence.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from evaluation.splits import Split

PARTS = ("train", "calibration", "test")
CLIP = 1e-10


def part_of_rows(split: Split) -> np.ndarray:
    """int8 [n_rows]: 0 train, 1 calibration, 2 test, -1 dropped."""
    part = np.full(split.n_rows, -1, dtype=np.int8)
    for code, name in enumerate(PARTS):
        part[getattr(split, name)] = code
    return part


def neighbourhoods(entities: np.ndarray, parts: np.ndarray, rows: np.ndarray) -> list[np.ndarray]:
    """For each of `rows` (int [M], table rows with a score), the other rows of `rows` with the same
    entity (str [n_rows], "" = none: no neighbours) and the same part (int [n_rows], -1 = dropped:
    no neighbours). Returns M int64 arrays of table rows, ascending."""
    rows = np.asarray(rows, dtype=np.int64)
    frame = pd.DataFrame({"row": rows, "entity": np.asarray(entities, dtype=object)[rows], "part": parts[rows]})
    usable = (frame["entity"] != "") & (frame["part"] >= 0)
    members = {key: np.sort(g["row"].to_numpy()) for key, g in frame[usable].groupby(["entity", "part"])}
    empty = np.zeros(0, dtype=np.int64)
    return [members[(e, p)][members[(e, p)] != r] if ok else empty
            for r, e, p, ok in zip(rows, frame["entity"], frame["part"], usable)]


def ncb_scores(p_y: np.ndarray, neighbour_p: list[np.ndarray], clip: float = CLIP) -> tuple[np.ndarray, np.ndarray]:
    """(ncb [M], ncb_arith [M]) from P(y) [M] and each target's neighbours' p (M arrays); NaN for a
    target without neighbours."""
    geo, arith = np.full(len(p_y), np.nan), np.full(len(p_y), np.nan)
    for i, (py, p) in enumerate(zip(np.maximum(p_y, clip), neighbour_p)):
        if len(p):
            p = np.maximum(np.asarray(p, dtype=np.float64), clip)
            geo[i] = py * np.exp(np.mean(np.log(p)))
            arith[i] = py * np.mean(p)
    return geo, arith


def py_bins(p_y: np.ndarray, n_bins: int) -> np.ndarray:
    """int [M]: equal-count bins of P(y) (bin 0 = lowest; ties broken by position), sizes differing
    by at most one, the larger bins first, as the reference's balance_by_py."""
    order = np.argsort(p_y, kind="stable")
    sizes = np.full(n_bins, len(p_y) // n_bins) + (np.arange(n_bins) < len(p_y) % n_bins)
    bins = np.empty(len(p_y), dtype=np.int64)
    bins[order] = np.repeat(np.arange(n_bins), sizes)
    return bins


def select_groups(ncb: np.ndarray, p_y: np.ndarray, fraction: float, balance_by_py: bool = False,
                  n_bins: int = 5) -> tuple[np.ndarray, np.ndarray]:
    """(high, low): positions into ncb [M] of the top / bottom `fraction` of the targets by NCB
    (ties broken by position). Unbalanced: int(fraction * M) each. balance_by_py: inside each P(y)
    bin (py_bins) the top and bottom int(fraction * bin size), so high and low hold the same number
    of targets from every bin (fraction < 0.5 keeps them disjoint)."""
    if not 0 < fraction < 0.5:
        raise ValueError(f"fraction {fraction} must be in (0, 0.5)")
    bins = py_bins(p_y, n_bins) if balance_by_py else np.zeros(len(ncb), dtype=np.int64)
    high, low = [np.zeros(0, dtype=np.int64)], [np.zeros(0, dtype=np.int64)]
    for b in np.unique(bins):
        members = np.flatnonzero(bins == b)
        ranked = members[np.argsort(-ncb[members], kind="stable")]
        k = int(fraction * len(members))
        high.append(ranked[:k])
        low.append(ranked[len(ranked) - k:])
    return np.sort(np.concatenate(high)), np.sort(np.concatenate(low))
