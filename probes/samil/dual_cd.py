"""Dual coordinate descent for the hinge SVM (CPU, compiled with numba): the partition guess that the
active-set polish turns into the exact solution (`fit_linear_svm(dual_cd=True)`).

Problem (as in `probes.samil.solver`): ``min_{w,b} 0.5 ||w||^2 + sum_i c_i max(0, rho_i - y_i (w . x_i + b))``,
``X [n, d]``, ``y [n]`` in {-1, +1}, ``c [n]``, ``rho [n]``.

The unregularised bias is what keeps liblinear-style coordinate descent (Hsieh et al., ICML 2008) from
solving it directly: its dual has the equality ``sum_i alpha_i y_i = 0``, which no single coordinate
can move along. Here the bias is handled by proximal-point rounds on ``b``: round k solves::

    min_{w,b} 0.5 ||w||^2 + (b - b_k)^2 / (2 s^2) + sum_i c_i max(0, rho_i - y_i (w . x_i + b))

whose dual is a box-constrained QP in the augmented rows ``[x_i, s]`` with margins ``rho_i - y_i b_k``
(coordinate descent's home ground: one coordinate at a time, ``O(d)`` each, with liblinear's
shrinking); then ``b_{k+1} = b_k + s^2 sum_i alpha_i y_i`` (the round's own bias). The multipliers are
box-feasible for every ``b_k``, so each round starts from the previous one's. After each round the
polish (`exact.polish`) solves the exact KKT system on the round's partition (``alpha_i = 0``, free,
``alpha_i = c_i``), the bias included, and moves the few examples it got wrong; the caller's
certificate (the exact duality gap) decides. ``s`` is the rows' RMS norm, so the bias moves as freely
as the weights.
"""
from __future__ import annotations

import numpy as np
import torch
from numba import njit

from probes.samil import exact
from probes.samil.kernels import float32_rows

ROUNDS = 6             # proximal rounds on the bias at most
BUDGET = 300           # coordinate visits of all rounds together at most, in passes over the examples
PG_TOL = 1e-2          # a round stops when the projected gradients span at most this (margin units)


@njit(cache=True, fastmath=True)
def _coordinate_descent(X, y, c, r, s, alpha, w, wb, sq_norms, max_visits, pg_tol, seed):  # pragma: no cover
    """``min_a 0.5 ||sum_i a_i y_i [x_i, s]||^2 - sum_i r_i a_i`` over ``0 <= a <= c``, in place:
    ``alpha [n]`` (start and result), ``w [d] = sum a y x``, ``wb [1] = s sum a y``. Random order per
    epoch (seeded), shrinking as liblinear does; stops when the projected gradients span at most
    ``pg_tol`` or after about ``max_visits`` coordinate visits. Returns the visits made."""
    n, d = X.shape
    np.random.seed(seed)
    index = np.arange(n)
    active = n
    pg_max_old, pg_min_old = np.inf, -np.inf
    visits = 0
    while visits < max_visits:
        visits += active
        pg_max, pg_min = -np.inf, np.inf
        for k in range(active):
            j = k + np.random.randint(active - k)
            index[k], index[j] = index[j], index[k]
        k = 0
        while k < active:
            i = index[k]
            xi = X[i]
            g = wb[0] * s
            for t in range(d):
                g += w[t] * xi[t]
            g = y[i] * g - r[i]                 # the dual gradient of coordinate i
            ai = alpha[i]
            pg = g
            if ai <= 0.0:
                if g > pg_max_old:              # at its bound and likely to stay: shrink
                    active -= 1
                    index[k], index[active] = index[active], index[k]
                    continue
                pg = min(g, 0.0)
            elif ai >= c[i]:
                if g < pg_min_old:
                    active -= 1
                    index[k], index[active] = index[active], index[k]
                    continue
                pg = max(g, 0.0)
            pg_max = max(pg_max, pg)
            pg_min = min(pg_min, pg)
            if pg != 0.0:
                a_new = min(max(ai - g / (sq_norms[i] + s * s), 0.0), c[i])
                step = (a_new - ai) * y[i]
                alpha[i] = a_new
                for t in range(d):
                    w[t] += step * xi[t]
                wb[0] += step * s
            k += 1
        if pg_max - pg_min <= pg_tol:
            if active == n:
                return visits
            active = n                          # converged on the active part: check every example
            pg_max_old, pg_min_old = np.inf, -np.inf
            continue
        pg_max_old = pg_max if pg_max > 0 else np.inf
        pg_min_old = pg_min if pg_min < 0 else -np.inf
    return visits


def dual_cd_polish(X: torch.Tensor, y: torch.Tensor, c: torch.Tensor, rho: torch.Tensor, b0: float, accept):
    """Proximal rounds on the bias from ``b0``, each followed by a polish on its partition, until
    ``accept(w, b, alpha)`` (the caller's certificate) holds. ``X [n, d]`` float64 on the CPU, ``y``,
    ``c``, ``rho [n]`` float64. Returns ``(w [d], b, alpha [n], info)`` of the accepted solution, or
    ``(None, None, None, info)`` after `ROUNDS` rounds, `BUDGET` passes' worth of coordinate visits or a
    round whose bias moved by at most `PG_TOL` (the caller goes on by another path from ``info["point"]``,
    the last round's ``(w [d], b)``); ``info``: the rounds' visits (in passes) and polish rounds."""
    Xn = np.ascontiguousarray(X.numpy())
    yn, cn, rn = (np.ascontiguousarray(v.numpy()) for v in (y, c, rho))
    sq_norms = np.einsum("ij,ij->i", Xn, Xn)
    X32, held = float32_rows(X)
    Xcd = X32.numpy() if bool(held.all()) else Xn   # (stage 3's token rows: half the bytes)
    s = float(np.sqrt(sq_norms.mean())) or 1.0
    alpha = np.zeros_like(cn)
    b = float(b0)
    info = dict(passes=[], polish=[])
    budget = BUDGET * len(yn)
    for k in range(ROUNDS):
        if budget <= 0:
            break
        w = Xn.T @ (alpha * yn)
        wb = np.array([s * float(alpha @ yn)])
        visits = int(_coordinate_descent(Xcd, yn, cn, rn - yn * b, s, alpha, w, wb, sq_norms, budget, PG_TOL, k))
        budget -= visits
        info["passes"].append(round(visits / len(yn), 1))
        a = torch.from_numpy(alpha)
        guess = torch.where(a <= 0, -1.0, torch.where(a >= c, 2.0, 0.5)).to(torch.float64)   # Z / B / F
        pol = exact.polish(X, y, c, rho, guess, 1.0, working_set=0.0)
        info["polish"].append(None if pol is None else int(pol[3]))
        if pol is not None and accept(*pol[:3]):
            return pol[0], float(pol[1]), pol[2], info
        shift = s * float(wb[0])
        b += shift
        info["point"] = (torch.from_numpy(w), b)
        if abs(shift) <= PG_TOL:     # the bias has settled: the partition, not the bias, is what fails
            break
    return None, None, None, info
