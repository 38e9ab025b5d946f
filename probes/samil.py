"""sAwMIL: sparse-aware multiple-instance SVM (linear), in pure PyTorch.

This is the probe of "The Trilemma of Truth in Large Language Models"
(Savcisens & Eliassi-Rad, arXiv:2506.23921): an sbMIL-style (Bunescu & Mooney,
2007) three-stage linear multiple-instance SVM whose bags are the token
activations of one statement.  Every optimisation problem is solved in the
primal (smoothed-hinge Newton continuation, exact active-set polish,
interior-point fallback; see :func:`fit_linear_svm`), to a certified duality
gap, on all bags and all their tokens, on CPU or GPU.

Data layout (padding-free, shared across the project)
-----------------------------------------------------
* ``X``          float ``[T, d]``  all tokens of all bags, concatenated;
* ``offsets``    int64 ``[N + 1]`` bag ``i`` owns rows ``offsets[i]:offsets[i+1]``
  (``offsets[0] == 0``, ``offsets[-1] == T``);
* ``y``          int ``[N]``       bag labels in ``{0, 1}`` (``{-1, +1}`` is accepted);
* ``candidates`` bool ``[T]``      instances that may be relabelled positive in
  stage 2 (default: the last ``k`` instances of every bag).

numpy arrays and torch tensors are both accepted.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from probes.base import Probe, kfold_splits, standardiser

__all__ = [
    "SAMILProbe",
    "SAwMIL",
    "sAwMIL",
    "fit_linear_svm",
    "hinge_objective",
    "segment_max",
    "last_k_candidates",
    "make_planted_bags",
]

_CHUNK_ROWS = 16384   # row block for Hessian assembly / scoring (bounds temporaries)
_HESS_CAP = 8192      # Newton Hessians use at most this many (stride-sampled) rows ...
_HESS32_MIN = 2048    # ... accumulated in float32 above this many rows
_MOVE_FRAC = 0.25     # active-set polish: at most this fraction of |F| joins per round
_LEVEL_STEPS = 10     # Newton steps per smoothing level at most
_IPM_FULL_N = 4096    # interior point on all examples up to this many


# ----------------------------------------------------------------------------
# small tensor helpers
# ----------------------------------------------------------------------------
def _as_tensor(a, dtype=None, device=None) -> torch.Tensor:
    if isinstance(a, torch.Tensor):
        t = a
    else:
        t = torch.as_tensor(np.asarray(a))
    if dtype is not None or device is not None:
        t = t.to(device=device if device is not None else t.device,
                 dtype=dtype if dtype is not None else t.dtype)
    return t


def _check_offsets(offsets: torch.Tensor, T: int) -> torch.Tensor:
    offsets = offsets.to(torch.int64).reshape(-1)
    if offsets.numel() < 1 or int(offsets[0]) != 0 or int(offsets[-1]) != T:
        raise ValueError(f"offsets must start at 0 and end at T={T}; got "
                         f"{offsets[:1].tolist()}..{offsets[-1:].tolist()}")
    if bool((offsets[1:] < offsets[:-1]).any()):
        raise ValueError("offsets must be non-decreasing")
    return offsets


def _bag_index(offsets: torch.Tensor) -> torch.Tensor:
    """``[T]`` index of the bag owning each row (``offsets``: ``[N+1]``)."""
    lengths = offsets[1:] - offsets[:-1]
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=offsets.device), lengths)


def segment_max(values: torch.Tensor, offsets: torch.Tensor, empty: float = float("-inf")) -> torch.Tensor:
    """Per-bag maximum of ``values`` ``[T]`` -> ``[N]`` (no Python loop over bags).

    Empty bags get ``empty``.
    """
    offsets = offsets.to(device=values.device, dtype=torch.int64)
    n = offsets.numel() - 1
    idx = _bag_index(offsets)
    out = torch.full((n,), float("-inf"), dtype=values.dtype, device=values.device)
    out = out.scatter_reduce(0, idx, values, reduce="amax", include_self=True)
    if empty != float("-inf"):
        lengths = offsets[1:] - offsets[:-1]
        out = torch.where(lengths > 0, out, torch.full_like(out, empty))
    return out


def last_k_candidates(offsets, k: int = 2) -> torch.Tensor:
    """Boolean ``[T]`` mask of the last ``k`` instances of every bag."""
    offsets = _as_tensor(offsets).to(torch.int64)
    T = int(offsets[-1])
    idx = _bag_index(offsets)
    end = offsets[1:][idx]                       # exclusive end of the owning bag
    pos_from_end = end - torch.arange(T, device=offsets.device)  # 1 == last token
    return pos_from_end <= int(k)


# ----------------------------------------------------------------------------
# the primal hinge-loss SVM solver
# ----------------------------------------------------------------------------
def hinge_objective(X, y, c, coef, intercept, rho=None) -> float:
    """Exact primal objective ``0.5 ||w||^2 + sum_i c_i max(0, rho_i - y_i (w.x_i + b))``.

    Shapes: ``X [n, d]``, ``y [n]`` in {0,1} or {-1,+1}, ``c`` scalar or ``[n]``,
    ``coef [d]``, ``intercept`` scalar, ``rho`` scalar/``[n]`` (default 1).
    Computed in float64.
    """
    X = _as_tensor(X)
    dev = X.device
    w = _as_tensor(coef, torch.float64, dev).reshape(-1)
    y = _as_tensor(y, torch.float64, dev).reshape(-1)
    y = torch.where(y > 0, 1.0, -1.0).to(torch.float64)
    c = _as_tensor(c, torch.float64, dev)
    rho = torch.ones((), dtype=torch.float64, device=dev) if rho is None else _as_tensor(rho, torch.float64, dev)
    f = _matvec(X, w) + float(intercept)
    loss = (c * torch.clamp(rho - y * f, min=0.0)).sum()
    return float(0.5 * (w @ w) + loss)


def _matvec(X: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``X @ w`` in float64, chunked when ``X`` is not float64 (bounded temporaries)."""
    if X.dtype == torch.float64:
        return X @ w
    out = torch.empty(X.shape[0], dtype=torch.float64, device=X.device)
    for s in range(0, X.shape[0], _CHUNK_ROWS):
        out[s:s + _CHUNK_ROWS] = X[s:s + _CHUNK_ROWS].to(torch.float64) @ w
    return out


@dataclass
class _SVMResult:
    coef: torch.Tensor
    intercept: float
    objective: float
    duality_gap: float
    n_iter: int
    mu: float
    converged: bool
    info: dict = field(default_factory=dict)


