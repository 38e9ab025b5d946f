"""Exact hinge-SVM solutions from a smoothed optimum (steps 2 and 3 of `fit_linear_svm`): the
active-set KKT polish and the interior-point fallback on a working set of examples.

Problem: ``min_{w,b} 0.5 ||w||^2 + sum_i c_i max(0, rho_i - y_i (w . x_i + b))`` with ``X [n, d]``,
``y [n]`` in {-1, +1}, ``c [n]``, ``rho [n]``; ``u = rho - y (X w + b)`` are the hinge arguments.
"""
from __future__ import annotations

import torch

from probes.samil.bags import gram
from probes.samil.kernels import Rows

IPM_FULL_N = 4096    # interior point on all examples up to this many
MOST = 0.6           # a working set of more than this share of the examples: take them all
STALL_ROUNDS = 6     # polish gives up after this many rounds without fewer KKT violations
DROP_MASS = 30.0     # IPM preconditioner: rows of at most this much total D_i ||x_i||^2 left out


def polish(X, y, c, rho, u, mu, working_set: float = 0.005, max_rounds: int = 60,
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
    best_viol, best_round = 1 << 62, 0
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
            n_add = int(add.sum())
            n_viol = n_add + int(lam_neg.sum()) + int(lam_big.sum())
            if n_viol < best_viol:
                best_viol, best_round = n_viol, rounds
            elif rounds - best_round >= STALL_ROUNDS:
                return None    # cycling: the partition guess is too far off
            # damped primal-dual active-set update
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


def normal_matrix(rows: Rows, D, sq_norms, kind: str):
    """The IPM normal matrix ``[[I + X^T D X, X^T D 1], [1^T D X, sum D]]`` ``[d+1, d+1]``
    from the rows ``X [n, d]`` (float64, and their float32 copy: `Rows`), ``D [n]`` and
    ``sq_norms = ||x_i||^2 [n]``.

    ``kind="rough"``: all rows accumulated in float32 (early iterations: ``D`` mildly spread,
    a rough direction is enough).  ``"split"``: a preconditioner for `pcg` -- the
    ``2 (d+1)`` rows of largest ``D_i ||x_i||^2`` in float64, the others in float32, except a
    tail of total ``sum D_i ||x_i||^2 <= DROP_MASS`` left out (it moves the eigenvalues of
    ``M_Q^{-1} M`` into ``[1, 1 + DROP_MASS]``: ``M >= I``; the PCG's products, `Rows.normal_apply`,
    cost ~1/40 of the matrix, so a preconditioner from fewer rows pays: on SmolLM2 stage 1, 3-8 products
    a solve instead of 2-3).  ``"exact"``: all rows in float64.
    """
    X, X32 = rows.X, rows.X32
    n, d = X.shape
    M = torch.zeros(d + 1, d + 1, dtype=torch.float64, device=X.device)
    if kind == "rough":
        M[:d, :d] = gram(X32 * D.sqrt().to(torch.float32)[:, None])
        Dk = D
    elif kind == "exact":
        M[:d, :d] = gram(X * D.sqrt()[:, None])
        Dk = D
    else:
        mass = D * sq_norms
        order = torch.argsort(mass, descending=True)
        tail = torch.flip(torch.cumsum(torch.flip(mass[order], [0]), 0), [0])   # mass of order[i:]
        n_kept = int((tail > DROP_MASS).sum())
        n_heavy = min(n_kept, 2 * (d + 1))
        heavy = order[:n_heavy]
        M[:d, :d] = gram(X.index_select(0, heavy) * D[heavy].sqrt()[:, None])
        Dk = torch.zeros_like(D)
        Dk[order[:n_kept]] = D[order[:n_kept]]
        if n_kept > n_heavy:
            light = order[n_heavy:n_kept]
            M[:d, :d] += gram(X32.index_select(0, light).mul_(D[light].sqrt().to(torch.float32)[:, None]))
    M[:d, :d] += torch.eye(d, dtype=torch.float64, device=X.device)
    col = rows.rmv(Dk)
    M[:d, d] = col
    M[d, :d] = col
    M[d, d] = Dk.sum() * (1.0 + 1e-14)
    return M


def pcg(apply, L, rhs, tol: float = 1e-10, max_iter: int = 25):
    """Solve ``A x = rhs`` (SPD, ``[d+1]``) by conjugate gradients preconditioned with the Cholesky
    factor ``L`` of an approximation of ``A``; ``apply(v) = (A v, B v)`` for some linear map ``B``
    (the IPM's ``X v[:d]``: tracked along, so the caller gets ``B x`` without another pass).
    Returns ``(x, B x)`` or None when ``||A x - rhs|| > tol ||rhs||`` after ``max_iter`` steps."""
    x = torch.cholesky_solve(rhs[:, None], L).reshape(-1)
    Ax, Bx = apply(x)
    r = rhs - Ax
    bound = tol * float(rhs.norm())
    if float(r.norm()) <= bound:
        return x, Bx
    z = torch.cholesky_solve(r[:, None], L).reshape(-1)
    p, rz = z, float(r @ z)
    for _ in range(max_iter):
        Ap, Bp = apply(p)
        step = rz / float(p @ Ap)
        x, Bx, r = x + step * p, Bx + step * Bp, r - step * Ap
        if float(r.norm()) <= bound:
            return x, Bx
        z = torch.cholesky_solve(r[:, None], L).reshape(-1)
        rz, rz_old = float(r @ z), rz
        p = z + (rz / rz_old) * p
    return None


def interior_point(X, y, c, rho, g_far, w, b, gap_target: float, max_iter: int = 60,
                   gap_rel: float | None = None, p_const: float = 0.0, shift: float = 1.0):
    """Primal-dual interior point method (Mehrotra predictor-corrector, and one Gondzio (1996) centrality
    corrector when it lengthens the step: on SmolLM2 stage 1, 16-21 -> 13-17 iterations) for::

        min_{w,b,xi} 0.5||w||^2 - g_w.w - g_b b + sum_i c_i xi_i
        s.t. y_i (w.x_i + b) + xi_i >= rho_i,  xi_i >= 0

    (``g_far = [g_w, g_b]``: the linear term of examples held at ``alpha = c``
    outside the working set).  Each step solves the ``(d+1)``-sized normal system
    ``[[I + X^T D X, X^T D 1], [1^T D X, sum D]]`` (Ferris & Munson 2002): while the
    complementarity is far from the target, with the matrix accumulated in float32; then by
    conjugate gradients on the exact (float64, implicit, ``O(n d)`` a product: `kernels.Rows`) system,
    preconditioned with `normal_matrix` (precise) -- and, if that does not converge, with the
    full float64 matrix.
    Stops when the complementarity ``a.r + s.xi <= gap_target`` (with ``gap_rel``: ``<= gap_rel``
    times the current primal objective ``0.5||w||^2 - g_w.w - g_b b + c.xi + p_const``, ``p_const``
    the fixed examples' constant, so the target follows the problem's own scale).
    The slacks start at ``shift`` plus their values at ``(w, b)``: a warm start (a neighbouring
    problem's solution) takes a small ``shift`` and saves a few iterations (18-23 -> 15-19 on
    SmolLM2 city_locations' stage 1).
    Returns ``(w, b, alpha [n], iterations)``.
    """
    n, d = X.shape
    dt, dev = X.dtype, X.device
    gw, gb = g_far[:d], float(g_far[d])
    sq_norms = (X * X).sum(1)
    rows = Rows(X)
    f = rows.mv(w) + b
    u = rho - y * f
    xi = torch.clamp(u, min=0.0) + shift               # interior start, consistent with (w, b)
    r = torch.clamp(-u, min=0.0) + shift               # slack of the margin constraint
    a = c / 2                                          # multiplier of the margin constraint
    s = c / 2                                          # multiplier of xi >= 0
    it = 0
    for it in range(1, max_iter + 1):
        ay = a * y
        R1 = w - gw - rows.rmv(ay)
        R2 = -gb - float(ay.sum())
        R3 = c - a - s
        R4 = y * f + xi - rho - r
        comp = float(a @ r + s @ xi)
        mu = comp / (2 * n)
        res = max(float(R1.abs().max()) / (1.0 + float(w.abs().max()) + float(gw.abs().max())),
                  abs(R2) / (1.0 + abs(gb) + float(c.sum())),
                  float(R3.abs().max()) / (1.0 + float(c.max())),
                  float(R4.abs().max()) / (1.0 + float(rho.abs().max())))
        if gap_rel is not None:
            gap_target = gap_rel * max(abs(float(0.5 * (w @ w) - gw @ w) - gb * b + float(c @ xi) + p_const), 1e-12)
        if comp <= gap_target and res <= 1e-8:
            break   # (the certificate is exact whatever the residual; ill-conditioned late steps can raise it)
        D = 1.0 / (xi / s + r / a)
        d_sum = float(D.sum())

        def apply(v):                                   # (the exact normal matrix times v [d+1], X v[:d])
            Mv, xv = rows.normal_apply(D, v)
            Mv[:d] += v[:d]
            Mv[d] += 1e-14 * d_sum * v[d]
            return Mv, xv

        rough = comp > 1e4 * gap_target and float(D.max()) <= 1e6 * float(D.min())
        L, info = torch.linalg.cholesky_ex(normal_matrix(rows, D, sq_norms, "rough" if rough else "split"))
        exact_L = None

        def with_image(x):                              # (x [d+1], X x[:d])
            return x, rows.mv(x[:d])

        def solve(rhs):                                 # (solution [d+1], X solution[:d])
            nonlocal exact_L
            if rough and int(info) == 0:
                return with_image(torch.cholesky_solve(rhs[:, None], L).reshape(-1))
            sol = pcg(apply, L, rhs) if int(info) == 0 else None
            if sol is None:                                 # precondition with the full float64 matrix
                if exact_L is None:
                    M = normal_matrix(rows, D, sq_norms, "exact")
                    exact_L, bad = torch.linalg.cholesky_ex(M)
                    if int(bad) != 0:
                        exact_L, bad = torch.linalg.cholesky_ex(
                            M + 1e-10 * float(torch.diagonal(M).max()) * torch.eye(d + 1, dtype=dt, device=dev))
                        if int(bad) != 0:
                            raise FloatingPointError("interior point: normal matrix is not positive definite")
                sol = pcg(apply, exact_L, rhs, max_iter=5)
                if sol is None:
                    sol = with_image(torch.cholesky_solve(rhs[:, None], exact_L).reshape(-1))
            return sol

        def direction(R5a, R5b):
            q = -R4 - (R5b - xi * R3) / s + R5a / a
            Dq = D * q
            sol, Xdw = solve(torch.cat([-R1 + rows.rmv(y * Dq), (y @ Dq - R2).reshape(1)]))
            dw, db = sol[:d], float(sol[d])
            dfx = Xdw + db
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
        R5a, R5b = sigma * mu - a * r - da * dr, sigma * mu - s * xi - ds * dxi
        step = direction(R5a, R5b)                                            # corrector
        st = step_to_boundary((a, step[3]), (s, step[5]), (r, step[4]), (xi, step[6]))
        if st < 1.0:    # Gondzio's centrality corrector: aim past the step with the outlying products moved in
            target = min(1.0, 1.5 * st + 0.1)
            _, _, _, da, dr, ds, dxi = step
            lo, hi = 0.1 * sigma * mu, 10.0 * sigma * mu
            pa, ps = (a + target * da) * (r + target * dr), (s + target * ds) * (xi + target * dxi)
            ta, ts = (pa.clamp(lo, hi) - pa).clamp_(min=-hi), (ps.clamp(lo, hi) - ps).clamp_(min=-hi)
            trial = direction(R5a + ta, R5b + ts)
            st_trial = step_to_boundary((a, trial[3]), (s, trial[5]), (r, trial[4]), (xi, trial[6]))
            if st_trial >= st + 0.1 * (target - st):
                step, st = trial, st_trial
        dw, db, dfx, da, dr, ds, dxi = step
        st = min(1.0, 0.99 * st)
        w, b, f = w + st * dw, b + st * db, f + st * dfx
        a, s, r, xi = a + st * da, s + st * ds, r + st * dr, xi + st * dxi
    return w, float(b), torch.minimum(torch.clamp(a, min=0.0), c), it


def working_set_size(n: int, d: int, band_n: int) -> int:
    """Examples in the interior point's first working set: ``max(2 (d+1), 3 |band|)``, at most n."""
    return min(n, max(2 * (d + 1), 3 * band_n))


def on_all_rows(n: int, d: int, band_n: int) -> bool:
    """Whether the interior point takes every example: few of them (``n <= IPM_FULL_N``), or a
    working set that would hold most of them (the smoothed partition is then no guide)."""
    return n <= IPM_FULL_N or working_set_size(n, d, band_n) > MOST * n


WARM_BAND = 1.0      # warm start: examples with |u| below this join the interior point's first set
COLD_BAND = 0.3      # the same after the smoothing levels of a cold start (around u = mu/2)


def feasible_set(ws, at_c, u, y, c):
    """``ws`` grown (by the examples nearest the margin, doubling) until the examples held at
    ``alpha = c`` outside it leave ``sum alpha_i y_i = 0`` strictly feasible inside it (all of them
    when that takes most of the examples)."""
    n = u.numel()
    order = torch.argsort(u.abs())
    k = int(ws.sum())
    while k <= MOST * n:
        g_b = float(torch.where(~ws & at_c, c * y, torch.zeros_like(c)).sum())
        cw = torch.where(ws, c, torch.zeros_like(c))
        c_pos, c_neg = float(cw[y > 0].sum()), float(cw[y < 0].sum())
        if -0.9 * c_pos < g_b < 0.9 * c_neg:           # sum_ws alpha_i y_i = -g_b, 0 <= alpha <= c
            return ws
        k *= 2
        ws = ws.clone()
        ws[order[:k]] = True
    return torch.ones(n, dtype=torch.bool, device=u.device)


def warm_working_set(u, y, c, d: int, band: float | None = None):
    """The interior point's first set from a warm start's hinge arguments ``u [n]``: every example
    with ``|u| < band`` and at least the ``2 (d+1)`` nearest the margin (all of them when that is
    most of the examples), grown by `feasible_set` (the others held at ``alpha = c`` if ``u >= 0``)."""
    band = WARM_BAND if band is None else band
    n = u.numel()
    k = max(min(n, 2 * (d + 1)), int((u.abs() < band).sum()))
    if k > MOST * n:
        return torch.ones(n, dtype=torch.bool, device=u.device)
    ws = torch.zeros(n, dtype=torch.bool, device=u.device)
    ws[torch.argsort(u.abs())[:k]] = True
    return feasible_set(ws, ~ws & (u >= 0), u, y, c)


def interior_point_working_set(X, y, c, rho, u, mu, w, b, gap_target: float, max_rounds: int = 4,
                               move_frac: float = 0.25, ws=None, gap_rel: float | None = None,
                               try_polish: bool = True, accept=None, shift: float = 1.0):
    """Interior point on the examples nearest the margin, the others held fixed, then a polish.

    The working set is the ``K = max(2 (d+1), 3 |band|)`` examples with ``u``
    closest to the band ``(0, mu)`` (all examples if that is most of them, or n <= IPM_FULL_N); the
    others keep ``alpha = c`` (``u >= mu/2``) or ``alpha = 0``.  The interior solution tells
    the partition (on the margin: ``|u| < 1e-6``) and a polish on all examples from it lands
    on the exact vertex solution, also when a few examples outside the set were held on the
    wrong side (it moves them).  Only when that polish fails do the outside examples on the
    wrong side of the margin join the set (with the 20 % of the others nearest the margin) for
    another round (at most ``max_rounds``).
    ``ws`` (bool ``[n]``) gives the first set instead (a warm start: ``u`` then comes from a
    neighbouring problem's solution and ``mu = 0``); ``gap_rel`` is passed to `interior_point`
    (its target then follows the objective); ``try_polish=False`` skips the polishes; ``shift`` is
    `interior_point`'s; ``accept(w, b, alpha)`` (a certificate check) ends the rounds early when a
    round's solution with its violators already passes it.
    Returns ``(w, b, alpha [n], iterations, |set|, polished)`` (the polish's solution when it
    settled, else the interior one of a round without violators) or None.
    """
    n, d = X.shape
    band_n = int(((u > 0) & (u < mu)).sum())
    if ws is not None:
        ws = ws.clone()
    elif on_all_rows(n, d, band_n):
        ws = torch.ones(n, dtype=torch.bool, device=X.device)
    else:
        ws = torch.zeros(n, dtype=torch.bool, device=X.device)
        ws[torch.topk(-(u - 0.5 * mu).abs(), working_set_size(n, d, band_n)).indices] = True
    at_c = ~ws & (u >= 0.5 * mu)
    its = 0
    delta = 1e-6
    for _ in range(max_rounds):
        cy_far = torch.where(at_c & ~ws, c * y, torch.zeros_like(c))
        g_far = torch.cat([X.T @ cy_far, cy_far.sum().reshape(1)])
        idx = torch.nonzero(ws, as_tuple=False).reshape(-1)
        Xw = X if len(idx) == n else X.index_select(0, idx)
        p_const = float((torch.where(at_c & ~ws, c * rho, torch.zeros_like(c))).sum())
        w_i, b_i, a_w, k = interior_point(Xw, y[idx], c[idx], rho[idx], g_far, w, b, 0.1 * gap_target,
                                          gap_rel=None if gap_rel is None else 0.1 * gap_rel, p_const=p_const,
                                          shift=shift)
        its += k
        u_all = rho - y * (X @ w_i + b_i)
        bad = ~ws & ((at_c & (u_all < 0)) | (~at_c & (u_all > 0)))
        a = torch.where(at_c & ~ws, c, torch.zeros_like(c))
        a[idx] = a_w
        if bool(bad.any()) and accept is not None and accept(w_i, b_i, a):
            return w_i, b_i, a, its, int(ws.sum()), False     # its violators cost less than the tolerance
        if try_polish:
            pol = polish(X, y, c, rho, u_all + delta, 2 * delta, working_set=0.0, max_rounds=10, move_frac=move_frac)
            if pol is not None:
                return pol[0], pol[1], pol[2], its, int(ws.sum()), True
        if not bool(bad.any()):
            return w_i, b_i, a, its, int(ws.sum()), False
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
