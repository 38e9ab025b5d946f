"""The primal linear SVM solver every sAwMIL stage uses, with a certified duality gap."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from probes.samil.bags import as_tensor, matvec
from probes.samil import exact
from probes.samil.dual_cd import dual_cd_polish
from probes.samil.smoothing import newton_level

MOVE_FRAC = 0.25     # active-set polish: at most this fraction of |F| joins per round
LEVEL_STEPS = 10     # Newton steps per smoothing level at most
WARM_SHIFT = 0.1     # a warm start's interior point: slacks start this far from their values at (w0, b0)


def hinge_objective(X, y, c, coef, intercept, rho=None) -> float:
    """Exact primal objective ``0.5 ||w||^2 + sum_i c_i max(0, rho_i - y_i (w.x_i + b))``.

    Shapes: ``X [n, d]``, ``y [n]`` in {0,1} or {-1,+1}, ``c`` scalar or ``[n]``,
    ``coef [d]``, ``intercept`` scalar, ``rho`` scalar/``[n]`` (default 1).
    Computed in float64.
    """
    X = as_tensor(X)
    dev = X.device
    w = as_tensor(coef, torch.float64, dev).reshape(-1)
    y = as_tensor(y, torch.float64, dev).reshape(-1)
    y = torch.where(y > 0, 1.0, -1.0).to(torch.float64)
    c = as_tensor(c, torch.float64, dev)
    rho = torch.ones((), dtype=torch.float64, device=dev) if rho is None else as_tensor(rho, torch.float64, dev)
    f = matvec(X, w) + float(intercept)
    loss = (c * torch.clamp(rho - y * f, min=0.0)).sum()
    return float(0.5 * (w @ w) + loss)


@dataclass
class SVMResult:
    coef: torch.Tensor
    intercept: float
    objective: float
    duality_gap: float
    n_iter: int
    mu: float
    converged: bool
    info: dict = field(default_factory=dict)


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
                   w0=None, b0: float = 0.0, warm: bool = False, dual_cd: bool = False) -> SVMResult:
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
       level, at most ``LEVEL_STEPS`` steps per level.  Bands of more than
       ``smoothing.HESS_CAP`` rows enter the Hessian stride-subsampled and in float32 (it
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
       ``n <= exact.IPM_FULL_N`` or when they are most of the problem), the others held at
       ``alpha = 0`` or ``c``; a polish on all examples from its partition returns the
       exact vertex solution, and when it does not settle the examples held on the wrong
       side join the set for another round.  With ``n <= exact.IPM_FULL_N`` (a cold start) it runs
       first, on every example, before any smoothing level (whose optimum would only be its start);
       else after the first level when
       the first level's band (times 3) holds more than 60 % of
       the examples (the smoothed partition is then no guide), else after the second -- then on the
       examples within ``exact.COLD_BAND`` of the smoothed margin, its rounds ending as soon as
       the certificate holds (violators left outside that cost less than the tolerance), without
       the polishes (on
       SmolLM2 city_locations stage 3: 50 interior-point iterations over rounds of up to ~5700
       rows instead of 108 growing to all 16 343).
    4. Certificate.  The exact-hinge duality gap ``P(w, b) - D(alpha)``,
       ``D(alpha) = sum_i rho_i alpha_i - 0.5 ||sum_i alpha_i y_i x_i||^2`` with a
       feasible ``alpha`` (``0 <= alpha_i <= c_i``, ``sum alpha_i y_i = 0``:
       ``c_i h'_mu(u_i)`` class-balanced after a smoothing level, the KKT
       multipliers after a polish) bounds ``P - P*`` (and ``||w - w*||^2 <= 2 gap``).
       The solver stops when ``gap <= tol * P`` or after ``max_iter`` Newton steps
       (returning the iterate with the smallest gap).

    Warm start (``warm=True`` with ``w0``, ``b0``: a neighbouring problem's solution, e.g. the
    same rows at another C, or another fold): the interior point runs first, on the examples
    whose hinge argument at ``(w0, b0)`` is near the margin (`exact.warm_working_set`), the others
    held at ``alpha = c`` / ``0`` by their side, its target relative to its own objective; the
    same certificate decides, and when it does not hold the cold path above continues from its
    best point.

    Dual coordinate descent first (``dual_cd=True``, CPU only): proximal rounds on the bias from
    ``b0``, each a coordinate-descent solve of the box-constrained dual followed by a polish on its
    partition (`probes.samil.dual_cd`); when the polish does not settle, the interior point on the
    examples near the last round's margin (as after a warm start); the same certificate decides, and
    when it does not hold the path above continues from the best point. Several times faster on well-conditioned problems
    (sAwMIL's stage 3); on crowded, near-degenerate ones (stage 1) coordinate descent crawls.

    ``X`` may be float32 or float64 (a float64 copy is used).
    """
    dev = torch.device(device) if device is not None else (X.device if isinstance(X, torch.Tensor) else torch.device("cpu"))
    X = as_tensor(X, torch.float64, dev)
    n, d = X.shape
    y = as_tensor(y, torch.float64, dev).reshape(-1)
    y = torch.where(y > 0, 1.0, -1.0).to(torch.float64)
    c = as_tensor(c, torch.float64, dev)
    c = c.expand(n).contiguous() if c.dim() == 0 else c.reshape(-1)
    rho = torch.ones(n, dtype=torch.float64, device=dev) if rho is None else as_tensor(rho, torch.float64, dev)
    rho = rho.expand(n).contiguous() if rho.dim() == 0 else rho.reshape(-1)
    if y.numel() != n or c.numel() != n or rho.numel() != n:
        raise ValueError("X, y, c and rho disagree on the number of examples")

    w = torch.zeros(d, dtype=torch.float64, device=dev) if w0 is None else as_tensor(w0, torch.float64, dev).clone()
    b = float(b0)
    u = rho - y * (X @ w + b)          # [n] hinge arguments
    eye = torch.eye(d + 1, dtype=torch.float64, device=dev)
    eye[d, d] = 0.0                    # the bias is not regularised

    def primal(w_: torch.Tensor, u_: torch.Tensor) -> float:
        return float(0.5 * (w_ @ w_) + (c * torch.clamp(u_, min=0.0)).sum())

    def dual(a: torch.Tensor) -> float:
        a = _balanced_alpha(a, y)
        w_a = X.T @ (a * y)
        return float((rho * a).sum() - 0.5 * (w_a @ w_a))

    def certify(w_: torch.Tensor, b_: float, a_: torch.Tensor, name: str, **info) -> bool:
        """Exact objective and duality gap of a candidate (w_, b_) with multipliers a_ [n]:
        recorded in this level's history, kept if it is the best so far; True if within tol."""
        nonlocal best
        P_ = primal(w_, rho - y * (X @ w_ + b_))
        gap_ = max(P_ - dual(a_), 0.0)
        rec.update({f"{name}_P": P_, f"{name}_gap": gap_, **info})
        if gap_ < best[3]:
            best = (w_, b_, P_, gap_)
        return gap_ <= tol * max(abs(P_), 1e-12)

    def ipm_near(w_: torch.Tensor, b_: float, band: float | None) -> bool:
        """The interior point on the examples near the margin of (w_, b_) (`exact.warm_working_set`,
        ``band``), the others held by their side, its rounds ended by the certificate; True if it holds."""
        u_ = rho - y * (X @ w_ + b_)
        ws = exact.warm_working_set(u_, y, c, d, band)
        rec["warm_set"] = int(ws.sum())
        try:
            res = exact.interior_point_working_set(X, y, c, rho, u_, 0.0, w_, b_, tol * max(abs(primal(w_, u_)), 1e-12),
                                                   move_frac=MOVE_FRAC, ws=ws, gap_rel=tol, try_polish=False,
                                                   accept=lambda w2, b2, a2: certify(w2, b2, a2, "round"),
                                                   shift=WARM_SHIFT)
        except FloatingPointError:     # (a start far off: the cold path decides)
            return False
        return res is not None and certify(res[0], res[1], res[2], "ipm", ipm_iter=res[3], ipm_set=res[4])

    def result(converged_: bool, mu_: float) -> SVMResult:
        w_, b_, P_, gap_ = best
        return SVMResult(coef=w_, intercept=float(b_), objective=P_, duality_gap=gap_, n_iter=n_iter,
                         mu=mu_, converged=converged_, info=dict(history=history))

    t_begin = time.perf_counter()
    n_iter = 0
    mu = float(mu0)
    history = []
    best = None
    converged = False
    level = 0
    def from_dual_cd() -> bool:
        w_d, _, _, info_d = dual_cd_polish(X, y, c, rho, b, lambda w_, b_, a_: certify(w_, b_, a_, "dual_cd"))
        rec["dual_cd"] = {k: v for k, v in info_d.items() if k != "point"}
        # the polish did not settle the partition: the interior point near the last round's margin
        return w_d is not None or ("point" in info_d and ipm_near(*info_d["point"], exact.COLD_BAND))

    def ipm_all() -> bool:
        """The interior point on every example, then a polish (few examples: the smoothing level would
        only find its start); True if the certificate holds."""
        try:
            res = exact.interior_point_working_set(X, y, c, rho, u, 0.0, w, b, 0.0, move_frac=MOVE_FRAC, gap_rel=tol,
                                                   ws=torch.ones(n, dtype=torch.bool, device=dev))
        except FloatingPointError:
            return False
        return res is not None and certify(res[0], res[1], res[2], "polish" if res[5] else "ipm", ipm_iter=res[3],
                                           ipm_set=res[4])

    attempts = [from_dual_cd] if dual_cd and polish and dev.type == "cpu" else []
    if warm and w0 is not None and polish:
        attempts.append(lambda: ipm_near(w, b, None))
    elif polish and n <= exact.IPM_FULL_N:
        attempts.append(ipm_all)
    for attempt in attempts:       # the fast starts; each falls back to the next, then to the cold path
        best = (w, b, primal(w, u), float("inf"))
        rec = dict(mu=0.0, n_iter=0, P=best[2])
        converged = attempt()
        rec["seconds"] = time.perf_counter() - t_begin
        history.append(rec)
        if converged:
            return result(True, 0.0)
        w, b = best[0], best[1]
        u = rho - y * (X @ w + b)
    while True:
        # ---------------- Newton on the smoothed problem at this mu ----------------
        # a capped number of steps per level: near-hard-margin problems can need many
        # small steps on a level whose partition the polish already gets right
        w, b, u, k = newton_level(X, y, c, rho, u, w, b, mu, eye, min(LEVEL_STEPS, max_iter - n_iter))
        n_iter += k
        u = rho - y * (X @ w + b)                              # refresh (no drift)
        P = primal(w, u)
        gap = max(P - dual(c * torch.clamp(u / mu, 0.0, 1.0)), 0.0)
        band_n = int(((u > 0) & (u < mu)).sum())
        rec = dict(mu=mu, n_iter=n_iter, P=P, gap=gap, band=band_n)
        if best is None or gap < best[3]:
            best = (w, b, P, gap)
        if gap <= tol * max(abs(P), 1e-12):
            converged = True
        elif polish and band_n <= 4 * (d + 1):
            t_pol = time.perf_counter()
            pol = exact.polish(X, y, c, rho, u, mu, working_set, move_frac=MOVE_FRAC)
            rec["polish_seconds"] = time.perf_counter() - t_pol
            if pol is not None:
                converged = certify(*pol[:3], "polish", polish_rounds=pol[3])
        if not converged and polish and (level == 1 or (level == 0 and exact.on_all_rows(n, d, band_n))):
            # the active-set guess did not settle: interior point on the examples near
            # the margin (all of them when n is small), robust to degeneracy/conditioning
            t_ipm = time.perf_counter()
            if exact.on_all_rows(n, d, band_n):
                res = exact.interior_point_working_set(X, y, c, rho, u, mu, w, b, tol * max(abs(P), 1e-12),
                                                       move_frac=MOVE_FRAC)
            else:
                # the examples near the smoothed margin (a band of exact.COLD_BAND around it), the
                # rounds ending as soon as the certificate holds (as after a warm start)
                res = exact.interior_point_working_set(
                    X, y, c, rho, u, mu, w, b, tol * max(abs(P), 1e-12), move_frac=MOVE_FRAC,
                    ws=exact.warm_working_set(u - 0.5 * mu, y, c, d, exact.COLD_BAND), gap_rel=tol, try_polish=False,
                    accept=lambda w_, b_, a_: certify(w_, b_, a_, "round"))
            rec["ipm_seconds"] = time.perf_counter() - t_ipm
            if res is not None:
                w_i, b_i, a_i, its, n_ws, polished = res
                converged = certify(w_i, b_i, a_i, "polish" if polished else "ipm", ipm_iter=its, ipm_set=n_ws)
        rec["seconds"] = time.perf_counter() - t_begin
        history.append(rec)
        if converged or n_iter >= max_iter or mu <= mu_min:
            break
        mu *= mu_factor
        level += 1
    return result(converged, mu)
