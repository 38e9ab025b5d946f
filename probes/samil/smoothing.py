"""Newton's method on the quadratically smoothed hinge objective (step 1 of `fit_linear_svm`).

Unknowns ``theta = (w [d], b)``; examples ``X [n, d]``, ``y [n]`` in {-1, +1}, weights ``c [n]``,
margin targets ``rho [n]``; hinge arguments ``u = rho - y (X w + b)``.
"""
from __future__ import annotations

import torch

from probes.samil.bags import CHUNK_ROWS, gram

HESS_CAP = 8192      # Newton Hessians use at most this many (stride-sampled) rows ...
HESS32_MIN = 2048    # ... accumulated in float32 above this many rows


def hessian(X: torch.Tensor, idx: torch.Tensor, s: torch.Tensor, eye: torch.Tensor) -> torch.Tensor:
    """``eye + sum_{i in idx} s_i x~_i x~_i^T`` with ``x~ = [x, 1]`` -> ``[d+1, d+1]`` float64.

    Large sets are stride-subsampled to ``HESS_CAP`` rows (weights scaled up) and
    accumulated in float32: the Hessian only shapes the Newton direction, the
    gradient (and so the fixed point) stays exact float64.
    """
    d = X.shape[1]
    if idx.numel() == 0:
        return eye.clone()
    H = torch.zeros_like(eye)
    if idx.numel() > HESS_CAP:
        stride = -(-idx.numel() // HESS_CAP)
        idx, s = idx[::stride], s[::stride] * stride
    hd = torch.float32 if idx.numel() > HESS32_MIN else torch.float64
    for st in range(0, idx.numel(), CHUNK_ROWS):
        Xq = X.index_select(0, idx[st:st + CHUNK_ROWS])               # [m, d] float64
        sq = s[st:st + CHUNK_ROWS]
        H[:d, :d] += gram((Xq * sq.sqrt()[:, None]).to(hd))
        col = Xq.T @ sq
        H[:d, d] += col
        H[d, :d] += col
        H[d, d] += sq.sum()
    return H + eye


def newton_level(X, y, c, rho, u, w, b, mu, eye, max_steps):
    """Newton's method on the mu-smoothed objective, from ``(w, b)``.

    ``u`` ``[n]`` are the hinge arguments ``rho - y (X w + b)`` at the start (kept
    up to date incrementally).  Returns ``(w, b, u, steps)``.
    """
    d = X.shape[1]
    steps = 0
    while steps < max_steps:
        lin = u >= mu
        band = (u > 0) & ~lin
        dh = torch.where(lin, torch.ones_like(u), torch.where(band, u / mu, torch.zeros_like(u)))
        hs = torch.where(lin, u - 0.5 * mu, torch.where(band, u * u / (2 * mu), torch.zeros_like(u)))
        Fs = float(0.5 * (w @ w) + (c * hs).sum())
        ay = c * dh * y                                                   # alpha_i y_i
        g = torch.cat([w - X.T @ ay, (-ay.sum()).reshape(1)])            # [d+1]
        q_idx = torch.nonzero(band, as_tuple=False).reshape(-1)
        H = hessian(X, q_idx, c[q_idx] / mu, eye)
        H[d, d] += 1e-10 * (1.0 + float(H[d, d]))        # keeps the system solvable (empty band)
        L, info = torch.linalg.cholesky_ex(H)
        jit = 1e-12 * float(torch.diagonal(H).abs().max())
        tries = 0
        while int(info) != 0:
            if tries == 12 or not bool(torch.isfinite(H).all()):
                raise FloatingPointError("Newton system is not positive definite (non-finite data?)")
            L, info = torch.linalg.cholesky_ex(H + jit * torch.eye(d + 1, dtype=H.dtype, device=H.device))
            jit *= 100.0
            tries += 1
        p = -torch.cholesky_solve(g[:, None], L).reshape(-1)
        decrement = float(-(g @ p))
        steps += 1
        if decrement <= 1e-13 * max(1.0, abs(Fs)):
            break
        # exact line search on phi(t) = F_mu(theta + t p)  (convex, piecewise quadratic)
        p_w, p_b = p[:d], float(p[d])
        v = -y * (X @ p_w + p_b)                                          # du/dt  [n]
        wp, pp = float(w @ p_w), float(p_w @ p_w)
        cv = c * v
        # On t in [0, 1] only the examples whose u crosses (0, mu) have a varying
        # h'; the others contribute a constant (cheap evaluations for the search).
        u1 = u + v
        const_one = (u >= mu) & (u1 >= mu)
        moving = ~const_one & ~((u <= 0) & (u1 <= 0))
        m_idx = torch.nonzero(moving, as_tuple=False).reshape(-1)
        u_m, v_m, cv_m = u[m_idx], v[m_idx], cv[m_idx]
        base = wp + float(cv[const_one].sum())

        def dphi(t: float) -> float:
            if t <= 1.0:
                return base + t * pp + float((cv_m * torch.clamp((u_m + t * v_m) / mu, 0.0, 1.0)).sum())
            return wp + t * pp + float((cv * torch.clamp((u + t * v) / mu, 0.0, 1.0)).sum())

        t = line_search(dphi, float(g @ p))
        w = w + t * p_w
        b = b + t * p_b
        u_new = u + t * v
        changed = bool((((u_new > 0) & (u_new < mu)) != band).any())
        u = u_new
        if abs(t - 1.0) < 1e-9 and not changed:
            break  # the step landed in the same quadratic piece: exact minimiser of F_mu
    return w, b, u, steps


def line_search(dphi, dphi0: float, max_eval: int = 80) -> float:
    """Root of the non-decreasing piecewise-linear ``dphi`` on ``t > 0`` (``dphi(0) = dphi0 < 0``).

    Tries the Newton step ``t = 1`` first, brackets by doubling, then refines with
    the Illinois variant of regula falsi.
    """
    if dphi0 >= 0:
        return 0.0
    lo, flo = 0.0, dphi0
    hi, fhi = 1.0, dphi(1.0)
    n = 1
    if abs(fhi) <= 1e-12 * abs(dphi0):
        return 1.0
    while fhi < 0 and n < max_eval:
        lo, flo = hi, fhi
        hi *= 2.0
        fhi = dphi(hi)
        n += 1
    if fhi < 0:
        return hi
    side = 0
    t = hi
    while n < max_eval:
        t = hi - fhi * (hi - lo) / (fhi - flo) if fhi != flo else 0.5 * (lo + hi)
        if not (lo < t < hi):
            t = 0.5 * (lo + hi)
        ft = dphi(t)
        n += 1
        if abs(ft) <= 1e-12 * abs(dphi0) or (hi - lo) <= 1e-14 * max(1.0, hi):
            break
        if ft > 0:
            hi, fhi = t, ft
            if side == -1:
                flo *= 0.5
            side = -1
        else:
            lo, flo = t, ft
            if side == 1:
                fhi *= 0.5
            side = 1
    return t
