"""Synthetic bags with a planted direction (used by tests and benchmarks, not by the probe)."""
from __future__ import annotations

import numpy as np


def make_planted_bags(n_bags: int = 200, dim: int = 64, mean_len: int = 14, k: int = 2,
                      shift: float = 3.0, seed: int = 0, pos_frac: float = 0.5):
    """Bags with a planted direction, in the project layout.

    Each bag has ``mean_len +- 4`` tokens ~ ``N(0, I)`` plus a bag-level offset
    (``N(0, 0.5^2 I)``, shared by the bag's tokens) and a position effect (the
    last ``k`` tokens of every bag, either class, move by 1.0 along a nuisance
    direction).  In a positive bag, one or two of the last ``k`` tokens are
    shifted by ``shift`` along the planted unit direction ``u``.

    Returns ``X [T, dim]`` float32, ``offsets [N+1]`` int64, ``y [N]`` int64,
    ``planted [T]`` bool (the shifted tokens) and ``u [dim]`` -- numpy arrays.
    """
    rng = np.random.default_rng(seed)
    lengths = rng.integers(mean_len - 4, mean_len + 5, size=n_bags)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    T = int(offsets[-1])
    y = (rng.random(n_bags) < pos_frac).astype(np.int64)
    y[0], y[1] = 0, 1
    u = rng.normal(size=dim)
    u /= np.linalg.norm(u)
    nuis = rng.normal(size=dim)
    nuis -= (nuis @ u) * u
    nuis /= np.linalg.norm(nuis)
    X = rng.normal(size=(T, dim)).astype(np.float32)
    bag_off = rng.normal(scale=0.5, size=(n_bags, dim)).astype(np.float32)
    X += np.repeat(bag_off, lengths, axis=0)
    planted = np.zeros(T, dtype=bool)
    for i in range(n_bags):
        e = offsets[i + 1]
        kk = min(k, lengths[i])
        X[e - kk:e] += nuis.astype(np.float32)
        if y[i]:
            m = int(rng.integers(1, min(2, kk) + 1))
            rows = e - 1 - rng.choice(kk, size=m, replace=False)
            planted[rows] = True
    X[planted] += (shift * u).astype(np.float32)
    return X, offsets, y, planted, u