def _hessian(X: torch.Tensor, idx: torch.Tensor, s: torch.Tensor, eye: torch.Tensor) -> torch.Tensor:
    """``eye + sum_{i in idx} s_i x~_i x~_i^T`` with ``x~ = [x, 1]`` -> ``[d+1, d+1]`` float64.

    Large sets are stride-subsampled to ``_HESS_CAP`` rows (weights scaled up) and
    accumulated in float32: the Hessian only shapes the Newton direction, the
    gradient (and so the fixed point) stays exact float64.
    """
    d = X.shape[1]
    if idx.numel() == 0:
        return eye.clone()
    H = torch.zeros_like(eye)
    if idx.numel() > _HESS_CAP:
        stride = -(-idx.numel() // _HESS_CAP)
        idx, s = idx[::stride], s[::stride] * stride
    hd = torch.float32 if idx.numel() > _HESS32_MIN else torch.float64
    for st in range(0, idx.numel(), _CHUNK_ROWS):
        Xq = X.index_select(0, idx[st:st + _CHUNK_ROWS]).to(hd)      # [m, d]
        sq = s[st:st + _CHUNK_ROWS]
        Xs = Xq * sq[:, None].to(hd)
        H[:d, :d] += (Xq.T @ Xs).to(torch.float64)
        col = Xs.sum(0).to(torch.float64)
        H[:d, d] += col
        H[d, :d] += col
        H[d, d] += sq.sum()
    return H + eye


def _newton_level(X, y, c, rho, u, w, b, mu, eye, max_steps):
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
        H = _hessian(X, q_idx, c[q_idx] / mu, eye)
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

        t = _line_search(dphi, float(g @ p))
        w = w + t * p_w
        b = b + t * p_b
        u_new = u + t * v
        changed = bool((((u_new > 0) & (u_new < mu)) != band).any())
        u = u_new
        if abs(t - 1.0) < 1e-9 and not changed:
            break  # the step landed in the same quadratic piece: exact minimiser of F_mu
    return w, b, u, steps


def _balanced_alpha(a: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Scale one class of ``a`` down so that ``sum a_i y_i = 0`` (keeps ``0 <= a <= c``)."""
    sp = float(a[y > 0].sum())
    sn = float(a[y < 0].sum())
    if sp > sn and sp > 0:
        return torch.where(y > 0, a * (sn / sp), a)
    if sn > sp and sn > 0:
        return torch.where(y < 0, a * (sp / sn), a)
    return a


def fit_linear_svm(X, y, c, rho=None, *, tol: float = 1e-6, max_iter: int = 300,
                   mu0: float = 0.1, mu_factor: float = 0.1, mu_min: float = 1e-9,
                   polish: bool = True, working_set: float = 0.005, device=None,
                   w0=None, b0: float = 0.0) -> _SVMResult:
    """Linear soft-margin SVM (hinge loss, L2, unregularised bias) in the primal.

    Solves::

        min_{w in R^d, b in R}  P(w, b) = 0.5 ||w||^2 + sum_i c_i * max(0, rho_i - y_i (w . x_i + b))

    with ``X [n, d]``, ``y [n]`` (``{0,1}`` or ``{-1,+1}``), per-example weights
    ``c`` (scalar or ``[n]``, the "C" of each example) and margin targets ``rho``
    (scalar or ``[n]``, default 1 -- the usual SVM; sMIL uses other targets).

    Method (float64, on ``device``; no random component, so deterministic):

    1. Smoothing continuation.  The hinge ``max(0, u)`` (``u = rho - y f``) is
       replaced by the quadratically smoothed hinge ``h_mu(u) = 0 (u<=0),
       u^2/(2 mu) (0<u<mu), u - mu/2 (u>=mu)`` (``0 <= hinge - h_mu <= mu/2``).
       For ``mu = mu0, mu0*mu_factor, ...`` the smoothed problem (convex,
       piecewise quadratic in ``d+1`` unknowns) is minimised by Newton's method
       (Hessian ``I + sum_{0<u_i<mu} (c_i/mu) x~_i x~_i^T`` on ``x~ = [x, 1]``,
       Cholesky solve, exact 1-D line search), warm-started from the previous
       level, at most ``_LEVEL_STEPS`` steps per level.  Bands of more than
       ``_HESS_CAP`` rows enter the Hessian stride-subsampled and in float32 (it
       only shapes the direction; gradients and line searches are exact float64).
    2. Active-set polish (after each level whose band holds ``<= 4 (d+1)`` examples).  The partition of a smoothed optimum (``u <= 0``: not
       support vectors, ``0 < u < mu``: on the margin, ``u >= mu``: at bound) is
       taken as a guess of the exact one and the exact hinge KKT system is solved
       on it (``w = sum_bound c_i y_i x_i + sum_margin beta_i x_i``, margin
       examples exactly on the margin, ``sum alpha_i y_i = 0``: a
       ``(|margin|+1)``-sized symmetric system), followed by damped primal-dual
       active-set corrections.  When the KKT conditions hold this is the exact optimum.
    3. Interior-point fallback.  If the polish does not settle (degenerate or
       near-hard-margin problems: large C), a primal-dual interior point method
       (Mehrotra predictor-corrector, ``(d+1)``-sized normal equations) solves the
       problem restricted to the examples nearest the margin (all of them when
       ``n <= _IPM_FULL_N`` and they are most of the problem), the others held at
       ``alpha = 0`` or ``c`` and checked by a full pass; a polish from its
       partition then returns the exact vertex solution.  It runs after the first
       level when ``n <= _IPM_FULL_N``, else after the second.
    4. Certificate.  The exact-hinge duality gap ``P(w, b) - D(alpha)``,
       ``D(alpha) = sum_i rho_i alpha_i - 0.5 ||sum_i alpha_i y_i x_i||^2`` with a
       feasible ``alpha`` (``0 <= alpha_i <= c_i``, ``sum alpha_i y_i = 0``:
       ``c_i h'_mu(u_i)`` class-balanced after a smoothing level, the KKT
       multipliers after a polish) bounds ``P - P*`` (and ``||w - w*||^2 <= 2 gap``).
       The solver stops when ``gap <= tol * P`` or after ``max_iter`` Newton steps
       (returning the iterate with the smallest gap).

    ``X`` may be float32 or float64 (a float64 copy is used).
    """
    dev = torch.device(device) if device is not None else (X.device if isinstance(X, torch.Tensor) else torch.device("cpu"))
    X = _as_tensor(X, torch.float64, dev)
    n, d = X.shape
    y = _as_tensor(y, torch.float64, dev).reshape(-1)
    y = torch.where(y > 0, 1.0, -1.0).to(torch.float64)
    c = _as_tensor(c, torch.float64, dev)
    c = c.expand(n).contiguous() if c.dim() == 0 else c.reshape(-1)
    rho = torch.ones(n, dtype=torch.float64, device=dev) if rho is None else _as_tensor(rho, torch.float64, dev)
    rho = rho.expand(n).contiguous() if rho.dim() == 0 else rho.reshape(-1)
    if y.numel() != n or c.numel() != n or rho.numel() != n:
        raise ValueError("X, y, c and rho disagree on the number of examples")

    w = torch.zeros(d, dtype=torch.float64, device=dev) if w0 is None else _as_tensor(w0, torch.float64, dev).clone()
    b = float(b0)
    u = rho - y * (X @ w + b)          # [n] hinge arguments
    eye = torch.eye(d + 1, dtype=torch.float64, device=dev)
    eye[d, d] = 0.0                    # the bias is not regularised

    def exact(w_: torch.Tensor, u_: torch.Tensor) -> float:
        return float(0.5 * (w_ @ w_) + (c * torch.clamp(u_, min=0.0)).sum())

    def dual(a: torch.Tensor) -> float:
        a = _balanced_alpha(a, y)
        w_a = X.T @ (a * y)
        return float((rho * a).sum() - 0.5 * (w_a @ w_a))

    def certify(w_: torch.Tensor, b_: float, a_: torch.Tensor, name: str, **info) -> bool:
        """Exact objective and duality gap of a candidate (w_, b_) with multipliers a_ [n]:
        recorded in this level's history, kept if it is the best so far; True if within tol."""
        nonlocal best
        P_ = exact(w_, rho - y * (X @ w_ + b_))
        gap_ = max(P_ - dual(a_), 0.0)
        rec.update({f"{name}_P": P_, f"{name}_gap": gap_, **info})
        if gap_ < best[3]:
            best = (w_, b_, P_, gap_)
        return gap_ <= tol * max(abs(P_), 1e-12)

    t_begin = time.perf_counter()
    n_iter = 0
    mu = float(mu0)
    history = []
    best = None
    converged = False
    level = 0
    while True:
        # ---------------- Newton on the smoothed problem at this mu ----------------
        # a capped number of steps per level: near-hard-margin problems can need many
        # small steps on a level whose partition the polish already gets right
        w, b, u, k = _newton_level(X, y, c, rho, u, w, b, mu, eye, min(_LEVEL_STEPS, max_iter - n_iter))
        n_iter += k
        u = rho - y * (X @ w + b)                              # refresh (no drift)
        P = exact(w, u)
        gap = max(P - dual(c * torch.clamp(u / mu, 0.0, 1.0)), 0.0)
        band_n = int(((u > 0) & (u < mu)).sum())
        rec = dict(mu=mu, n_iter=n_iter, P=P, gap=gap, band=band_n)
        if best is None or gap < best[3]:
            best = (w, b, P, gap)
        if gap <= tol * max(abs(P), 1e-12):
            converged = True
        elif polish and band_n <= 4 * (d + 1):
            t_pol = time.perf_counter()
            pol = _polish(X, y, c, rho, u, mu, working_set, move_frac=_MOVE_FRAC)
            rec["polish_seconds"] = time.perf_counter() - t_pol
            if pol is not None:
                converged = certify(*pol[:3], "polish", polish_rounds=pol[3])
        if not converged and polish and (level == 1 or (level == 0 and n <= _IPM_FULL_N)):
            # the active-set guess did not settle: interior point on the examples near
            # the margin (all of them when n is small), robust to degeneracy/conditioning
            t_ipm = time.perf_counter()
            res = _ipm_working_set(X, y, c, rho, u, mu, w, b, tol * max(abs(P), 1e-12))
            rec["ipm_seconds"] = time.perf_counter() - t_ipm
            if res is not None:
                w_i, b_i, a_i, its, n_ws = res
                converged = certify(w_i, b_i, a_i, "ipm", ipm_iter=its, ipm_set=n_ws)
                # the interior solution tells the partition (on the margin: |u| < 1e-6);
                # a polish from it lands on the exact (vertex) solution
                delta = 1e-6
                u_i = rho - y * (X @ w_i + b_i)
                pol = _polish(X, y, c, rho, u_i + delta, 2 * delta, working_set=0.0, max_rounds=10,
                              move_frac=_MOVE_FRAC)
                if pol is not None:
                    converged = certify(*pol[:3], "polish", polish_rounds=pol[3]) or converged
        rec["seconds"] = time.perf_counter() - t_begin
        history.append(rec)
        if converged or n_iter >= max_iter or mu <= mu_min:
            break
        mu *= mu_factor
        level += 1
    w, b, P, gap = best
    return _SVMResult(coef=w, intercept=float(b), objective=P, duality_gap=gap, n_iter=n_iter,
                      mu=mu, converged=converged, info=dict(history=history))


def _polish(X, y, c, rho, u, mu, working_set: float = 0.005, max_rounds: int = 60,
            move_frac: float = 0.25):
    """Exact hinge-SVM KKT solve on the partition suggested by a smoothed optimum.

    Partition: ``Z = {u <= 0}`` (alpha = 0), ``F = {0 < u < mu}`` (on the margin),
    ``B = {u >= mu}`` (alpha = c); if ``|F| > d+1`` (generically at most ``d+1``
    examples lie exactly on the margin) only the ``0.9 (d+1)`` most interior
    ones (``u/mu`` closest to 1/2) start in ``F``.  With ``beta_i = alpha_i y_i`` on ``F``::

        w = g_B + X_F^T beta,   g_B = sum_B c_i y_i x_i
        [ X_F X_F^T  1 ] [beta]   [ rho_F * y_F - X_F g_B ]
        [ 1^T        0 ] [ b  ] = [ -sum_B c_i y_i        ]

    then damped primal-dual active-set corrections: ``F`` members whose
    ``alpha`` leaves ``[0, c]`` go to ``Z``/``B``; ``Z``/``B`` members on the wrong
    side of the margin join ``F`` (at most ``move_frac * |F|`` per round, largest
    violations first).  Rounds only look at a working set (``-working_set < u <
    mu + working_set``, ``g_B`` is updated incrementally); a full pass confirms
    the remaining examples.  Returns ``(w [d], b, alpha [n], rounds)`` or None.
    """
    n, d = X.shape
    Z = u <= 0
    F = (u > 0) & (u < mu)
    B = ~Z & ~F
    kmax = int(0.9 * (d + 1))
    if int(F.sum()) > kmax:
        score = torch.where(F, (u / mu - 0.5).abs(), torch.full_like(u, 9.0))
        keep = torch.zeros_like(F)
        keep[torch.topk(-score, kmax).indices] = True
        drop = F & ~keep
        Z |= drop & (u < 0.5 * mu)
        B |= drop & (u >= 0.5 * mu)
        F = keep
    cy = c * y
    cyB = torch.where(B, cy, torch.zeros_like(cy))
    g_B = X.T @ cyB                                   # [d]   sum_B c_i y_i x_i
    sB = float(cyB.sum())
    eps_a = 1e-9 * float(c.max())
    eps_u = 1e-9 * max(1.0, float(rho.abs().max()))
    ws = ((u > -working_set) & (u < mu + working_set)) | F if working_set > 0 else torch.ones_like(F)
    rounds = 0
    while rounds < max_rounds:
        w_idx = torch.nonzero(ws, as_tuple=False).reshape(-1)
        Xw = X if w_idx.numel() == n else X.index_select(0, w_idx)
        yw, cw, rw = y[w_idx], c[w_idx], rho[w_idx]
        cyw = cw * yw
        Fw, Zw, Bw = F[w_idx], Z[w_idx], B[w_idx]
        ok = False
        while rounds < max_rounds:
            rounds += 1
            f_loc = torch.nonzero(Fw, as_tuple=False).reshape(-1)
            m = f_loc.numel()
            if m == 0 or m > d + 1:
                return None
            XF = Xw.index_select(0, f_loc)
            yF = yw[f_loc]
            A = torch.zeros(m + 1, m + 1, dtype=X.dtype, device=X.device)
            A[:m, :m] = XF @ XF.T
            A[:m, m] = 1.0
            A[m, :m] = 1.0
            r = torch.cat([rw[f_loc] * yF - XF @ g_B, torch.tensor([-sB], dtype=X.dtype, device=X.device)])
            sol, info = torch.linalg.solve_ex(A, r[:, None])
            if int(info) != 0 or not bool(torch.isfinite(sol).all()):
                sol = torch.linalg.pinv(A, hermitian=True) @ r[:, None]
            sol = sol.reshape(-1)
            beta, b = sol[:m], float(sol[m])
            w = g_B + XF.T @ beta
            lam = beta * yF                                           # alpha on F
            uw = rw - yw * (Xw @ w + b)
            cF = cw[f_loc]
            lam_neg = lam < -eps_a
            lam_big = lam > cF + eps_a
            viol = torch.where(Zw, torch.clamp(uw, min=0.0), torch.zeros_like(uw)) \
                + torch.where(Bw, torch.clamp(-uw, min=0.0), torch.zeros_like(uw))
            add = viol > eps_u
            if not (bool(lam_neg.any()) or bool(lam_big.any()) or bool(add.any())):
                ok = True
                break
            # damped primal-dual active-set update
            n_add = int(add.sum())
            k = max(1, int(move_frac * max(m, 10)))
            if n_add > k:
                add = torch.zeros_like(add)
                add[torch.topk(viol, k).indices] = True
            to_b = f_loc[lam_big]
            out_b = torch.nonzero(add & Bw, as_tuple=False).reshape(-1)
            Fw[f_loc[lam_neg]] = False
            Zw[f_loc[lam_neg]] = True
            Fw[to_b] = False
            Bw[to_b] = True
            Fw |= add
            Zw &= ~add
            Bw &= ~add
            if to_b.numel() or out_b.numel():
                g_B = g_B + Xw[to_b].T @ cyw[to_b] - Xw[out_b].T @ cyw[out_b]
                sB += float(cyw[to_b].sum() - cyw[out_b].sum())
        F[w_idx], Z[w_idx], B[w_idx] = Fw, Zw, Bw
        if not ok:
            return None
        # confirm the examples outside the working set with one full pass
        u_all = rho - y * (X @ w + b)
        bad = ~ws & ((Z & (u_all > eps_u)) | (B & (u_all < -eps_u)))
        if not bool(bad.any()):
            a = torch.where(B, c, torch.zeros_like(c))
            a[w_idx[f_loc]] = torch.minimum(torch.clamp(lam, min=0.0), cF)
            return w, b, a, rounds
        ws = ws | bad
    return None


def _ipm(X, y, c, rho, g_far, w, b, gap_target: float, max_iter: int = 60):
    """Primal-dual interior point method (Mehrotra predictor-corrector) for::

        min_{w,b,xi} 0.5||w||^2 - g_w.w - g_b b + sum_i c_i xi_i
        s.t. y_i (w.x_i + b) + xi_i >= rho_i,  xi_i >= 0

    (``g_far = [g_w, g_b]``: the linear term of examples held at ``alpha = c``
    outside the working set).  Each step solves the ``(d+1)``-sized normal system
    ``[[I + X^T D X, X^T D 1], [1^T D X, sum D]]`` (Ferris & Munson 2002), cost
    ``O(n d^2)``.  Returns ``(w, b, alpha [n], iterations)``.
    """
    n, d = X.shape
    dt, dev = X.dtype, X.device
    X32 = X.to(torch.float32) if n * d >= 2**20 else None
    gw, gb = g_far[:d], float(g_far[d])
    f = X @ w + b
    u = rho - y * f
    xi = torch.clamp(u, min=0.0) + 1.0                 # interior start, consistent with (w, b)
    r = torch.clamp(-u, min=0.0) + 1.0                 # slack of the margin constraint
    a = c / 2                                          # multiplier of the margin constraint
    s = c / 2                                          # multiplier of xi >= 0
    eye_d = torch.eye(d, dtype=dt, device=dev)
    it = 0
    for it in range(1, max_iter + 1):
        ay = a * y
        R1 = w - gw - X.T @ ay
        R2 = -gb - float(ay.sum())
        R3 = c - a - s
        R4 = y * f + xi - rho - r
        comp = float(a @ r + s @ xi)
        mu = comp / (2 * n)
        res = max(float(R1.abs().max()) / (1.0 + float(w.abs().max()) + float(gw.abs().max())),
                  abs(R2) / (1.0 + abs(gb) + float(c.sum())),
                  float(R3.abs().max()) / (1.0 + float(c.max())),
                  float(R4.abs().max()) / (1.0 + float(rho.abs().max())))
        if comp <= gap_target and res <= 1e-10:
            break
        D = 1.0 / (xi / s + r / a)
        # early iterations only need a rough direction: float32 normal matrix while
        # the complementarity is far from the target (D is mildly spread there)
        hd = torch.float32 if (X32 is not None and comp > 1e4 * gap_target and
                               float(D.max()) <= 1e6 * float(D.min())) else dt
        Xh = X32 if hd == torch.float32 else X
        XD = Xh * D.to(hd)[:, None]
        M = torch.empty(d + 1, d + 1, dtype=dt, device=dev)
        M[:d, :d] = (Xh.T @ XD).to(dt) + eye_d
        col = XD.sum(0).to(dt)
        M[:d, d] = col
        M[d, :d] = col
        M[d, d] = D.sum() * (1.0 + 1e-14)
        del XD
        L, info = torch.linalg.cholesky_ex(M)
        if int(info) != 0:
            L, info = torch.linalg.cholesky_ex(M + 1e-10 * float(torch.diagonal(M).max()) * torch.eye(d + 1, dtype=dt, device=dev))
            if int(info) != 0:
                break

        def direction(R5a, R5b):
            q = -R4 - (R5b - xi * R3) / s + R5a / a
            Dq = D * q
            rhs = torch.cat([-R1 + X.T @ (y * Dq), (y @ Dq - R2).reshape(1)])
            sol = torch.cholesky_solve(rhs[:, None], L).reshape(-1)
            dw, db = sol[:d], float(sol[d])
            dfx = X @ dw + db
            da = D * (q - y * dfx)
            dr = (R5a - r * da) / a
            ds = R3 - da
            dxi = (R5b - xi * ds) / s
            return dw, db, dfx, da, dr, ds, dxi

        def step_to_boundary(*pairs):
            st = 1.0
            for v, dv in pairs:
                neg = dv < 0
                if bool(neg.any()):
                    st = min(st, float((-v[neg] / dv[neg]).min()))
            return st

        dw, db, dfx, da, dr, ds, dxi = direction(-a * r, -s * xi)          # predictor
        st = step_to_boundary((a, da), (s, ds), (r, dr), (xi, dxi))
        mu_aff = float((a + st * da) @ (r + st * dr) + (s + st * ds) @ (xi + st * dxi)) / (2 * n)
        sigma = min(1.0, (mu_aff / mu) ** 3)
        dw, db, dfx, da, dr, ds, dxi = direction(sigma * mu - a * r - da * dr,   # corrector
                                                 sigma * mu - s * xi - ds * dxi)
        st = min(1.0, 0.99 * step_to_boundary((a, da), (s, ds), (r, dr), (xi, dxi)))
        w, b, f = w + st * dw, b + st * db, f + st * dfx
        a, s, r, xi = a + st * da, s + st * ds, r + st * dr, xi + st * dxi
    return w, float(b), torch.minimum(torch.clamp(a, min=0.0), c), it


def _ipm_working_set(X, y, c, rho, u, mu, w, b, gap_target: float, max_rounds: int = 4):
    """Interior point on the examples nearest the margin, the others held fixed.

    The working set is the ``K = max(2 (d+1), 3 |band|)`` examples with ``u``
    closest to the band ``(0, mu)`` (all examples if that is most of them); the
    others keep ``alpha = c`` (``u >= mu/2``) or ``alpha = 0``.  A full pass checks
    them; violators join the set and the IPM reruns (at most ``max_rounds``).
    Returns ``(w, b, alpha [n], iterations, |set|)`` or None.
    """
    n, d = X.shape
    band_n = int(((u > 0) & (u < mu)).sum())
    K = min(n, max(2 * (d + 1), 3 * band_n))
    if n <= _IPM_FULL_N and K > 0.6 * n:
        ws = torch.ones(n, dtype=torch.bool, device=X.device)
    else:
        ws = torch.zeros(n, dtype=torch.bool, device=X.device)
        ws[torch.topk(-(u - 0.5 * mu).abs(), K).indices] = True
    at_c = ~ws & (u >= 0.5 * mu)
    its = 0
    for _ in range(max_rounds):
        cy_far = torch.where(at_c & ~ws, c * y, torch.zeros_like(c))
        g_far = torch.cat([X.T @ cy_far, cy_far.sum().reshape(1)])
        idx = torch.nonzero(ws, as_tuple=False).reshape(-1)
        w_i, b_i, a_w, k = _ipm(X.index_select(0, idx), y[idx], c[idx], rho[idx], g_far, w, b,
                                0.1 * gap_target)
        its += k
        u_all = rho - y * (X @ w_i + b_i)
        bad = ~ws & ((at_c & (u_all < 0)) | (~at_c & (u_all > 0)))
        if not bool(bad.any()):
            a = torch.where(at_c & ~ws, c, torch.zeros_like(c))
            a[idx] = a_w
            return w_i, b_i, a, its, int(ws.sum())
        # grow the set: the violators plus the outside examples now nearest the margin
        # (+20 %), so that a rerun rarely finds new violators
        ws |= bad
        extra = int(0.2 * int(ws.sum()))
        if extra > 0:
            dist = torch.where(ws, torch.full_like(u_all, float("inf")), u_all.abs())
            k = min(extra, int((~ws).sum()))
            if k > 0:
                ws[torch.topk(-dist, k).indices] = True
    return None


def _line_search(dphi, dphi0: float, max_eval: int = 80) -> float:
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


# ----------------------------------------------------------------------------
# the estimator
# ----------------------------------------------------------------------------
class SAwMIL:
    """Sparse-aware multiple-instance SVM (sAwMIL), linear, solved in the primal in PyTorch.

    Notation: ``T`` instances (tokens) in ``N`` bags (statements), dimension ``d``;
    ``N_+``/``N_-`` positive/negative bags, ``L_+``/``L_-`` the instances they hold.

    Stage 1 -- sMIL (Bunescu & Mooney 2007, textbook, linear, primal)::

        min_{w,b} 0.5||w||^2 + C/L_- * sum_{x in neg. bags} max(0, 1 + (w.x + b))
                             + C/N_+ * sum_{B positive}   max(0, rho_B - (w.mean(B) + b)),
        rho_B = (2 - |B|) / |B|

      i.e. every instance of a negative bag is a negative example, every positive
      bag is represented by its instance mean with the relaxed sMIL margin (at
      least one instance of ``B`` positive).  The ``C/L_-``, ``C/N_+``
      normalisation is the one of the sMIL paper (and of ``misvm``/``sawmil``
      with ``scale_C=True``, the setting of the Trilemma runs).  Problem size:
      ``L_- + N_+`` examples of dimension ``d``.

    Stage 2 -- relabelling (what the Trilemma reference code does: misvm's
    ``sbMIL`` patched with intra-bag masks, ``probes/sawmil.py::sort_and_label``):
      * every positive-bag instance is scored with the stage-1 model, ``s = w1.x + b1``;
      * ``n = clip(round(eta * L_+), N_+, L_+)`` (at least one per positive bag),
        the cutoff is the ``n``-th largest score over ALL positive-bag instances;
      * an instance is labelled **positive** iff it is a **candidate** and its score
        is ``>= cutoff``; every other instance of a positive bag (non-selected
        candidates and all non-candidates) is labelled **negative** and kept in
        the stage-3 training set, like every negative-bag instance;
      * fallback (``fallback_used_ = True``): if fewer than ``min_pos_ratio * L_+``
        instances were selected (reference: 5 %), with ``fallback="candidates"``
        (default) the top ``max(N_+, ceil(min_pos_ratio * L_+))`` candidates by
        score are labelled positive instead; with ``fallback="any"`` (the
        reference) the candidate mask is ignored and the top-``n`` positive-bag
        instances (score ``>= cutoff``) are. Both ignore the mask when the
        positive bags hold fewer candidates than there are positive bags. (On real
        activations "any" can label the shared opening tokens of every statement
        positive, and the bag max is then the same for every bag: AUROC 0.5.)
      ``eta=None`` (default) uses the reference runner's choice: the fraction of
      candidate instances among all training instances (``~k / mean bag length``).
      The effective fraction ``eta_ = #positive labels / L_+`` is recorded.
      (The ``sawmil`` package differs in details: its cutoff is the
      ``1 - eta`` quantile of the positive-bag scores, without the floor of one
      per positive bag, and its fallback -- fewer than
      ``max(1, int(min_pos_ratio * L_+))`` selected -- takes the top
      ``max(that, round(eta * L_+))`` instances regardless of candidates.  Both
      label non-selected and non-candidate positive-bag instances negative.)

    Stage 3 -- instance SVM on the relabelled instances (all ``T`` of them)::

        min_{w,b} 0.5||w||^2 + sum_i C_i max(0, 1 - y_i (w.x_i + b)),  y_i in {-1,+1}
        C_i = C / T   (c_scaling="per_instance", default)   or   C   (c_scaling="none")

      No class weighting (neither the reference nor the package uses one).
      Bag score: ``max_{x in B} w.x + b`` (:meth:`decision_function`).

    C scaling default -- ``"per_instance"``: it is what the Trilemma reference
    code runs (misvm ``SVM.fit`` with ``scale_C=True`` divides C by the number of
    training instances), so the paper's C grid (0.05 ... 10) keeps its meaning;
    it makes the loss an average, so one C means the same regularisation whatever
    the number of bags/tokens (we train on all tokens, T varies 100x between
    datasets); and it matches the normalised stage 1.  ``"none"`` reproduces the
    ``sawmil`` package (its stage-3 ``SVM`` receives C unscaled), which at
    ``T ~ 10^4-10^5`` is close to a hard-margin SVM.  Caveat: with the strong
    default regularisation (C=1 per instance) the intercept can dominate, so the
    ranking (AUROC) is good but the bag threshold 0 may call every bag negative
    when the signal is weak; calibrate the threshold (or raise C) when a hard
    decision is needed.

    Every stage is solved by :func:`fit_linear_svm` (smoothed-hinge Newton
    continuation in float64, active-set polish, interior-point fallback; stopped
    on a certified relative exact-hinge duality gap ``<= tol``), on ``device``,
    on all bags and all tokens.  Memory: a float64 copy of ``X`` plus the
    stage-1 matrix (``(L_- + N_+) x d``), i.e. about ``12 T d`` bytes at peak.  The fit is
    deterministic: there is no random component (``seed`` is accepted for API
    symmetry with the other probes; nothing is drawn from it).  Ties in the
    stage-2 ranking are broken by instance order (stable sort).

    Parameters
    ----------
    C : float              regularisation trade-off (both stages).
    eta : float or None    stage-2 fraction of positive-bag instances labelled positive.
    k : int                default candidates: the last ``k`` instances of every bag.
    c_scaling : {"per_instance", "none"}   stage-3 C scaling (see above).
    min_pos_ratio : float  stage-2 fallback threshold (reference: 0.05).
    fallback : {"candidates", "any"}  what the stage-2 fallback labels (see above).
    max_iter : int         Newton-step budget per stage.
    tol : float            relative exact-hinge duality gap at which a stage stops.
    device : str or torch.device or None   where to solve (default: CPU).
    seed : int             see above.
    num_threads : int or None  torch CPU threads during ``fit`` (restored after);
                           None keeps torch's setting.  On a shared, oversubscribed
                           machine 1 thread can be several times faster than 2
                           (OpenMP spin-waits on the dense (d+1)^2 algebra).

    Attributes (after ``fit``)
    --------------------------
    coef_ ``[d]`` float64 tensor, intercept_ float  -- the stage-3 (final) model;
    stage1_coef_ ``[d]``, stage1_intercept_          -- the sMIL model;
    eta_ float (effective), eta_target_ float (used for the cutoff), cutoff_ float,
    n_selected_ int, fallback_used_ bool, c_effective_ float (stage-3 C_i),
    fit_info_ dict (timings, iterations, duality gaps, objectives per stage).
    """

    def __init__(self, C: float = 1.0, eta: float | None = None, k: int = 2,
                 c_scaling: str = "per_instance", min_pos_ratio: float = 0.05, fallback: str = "candidates",
                 max_iter: int = 300, tol: float = 1e-6, device=None, seed: int = 0,
                 num_threads: int | None = None):
        if c_scaling not in ("per_instance", "none"):
            raise ValueError("c_scaling must be 'per_instance' or 'none'")
        if fallback not in ("candidates", "any"):
            raise ValueError(f"fallback={fallback!r}: use 'candidates' or 'any'")
        self.fallback = fallback
        self.C = float(C)
        self.eta = eta
        self.k = int(k)
        self.c_scaling = c_scaling
        self.min_pos_ratio = float(min_pos_ratio)
        self.max_iter = int(max_iter)
        self.tol = float(tol)
        self.device = device
        self.seed = int(seed)
        self.num_threads = num_threads

    # -- sklearn-ish plumbing ------------------------------------------------
    def get_params(self, deep: bool = True) -> dict[str, Any]:
        return dict(C=self.C, eta=self.eta, k=self.k, c_scaling=self.c_scaling,
                    min_pos_ratio=self.min_pos_ratio, fallback=self.fallback, max_iter=self.max_iter, tol=self.tol,
                    device=self.device, seed=self.seed, num_threads=self.num_threads)

    def set_params(self, **params) -> "SAwMIL":
        for key, val in params.items():
            if key not in self.get_params():
                raise ValueError(f"unknown parameter {key!r}")
            setattr(self, key, val)
        return self

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_params().items())
        return f"SAwMIL({args})"

    def _device(self, X) -> torch.device:
        if self.device is not None:
            return torch.device(self.device)
        return X.device if isinstance(X, torch.Tensor) else torch.device("cpu")

    # -- fitting -----------------------------------------------------------------
    def fit(self, X, offsets, y, candidates=None) -> "SAwMIL":
        """Fit the three stages.

        ``X [T, d]`` float, ``offsets [N+1]`` int64, ``y [N]`` in {0,1} (or {-1,+1}),
        ``candidates [T]`` bool or None (None: last ``k`` tokens of every bag).
        """
        prev_threads = torch.get_num_threads()
        if self.num_threads:
            torch.set_num_threads(int(self.num_threads))
        try:
            return self._fit(X, offsets, y, candidates)
        finally:
            if self.num_threads:
                torch.set_num_threads(prev_threads)

    def _fit(self, X, offsets, y, candidates) -> "SAwMIL":
        t_start = time.perf_counter()
        dev = self._device(X)
        X = _as_tensor(X, torch.float64, dev)
        if X.dim() != 2:
            raise ValueError("X must be [T, d]")
        T, d = X.shape
        offsets = _check_offsets(_as_tensor(offsets).to(dev), T)
        N = offsets.numel() - 1
        yb = _as_tensor(y).to(dev).reshape(-1)
        if yb.numel() != N:
            raise ValueError(f"y has {yb.numel()} labels for {N} bags")
        ypos = yb > 0
        lengths = offsets[1:] - offsets[:-1]
        if int(lengths.min()) <= 0:
            raise ValueError("every bag must hold at least one instance")
        if not bool(ypos.any()) or bool(ypos.all()):
            raise ValueError("need both positive and negative bags")
        if candidates is None:
            cand = last_k_candidates(offsets, self.k)
        else:
            cand = _as_tensor(candidates).to(dev).reshape(-1).bool()
            if cand.numel() != T:
                raise ValueError("candidates must be a [T] boolean mask")
        bag_idx = _bag_index(offsets)                  # [T]
        inst_pos_bag = ypos[bag_idx]                   # [T] instance belongs to a positive bag
        L_pos = int(inst_pos_bag.sum())
        L_neg = T - L_pos
        N_pos = int(ypos.sum())
        solver_kw = dict(tol=self.tol, max_iter=self.max_iter, device=dev)

        # ---------------- stage 1: sMIL ----------------
        t0 = time.perf_counter()
        neg_rows = torch.nonzero(~inst_pos_bag, as_tuple=False).reshape(-1)
        sums = torch.zeros(N, d, dtype=torch.float64, device=dev).index_add_(0, bag_idx, X)
        pos_bags = torch.nonzero(ypos, as_tuple=False).reshape(-1)
        pos_len = lengths[pos_bags].to(torch.float64)
        means = sums[pos_bags] / pos_len[:, None]      # [N_+, d]
        del sums
        Z = torch.cat([X.index_select(0, neg_rows), means], 0)   # [L_- + N_+, d]
        y1 = torch.cat([-torch.ones(L_neg, dtype=torch.float64, device=dev),
                        torch.ones(N_pos, dtype=torch.float64, device=dev)])
        c1 = torch.cat([torch.full((L_neg,), self.C / L_neg, dtype=torch.float64, device=dev),
                        torch.full((N_pos,), self.C / N_pos, dtype=torch.float64, device=dev)])
        rho1 = torch.cat([torch.ones(L_neg, dtype=torch.float64, device=dev), (2.0 - pos_len) / pos_len])
        r1 = fit_linear_svm(Z, y1, c1, rho1, **solver_kw)
        del Z
        self.stage1_coef_ = r1.coef
        self.stage1_intercept_ = r1.intercept
        t1 = time.perf_counter()

        # ---------------- stage 2: relabel positive-bag instances ----------------
        pos_rows = torch.nonzero(inst_pos_bag, as_tuple=False).reshape(-1)
        s_pos = (X @ r1.coef + r1.intercept)[pos_rows]                         # [L_+]
        cand_pos = cand[pos_rows]
        if self.eta is None:
            eta_t = float(cand.sum()) / T
        else:
            eta_t = float(self.eta)
        eta_t = min(max(eta_t, 0.0), 1.0)
        n_sel = int(round(eta_t * L_pos))
        n_sel = min(L_pos, max(N_pos, n_sel))
        order = torch.sort(s_pos, descending=True, stable=True).values
        cutoff = float(order[n_sel - 1])
        above = s_pos >= cutoff
        chosen = above & cand_pos
        n_cand = int(cand_pos.sum())
        fallback = n_cand < N_pos or float(chosen.sum()) < self.min_pos_ratio * L_pos
        if fallback and self.fallback == "candidates" and n_cand >= N_pos:
            # the top-scoring candidates, enough of them: lower the cutoff within the candidates
            m = min(n_cand, max(N_pos, int(np.ceil(self.min_pos_ratio * L_pos))))
            cand_scores = torch.where(cand_pos, s_pos, torch.full_like(s_pos, float("-inf")))
            chosen = cand_pos & (cand_scores >= torch.sort(cand_scores, descending=True, stable=True).values[m - 1])
        elif fallback:
            chosen = above
        y3 = -torch.ones(T, dtype=torch.float64, device=dev)
        y3[pos_rows[chosen]] = 1.0
        self.eta_target_ = eta_t
        self.cutoff_ = cutoff
        self.n_selected_ = int(chosen.sum())
        self.eta_ = self.n_selected_ / L_pos
        self.fallback_used_ = bool(fallback)
        self.instance_labels_ = y3 > 0                 # [T] bool, stage-3 labels
        t2 = time.perf_counter()

        # ---------------- stage 3: instance SVM ----------------
        c3 = self.C / T if self.c_scaling == "per_instance" else self.C
        self.c_effective_ = c3
        r3 = fit_linear_svm(X, y3, c3, None, **solver_kw)
        self.coef_ = r3.coef
        self.intercept_ = r3.intercept
        t3 = time.perf_counter()
        self.n_features_in_ = d
        self.fit_info_ = dict(
            n_bags=N, n_instances=T, n_pos_bags=N_pos, L_pos=L_pos, L_neg=L_neg,
            stage1=dict(objective=r1.objective, duality_gap=r1.duality_gap, n_iter=r1.n_iter,
                        converged=r1.converged, seconds=t1 - t0, history=r1.info["history"]),
            stage2=dict(seconds=t2 - t1),
            stage3=dict(objective=r3.objective, duality_gap=r3.duality_gap, n_iter=r3.n_iter,
                        converged=r3.converged, seconds=t3 - t2, history=r3.info["history"]),
            seconds=t3 - t_start,
        )
        return self

    # -- inference -----------------------------------------------------------------
    def _check_fitted(self):
        if getattr(self, "coef_", None) is None:
            raise RuntimeError("SAwMIL is not fitted")

    def instance_decision_function(self, X) -> torch.Tensor:
        """Instance scores ``w.x + b`` ``[T]`` (float64 tensor on ``X``'s device)."""
        self._check_fitted()
        Xt = _as_tensor(X)
        w = self.coef_.to(Xt.device)
        return _matvec(Xt, w) + self.intercept_

    def decision_function(self, X, offsets):
        """Bag scores ``max_{x in B} w.x + b`` ``[N]`` (segment-wise max, no Python loop).

        Returns a float64 torch tensor if ``X`` is a tensor, else a numpy array.
        Empty bags score ``intercept_`` (as in the ``sawmil`` package).
        """
        s = self.instance_decision_function(X)
        off = _as_tensor(offsets).to(s.device)
        _check_offsets(off, s.numel())
        out = segment_max(s, off, empty=self.intercept_)
        return out if isinstance(X, torch.Tensor) else out.cpu().numpy()

    def predict(self, X, offsets):
        """Bag labels in {0,1} (score >= 0)."""
        s = self.decision_function(X, offsets)
        return (s >= 0).long() if isinstance(s, torch.Tensor) else (s >= 0).astype(np.int64)

    def objective(self, X, y_inst, C, coef=None, intercept=None) -> float:
        """Stage-3 objective ``0.5||w||^2 + sum_i C_i max(0, 1 - y_i (w.x_i + b))``.

        ``X [n, d]``, ``y_inst [n]`` in {0,1} or {-1,+1}, ``C`` scalar or ``[n]`` used
        as given (no scaling).  ``coef``/``intercept`` default to the fitted model.
        """
        if coef is None:
            self._check_fitted()
            coef, intercept = self.coef_, self.intercept_
        return hinge_objective(X, y_inst, C, coef, 0.0 if intercept is None else intercept)


sAwMIL = SAwMIL  # the paper's spelling


# ----------------------------------------------------------------------------
# synthetic data for tests and benchmarks
# ----------------------------------------------------------------------------
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


# ----------------------------------------------------------------------------
# the probe: SAwMIL behind the shared Probe interface, C chosen by grouped CV
# ----------------------------------------------------------------------------
class SAMILProbe(Probe):
    """sAwMIL on the token bags of each statement (representation "bags").

    Token vectors are standardised with the mean and std of the training instances (as the
    reference code does; without it the few high-variance residual dimensions decide the SVM and
    real-data AUROC falls to chance). C is chosen from `Cs` by grouped cross-validation on the
    training bags (folds never split a group of statements sharing an entity; each fold standardised
    on its own training part), by held-out bag AUROC; `C` fixes it instead. The other arguments are
    those of `SAwMIL`. Runs on the accelerator's device ("auto": CUDA if present).
    """

    representation = "bags"

    def __init__(self, C: float | None = None, Cs=(10.0, 100.0, 1000.0), cv_folds: int = 3,
                 eta: float | None = None, k: int = 2, c_scaling: str = "per_instance", standardize: bool = True,
                 accelerator: str = "auto", seed: int = 0, **solver):
        super().__init__()
        if not isinstance(standardize, bool):
            raise ValueError(f"standardize={standardize!r}: use true or false")
        self.C, self.Cs, self.cv_folds, self.standardize = C, tuple(Cs), cv_folds, standardize
        self.options = dict(eta=eta, k=k, c_scaling=c_scaling, seed=seed, **solver)
        SAwMIL(**self.options)  # checks the estimator's options now, not at the first fit
        self.device_name = "cuda" if accelerator in ("gpu", "cuda") or (
            accelerator == "auto" and torch.cuda.is_available()) else "cpu"
        self.cv_auroc: dict[float, float] = {}

    def _fit_one(self, C: float, train, y: np.ndarray) -> tuple[SAwMIL, torch.Tensor, torch.Tensor]:
        """SAwMIL at C on `train`'s bags, standardised on them: (model, mean [d], std [d])."""
        mean, std = standardiser(train.X) if self.standardize else (torch.zeros(train.X.shape[1]),
                                                                      torch.ones(train.X.shape[1]))
        model = SAwMIL(C=C, device=self.device_name, **self.options)
        return model.fit((train.X - mean) / std, train.offsets, y), mean, std

    def fit(self, train, y) -> "SAMILProbe":
        y = np.asarray(y, dtype=np.int64)
        C = self.C if self.C is not None else self._choose_C(train, y)
        self.estimator, self.mean, self.std = self._fit_one(C, train, y)
        self.chosen_C = C
        return self

    def _choose_C(self, train, y: np.ndarray) -> float:
        """The C of `Cs` with the best held-out bag AUROC over grouped folds (the middle one when
        the training bags allow no folds)."""
        from sklearn.metrics import roc_auc_score

        folds = kfold_splits(y, train.groups, self.cv_folds, self.options["seed"])
        if not folds:
            return self.Cs[len(self.Cs) // 2]
        held_all = np.concatenate([held for _, held in folds])
        for C in self.Cs:
            scores = np.empty(len(y))
            for fit_idx, held_idx in folds:
                model, mean, std = self._fit_one(C, train.subset(fit_idx), y[fit_idx])
                held = train.subset(held_idx)
                scores[held_idx] = _numpy(model.decision_function((held.X - mean) / std, held.offsets))
            self.cv_auroc[C] = float(roc_auc_score(y[held_all], scores[held_all]))
        return max(self.Cs, key=lambda c: (self.cv_auroc[c], -c))

    def decision_function(self, data) -> np.ndarray:
        return _numpy(self.estimator.decision_function((data.X - self.mean) / self.std, data.offsets))

    def params(self) -> dict:
        e = self.estimator
        options = {k: v for k, v in self.options.items() if isinstance(v, (int, float, str, type(None)))}
        return {**options, "eta_target": options["eta"], "C": self.chosen_C,
                "cv_auroc": {str(c): a for c, a in self.cv_auroc.items()}, "eta": float(e.eta_),
                "fallback_used": bool(e.fallback_used_), "standardize": self.standardize,
                "fit_seconds": e.fit_info_["seconds"]}


def _numpy(x) -> np.ndarray:
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
