"""The sAwMIL estimator: sparse-aware multiple-instance SVM (linear), three stages, in PyTorch.

This is the probe of "The Trilemma of Truth in Large Language Models"
(Savcisens & Eliassi-Rad, arXiv:2506.23921): an sbMIL-style (Bunescu & Mooney,
2007) three-stage linear multiple-instance SVM whose bags are the token
activations of one statement.  Every optimisation problem is solved in the
primal by :func:`probes.samil.solver.fit_linear_svm`, to a certified duality
gap, on all bags and all their tokens, on CPU or GPU. Data layout: :mod:`probes.samil.bags`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
from sklearn.base import BaseEstimator

from probes.base import ProbeError, check_choice

from probes.samil.bags import (as_tensor, bag_index, bag_sums, check_offsets, last_k_candidates, matvec,
                               segment_max, unique_rows)
from probes.samil.solver import fit_linear_svm, hinge_objective

DEGENERATE_NORM = 1e-4   # ||w|| at or below this: the fit is degenerate (scores = intercept + float noise)


@dataclass
class PreparedBags:
    """Bags as every sAwMIL fit of them needs them, whatever its C (`prepare_bags`): ``T`` tokens in ``N``
    bags (``N_pos`` positive, holding ``L_pos`` tokens), ``cand [T]`` the stage-2 candidates,
    ``inst_pos_bag [T]`` whether a token's bag is positive, ``inv [T]`` its row of ``Xu [U, d]`` (the
    distinct token vectors, float64); sMIL's rows ``Z [U_- + N_+, d]`` (the distinct negative-bag tokens,
    then the positive bags' means) with labels ``y1`` and margins ``rho1``; ``neg_copies [U_-]`` how many
    negative-bag tokens each distinct one stands for."""
    N: int
    N_pos: int
    L_pos: int
    cand: torch.Tensor
    inst_pos_bag: torch.Tensor
    inv: torch.Tensor
    Xu: torch.Tensor
    Z: torch.Tensor
    y1: torch.Tensor
    neg_copies: torch.Tensor
    rho1: torch.Tensor

    @property
    def T(self) -> int:
        return self.inv.numel()

    @property
    def d(self) -> int:
        return self.Xu.shape[1]

    @property
    def device(self) -> torch.device:
        return self.Xu.device


@dataclass
class DistinctTokens:
    """Token vectors ``X [T, d]`` as the SVMs read them, whatever the bags' labels: ``Xu [U, d]`` the
    distinct rows (X's float dtype: float32 holds float32 tokens exactly), ``inv [T]`` each token's row."""
    Xu: torch.Tensor
    inv: torch.Tensor


def distinct_tokens(X, device=None) -> DistinctTokens:
    """The `DistinctTokens` of ``X [T, d]`` (numpy or torch) on ``device`` (None: ``X``'s). Identical tokens
    (shared prefixes) become one row of the SVMs with their C summed: the same objective for every
    (w, b), so the same optimum and certificate, on fewer rows."""
    dev = torch.device(device) if device is not None else (X.device if isinstance(X, torch.Tensor) else torch.device("cpu"))
    X = as_tensor(X, device=dev)
    if X.dim() != 2:
        raise ValueError("X must be [T, d]")
    if X.dtype not in (torch.float32, torch.float64):
        X = X.to(torch.float32 if X.is_floating_point() else torch.float64)   # exact for half types
    rows, inv = unique_rows(X)                     # [U], [T]
    return DistinctTokens(X.index_select(0, rows), inv)


def prepare_bags(X, offsets, y, k: int = 2, candidates=None, device=None) -> PreparedBags:
    """What every sAwMIL fit of these bags shares whatever its C (checked inputs, distinct token vectors,
    sMIL's rows), on ``device`` (None: ``X``'s): fit several C with `SAwMIL.fit_prepared`. Arguments as
    `SAwMIL.fit`; ``X`` may also be the tokens' `distinct_tokens` (computed once for bags labelled
    several ways: the one-vs-all heads of a layer); ``k``: the default candidates' count (the estimator's ``k``)."""
    tokens = X if isinstance(X, DistinctTokens) else distinct_tokens(X, device)
    inv, dev = tokens.inv, tokens.Xu.device
    T = inv.numel()
    offsets = check_offsets(as_tensor(offsets).to(dev), T)
    N = offsets.numel() - 1
    yb = as_tensor(y).to(dev).reshape(-1)
    if yb.numel() != N:
        raise ValueError(f"y has {yb.numel()} labels for {N} bags")
    ypos = yb > 0
    lengths = offsets[1:] - offsets[:-1]
    if int(lengths.min()) <= 0:
        raise ValueError("every bag must hold at least one instance")
    if not bool(ypos.any()) or bool(ypos.all()):
        raise ValueError("need both positive and negative bags")
    if candidates is None:
        cand = last_k_candidates(offsets, int(k))
    else:
        cand = as_tensor(candidates).to(dev).reshape(-1).bool()
        if cand.numel() != T:
            raise ValueError("candidates must be a [T] boolean mask")
    bag_idx = bag_index(offsets)                  # [T]
    inst_pos_bag = ypos[bag_idx]                   # [T] instance belongs to a positive bag
    Xu = tokens.Xu.to(torch.float64)               # [U, d] distinct token vectors
    # sMIL's rows: the distinct negative-bag tokens, then the positive bags' means
    neg_count = torch.bincount(inv[~inst_pos_bag], minlength=Xu.shape[0])           # [U] negative copies
    neg_groups = torch.nonzero(neg_count, as_tuple=False).reshape(-1)
    pos_bags = torch.nonzero(ypos, as_tuple=False).reshape(-1)
    pos_len = lengths[pos_bags].to(torch.float64)
    pos_tokens = torch.nonzero(inst_pos_bag, as_tuple=False).reshape(-1)             # in order, bag by bag
    pos_rank = torch.cumsum(ypos.long(), 0) - 1                                     # [N] a bag's place in pos_bags
    means = bag_sums(Xu, inv[pos_tokens], pos_rank[bag_idx[pos_tokens]], pos_bags.numel()) / pos_len[:, None]   # [N_+, d]
    n_neg, N_pos, L_pos = neg_groups.numel(), pos_bags.numel(), int(inst_pos_bag.sum())
    ones = torch.ones(n_neg, dtype=torch.float64, device=dev)
    return PreparedBags(
        N=N, N_pos=N_pos, L_pos=L_pos, cand=cand, inst_pos_bag=inst_pos_bag, inv=inv,
        Xu=Xu, Z=torch.cat([Xu.index_select(0, neg_groups), means], 0),
        y1=torch.cat([-ones, torch.ones(N_pos, dtype=torch.float64, device=dev)]),
        neg_copies=neg_count[neg_groups].to(torch.float64),
        rho1=torch.cat([ones, (2.0 - pos_len) / pos_len]))


class SAwMIL(BaseEstimator):
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
        C_i = c * T / (2 T_{y_i})   (stage3_weights="balanced", default)   or   c   ("none")
        c   = C / T   (c_scaling="per_instance", default)   or   C   (c_scaling="none")

      ``T_{y_i}`` is the number of instances labelled like ``i``; the balanced weights average
      to ``c`` (sklearn's "balanced" rule), so C keeps its meaning.  Why balanced: after
      relabelling only a few per cent of the instances are positive (~3.5 % on planted bags with
      k = 2, all tokens), and for a weak signal the unweighted optimum is exactly ``w = 0,
      b = -1`` (every instance negative, objective ``2 c T_+``), whatever C, so no C grid can
      rescue it.  ``"none"`` is the reference's and the ``sawmil`` package's unweighted stage 3.
      A fit with ``||w|| <= DEGENERATE_NORM`` sets ``degenerate_`` (its scores are the
      intercept plus float noise).  Bag score: ``max_{x in B} w.x + b`` (:meth:`decision_function`).

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
    on all bags and all tokens.  Identical token vectors (``bags.unique_rows``; shared statement
    openings make them common: 41 604 SmolLM2 city_locations training tokens hold 17 780 distinct
    vectors) enter each SVM as one row whose C is the sum of theirs, in stage 3 one row per
    (distinct vector, label): the same objective for every ``(w, b)``, so the same optimum and
    certificate, on fewer rows.  Memory: a float64 copy of the ``U`` distinct vectors plus the
    stage-1 and stage-3 row matrices (at most ``U + N_+`` and ``2 U`` rows of ``d``).  The fit is
    deterministic: there is no random component (``seed`` is accepted for API
    symmetry with the other probes; nothing is drawn from it).  Ties in the
    stage-2 ranking are broken by instance order (stable sort).

    Parameters
    ----------
    C : float              regularisation trade-off (both stages).
    eta : float or None    stage-2 fraction of positive-bag instances labelled positive.
    k : int                default candidates: the last ``k`` instances of every bag.
    c_scaling : {"per_instance", "none"}   stage-3 C scaling (see above).
    stage3_weights : {"balanced", "none"}  stage-3 class weights (see above).
    min_pos_ratio : float  stage-2 fallback threshold (reference: 0.05).
    fallback : {"candidates", "any"}  what the stage-2 fallback labels (see above).
    max_iter : int         Newton-step budget per stage.
    tol : float            relative exact-hinge duality gap at which a stage stops.
    device : str or torch.device or None   where to solve (default: CPU).
    seed : int             see above.
    stage3_solver : {"dual_cd", "smoothing"}  how stage 3 starts: dual coordinate descent with proximal
                           rounds on the bias, then the polish (`probes.samil.dual_cd`; CPU; 4-7x faster on
                           SmolLM2 city_locations), or the smoothing continuation (the previous path); the
                           certificate is the same and a dual_cd that does not settle continues by smoothing.
    num_threads : int or None  torch CPU threads during ``fit`` (restored after);
                           None keeps torch's setting.  On a shared, oversubscribed
                           machine 1 thread can be several times faster than 2
                           (OpenMP spin-waits on the dense (d+1)^2 algebra).

    Attributes (after ``fit``)
    --------------------------
    coef_ ``[d]`` float64 tensor, intercept_ float  -- the stage-3 (final) model;
    stage1_coef_ ``[d]``, stage1_intercept_          -- the sMIL model;
    eta_ float (effective), eta_target_ float (used for the cutoff), cutoff_ float,
    n_selected_ int, fallback_used_ bool, c_effective_ float (stage-3 c before class weights),
    degenerate_ bool (``||coef_|| <= DEGENERATE_NORM``),
    fit_info_ dict (timings, iterations, duality gaps, objectives per stage).
    """

    def __init__(self, C: float = 1.0, eta: float | None = None, k: int = 2,
                 c_scaling: str = "per_instance", stage3_weights: str = "balanced", min_pos_ratio: float = 0.05,
                 fallback: str = "candidates", max_iter: int = 300, tol: float = 1e-6, device=None, seed: int = 0,
                 num_threads: int | None = None, stage3_solver: str = "dual_cd"):
        self.C, self.eta, self.k, self.c_scaling, self.stage3_weights = C, eta, k, c_scaling, stage3_weights
        self.min_pos_ratio, self.fallback, self.max_iter, self.tol = min_pos_ratio, fallback, max_iter, tol
        self.device, self.seed, self.num_threads, self.stage3_solver = device, seed, num_threads, stage3_solver

    def check_params(self) -> "SAwMIL":
        """Validate the constructor arguments (called by `fit`; a probe calls it at construction)."""
        check_choice("c_scaling", self.c_scaling, ("per_instance", "none"))
        check_choice("stage3_weights", self.stage3_weights, ("balanced", "none"))
        check_choice("fallback", self.fallback, ("candidates", "any"))
        check_choice("stage3_solver", self.stage3_solver, ("dual_cd", "smoothing"))
        for name in ("C", "min_pos_ratio", "tol"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ProbeError(f"{name}={value!r}: use a positive number")
        if self.eta is not None and not 0 <= self.eta <= 1:
            raise ProbeError(f"eta={self.eta!r}: use a fraction in [0, 1] or null")
        if int(self.k) < 1 or int(self.max_iter) < 1:
            raise ProbeError(f"k={self.k!r} / max_iter={self.max_iter!r}: use integers >= 1")
        return self

    # -- fitting -----------------------------------------------------------------
    def fit(self, X, offsets, y, candidates=None, warm_start=None) -> "SAwMIL":
        """Fit the three stages.

        ``X [T, d]`` float, ``offsets [N+1]`` int64, ``y [N]`` in {0,1} (or {-1,+1}),
        ``candidates [T]`` bool or None (None: last ``k`` tokens of every bag).
        ``warm_start``: ``((w1 [d], b1), (w3 [d], b3))``, the stage-1 and stage-3 models of a
        neighbouring fit in the coordinates of this ``X`` (another C, another fold): each stage's
        solver starts from it (stage 1: `fit_linear_svm(warm=True)`, stage 3: its smoothing levels from
        ``w0``); the stopping rule (certified duality gap) is the same, so only the work changes.
        """
        self.check_params()
        return self.fit_prepared(prepare_bags(X, offsets, y, self.k, candidates, self.device), warm_start)

    def fit_prepared(self, bags: PreparedBags, warm_start=None) -> "SAwMIL":
        """`fit` on bags from `prepare_bags` (made with this estimator's ``k`` and device)."""
        self.check_params()
        prev_threads = torch.get_num_threads()
        if self.num_threads:
            torch.set_num_threads(int(self.num_threads))
        try:
            return self._fit(bags, warm_start)
        finally:
            if self.num_threads:
                torch.set_num_threads(prev_threads)

    def _fit(self, bags: PreparedBags, warm_start=None) -> "SAwMIL":
        t_start = time.perf_counter()
        dev, T, d, N, N_pos, L_pos = bags.device, bags.T, bags.d, bags.N, bags.N_pos, bags.L_pos
        L_neg, cand, inv, Xu, U = T - L_pos, bags.cand, bags.inv, bags.Xu, bags.Xu.shape[0]
        inst_pos_bag = bags.inst_pos_bag
        solver_kw = dict(tol=float(self.tol), max_iter=int(self.max_iter), device=dev)

        def warm(stage):
            # stage 1 (the same rows and labels as its neighbour): the interior point first, on the
            # examples near the neighbour's margin; stage 3 (its labels follow stage 1, so the
            # neighbour is a rougher guess): the smoothing levels start from it (measured faster)
            if warm_start is None:
                return {}
            w0, b0 = warm_start[stage]
            return dict(w0=as_tensor(w0, torch.float64, dev), b0=float(b0), warm=stage == 0)

        # ---------------- stage 1: sMIL ----------------
        t0 = time.perf_counter()
        c1 = torch.cat([(float(self.C) / L_neg) * bags.neg_copies,
                        torch.full((N_pos,), float(self.C) / N_pos, dtype=torch.float64, device=dev)])
        r1 = fit_linear_svm(bags.Z, bags.y1, c1, bags.rho1, **solver_kw, **warm(0))
        self.stage1_coef_ = r1.coef
        self.stage1_intercept_ = r1.intercept
        t1 = time.perf_counter()

        # ---------------- stage 2: relabel positive-bag instances ----------------
        pos_rows = torch.nonzero(inst_pos_bag, as_tuple=False).reshape(-1)
        s_pos = (Xu @ r1.coef + r1.intercept)[inv[pos_rows]]                  # [L_+]
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
        c3 = float(self.C) / T if self.c_scaling == "per_instance" else float(self.C)
        self.c_effective_ = c3
        if self.stage3_weights == "balanced":   # (positive, negative) weights, mean 1 over the T instances
            class_weight = (T / (2.0 * self.n_selected_), T / (2.0 * (T - self.n_selected_)))
            c3_i = torch.where(y3 > 0, c3 * class_weight[0], c3 * class_weight[1]).to(torch.float64)
        else:
            class_weight, c3_i = (1.0, 1.0), torch.full((T,), c3, dtype=torch.float64, device=dev)
        # one row per (distinct token, label)
        keys, key_inv = torch.unique(2 * inv + self.instance_labels_.long(), return_inverse=True)
        c3_k = torch.zeros(keys.numel(), dtype=torch.float64, device=dev).index_add_(0, key_inv, c3_i)
        y3_k = torch.where(keys % 2 == 1, 1.0, -1.0).to(torch.float64)
        r3 = fit_linear_svm(Xu.index_select(0, keys // 2), y3_k, c3_k, None, **solver_kw, **warm(1),
                            dual_cd=self.stage3_solver == "dual_cd")
        self.coef_ = r3.coef
        self.intercept_ = r3.intercept
        self.degenerate_ = bool(float(r3.coef.norm()) <= DEGENERATE_NORM)
        t3 = time.perf_counter()
        self.n_features_in_ = d
        self.fit_info_ = dict(
            n_bags=N, n_instances=T, n_distinct=U, n_pos_bags=N_pos, L_pos=L_pos, L_neg=L_neg,
            stage1=dict(objective=r1.objective, duality_gap=r1.duality_gap, n_iter=r1.n_iter,
                        converged=r1.converged, seconds=t1 - t0, history=r1.info["history"]),
            stage2=dict(seconds=t2 - t1),
            stage3=dict(objective=r3.objective, duality_gap=r3.duality_gap, n_iter=r3.n_iter,
                        converged=r3.converged, seconds=t3 - t2, history=r3.info["history"],
                        class_weight=class_weight, coef_norm=float(r3.coef.norm())),
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
        Xt = as_tensor(X)
        w = self.coef_.to(Xt.device)
        return matvec(Xt, w) + self.intercept_

    def decision_function(self, X, offsets):
        """Bag scores ``max_{x in B} w.x + b`` ``[N]`` (segment-wise max, no Python loop).

        Returns a float64 torch tensor if ``X`` is a tensor, else a numpy array.
        Empty bags score ``intercept_`` (as in the ``sawmil`` package).
        """
        s = self.instance_decision_function(X)
        off = as_tensor(offsets).to(s.device)
        check_offsets(off, s.numel())
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
