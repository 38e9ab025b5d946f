"""Tests for probes/samil/ (sAwMIL in PyTorch), partly against the `sawmil` package (OSQP).

The package comparisons need `sawmil` and `osqp` (the `test` extra); they are
skipped when either is missing.  Facts about the package that shape them:
its default Gurobi backend refuses problems over 200 variables without a
licence, so OSQP is used; its `sAwMIL` does not pass `solver=` on to its
first stage (sMIL), so `_PkgSAwMIL` below forwards it.
"""
from __future__ import annotations

import json
import logging
import time
import warnings

import numpy as np
import pytest
import torch
from sklearn.metrics import matthews_corrcoef, roc_auc_score

from experiments.bench.bench_samil import blas_one_thread, package_fit_and_score, split_bags
from probes.features import Features
from probes.samil import (
    SAwMIL,
    SAwMILProbe,
    fit_linear_svm,
    hinge_objective,
    last_k_candidates,
    make_planted_bags,
    segment_max,
)


# ----------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------
def _train_test(n_train, n_test, dim, shift, seed):
    """Planted bags sharing one direction, split into train / test bags."""
    X, off, y, planted, u = make_planted_bags(n_train + n_test, dim, shift=shift, seed=seed)
    train = split_bags(X, off, y, np.arange(n_train))
    test = split_bags(X, off, y, np.arange(n_train, n_train + n_test))
    return train, test


def _sawmil():
    sawmil = pytest.importorskip("sawmil")
    pytest.importorskip("osqp")
    logging.getLogger("sparse_mil.kernels").setLevel(logging.ERROR)  # "Linear kernel has no parameters"
    return sawmil


def _report(record_property, name, value):
    """Show a figure with -s (print), in the junit xml, and in the warnings summary."""
    print(f"\n{name}: {value}")
    record_property(name, value)
    warnings.warn(f"{name}: {value}", UserWarning, stacklevel=2)


# ----------------------------------------------------------------------------
# building blocks
# ----------------------------------------------------------------------------
def test_segment_max_and_candidates():
    rng = np.random.default_rng(0)
    offsets = torch.tensor([0, 3, 3, 4, 9])
    v = torch.as_tensor(rng.normal(size=9))
    got = segment_max(v, offsets, empty=-7.0)
    want = [float(v[0:3].max()), -7.0, float(v[3]), float(v[4:9].max())]
    assert torch.allclose(got, torch.tensor(want, dtype=v.dtype))
    cand = last_k_candidates(torch.tensor([0, 3, 4, 9]), k=2)
    assert cand.tolist() == [False, True, True, True, False, False, False, True, True]


def test_linear_svm_certificate_and_paths():
    """Exact optimum: tiny duality gap, and every solver path lands on the same point."""
    rng = np.random.default_rng(1)
    X = rng.normal(size=(600, 20))
    y = (X[:, 0] + 0.5 * rng.normal(size=600) > 0.8).astype(float)
    for C in (1e-3, 0.1, 10.0):
        r = fit_linear_svm(X, y, C)
        assert r.converged and r.duality_gap <= 1e-6 * r.objective
        assert abs(hinge_objective(X, y, C, r.coef, r.intercept) - r.objective) <= 1e-12 * r.objective
    # smoothing continuation alone (no polish / interior point): close, never better
    # (near-hard-margin problems, large C, need the polish / interior point)
    r2 = fit_linear_svm(X, y, 1e-3, polish=False)
    r1 = fit_linear_svm(X, y, 1e-3)
    assert r1.objective * (1 - 1e-12) <= r2.objective <= r1.objective * (1 + 1e-4)


# ----------------------------------------------------------------------------
# (a) stage 3 alone == the package's linear SVM (OSQP)
# ----------------------------------------------------------------------------
@pytest.mark.slow
def test_stage3_matches_package_svm(record_property):
    sawmil = _sawmil()
    X, off, y, planted, _ = make_planted_bags(100, 576, shift=4.0, seed=3)
    y_inst = planted.astype(float)                 # the same instance labels for both
    C = 0.01
    t0 = time.perf_counter()
    with blas_one_thread():
        pkg = sawmil.SVM(C=C, kernel=sawmil.Linear(), solver="osqp").fit(X.astype(np.float64), y_inst)
    t_pkg = time.perf_counter() - t0
    t0 = time.perf_counter()
    ours = fit_linear_svm(X, y_inst, C)
    t_ours = time.perf_counter() - t0

    est = SAwMIL(C=C, c_scaling="none")
    P_ours = est.objective(X, y_inst, C, coef=ours.coef, intercept=ours.intercept)
    P_pkg = est.objective(X, y_inst, C, coef=pkg.coef_, intercept=pkg.intercept_)
    w_pkg = torch.as_tensor(pkg.coef_, dtype=torch.float64)
    cos = float(ours.coef @ w_pkg / (ours.coef.norm() * w_pkg.norm()))
    Xt = torch.as_tensor(X, dtype=torch.float64)
    offt = torch.as_tensor(off)
    bag_ours = segment_max(Xt @ ours.coef + ours.intercept, offt) >= 0
    bag_pkg = segment_max(Xt @ w_pkg + pkg.intercept_, offt) >= 0
    agree = float((bag_ours == bag_pkg).double().mean())
    _report(record_property, "stage3_vs_package",
            f"objective ours {P_ours:.8g} package {P_pkg:.8g}, cos {cos:.6f}, bag agreement {agree:.3f}, "
            f"time ours {t_ours:.2f}s package {t_pkg:.2f}s")
    assert abs(P_ours - P_pkg) <= 1e-3 * abs(P_pkg)
    assert P_ours <= P_pkg * (1 + 1e-9)            # ours is the (certified) optimum
    assert cos >= 0.999
    assert agree >= 0.98


# ----------------------------------------------------------------------------
# (b) end to end vs the package's sAwMIL
# ----------------------------------------------------------------------------
@pytest.mark.slow
def test_end_to_end_auroc_vs_package(record_property):
    _sawmil()
    (Xtr, otr, ytr), (Xte, ote, yte) = _train_test(120, 300, 576, shift=8.0, seed=0)
    C, eta = 0.1, 0.1
    cand = last_k_candidates(otr, k=2).numpy()
    s_pkg, t_pkg = package_fit_and_score(Xtr, otr, ytr, cand, Xte, ote, C, eta)
    t0 = time.perf_counter()
    # same C, eta and candidates; c_scaling="none", stage3_weights="none" are the package's stage 3
    ours = SAwMIL(C=C, eta=eta, c_scaling="none", stage3_weights="none").fit(Xtr, otr, ytr, candidates=cand)
    t_ours = time.perf_counter() - t0
    auc_pkg = roc_auc_score(yte, s_pkg)
    auc_ours = roc_auc_score(yte, ours.decision_function(Xte, ote))
    auc_default = roc_auc_score(yte, SAwMIL().fit(Xtr, otr, ytr).decision_function(Xte, ote))
    _report(record_property, "bag_auroc",
            f"ours {auc_ours:.4f} (c_scaling=none, {t_ours:.1f}s), package {auc_pkg:.4f} ({t_pkg:.1f}s), "
            f"ours with defaults {auc_default:.4f}")
    assert auc_ours >= auc_pkg


# ----------------------------------------------------------------------------
# (c) determinism, stage-2 fallback, quality on planted data
# ----------------------------------------------------------------------------
def test_deterministic_and_input_types():
    X, off, y, _, _ = make_planted_bags(150, 64, shift=4.0, seed=5)
    a = SAwMIL(seed=7).fit(X, off, y)
    b = SAwMIL(seed=7).fit(X, off, y)
    assert torch.equal(a.coef_, b.coef_) and a.intercept_ == b.intercept_
    assert a.eta_ == b.eta_ and a.fallback_used_ == b.fallback_used_
    c = SAwMIL(seed=7).fit(torch.as_tensor(X), torch.as_tensor(off), torch.as_tensor(y))
    assert torch.allclose(a.coef_, c.coef_, rtol=0, atol=1e-12)
    s_np = a.decision_function(X, off)
    s_t = a.decision_function(torch.as_tensor(X), torch.as_tensor(off))
    assert isinstance(s_np, np.ndarray) and isinstance(s_t, torch.Tensor)
    assert np.allclose(s_np, s_t.numpy())
    assert s_np.shape == (len(y),)


def test_stage2_labels_and_fallback():
    X, off, y, _, _ = make_planted_bags(150, 64, shift=4.0, seed=6)
    T = len(X)
    m = SAwMIL().fit(X, off, y)
    cand = last_k_candidates(off, 2)
    assert not m.fallback_used_
    assert bool((m.instance_labels_ & ~cand).sum() == 0)          # positives only among candidates
    in_pos = torch.as_tensor(np.repeat(y, np.diff(off)) > 0)
    assert bool((m.instance_labels_ & ~in_pos).sum() == 0)        # and only in positive bags
    assert m.eta_ == m.n_selected_ / int(in_pos.sum())

    few = torch.zeros(T, dtype=torch.bool)
    few[torch.nonzero(in_pos).reshape(-1)[:3]] = True             # 3 candidates for ~75 positive bags
    f = SAwMIL().fit(X, off, y, candidates=few)
    assert f.fallback_used_
    assert f.eta_ > 0 and f.n_selected_ >= int(y.sum())          # fallback: top-n, candidates ignored
    assert bool((f.instance_labels_ & ~few).any())

    # enough candidates, but stage 1 ranks them low (the first token of each bag, not the planted
    # last ones): the default fallback takes the best candidates, "any" (the reference) ignores them
    first = torch.zeros(T, dtype=torch.bool)
    first[torch.as_tensor(off[:-1])] = True
    c = SAwMIL().fit(X, off, y, candidates=first)
    assert c.fallback_used_ and bool((c.instance_labels_ & ~first).sum() == 0)
    assert c.n_selected_ == max(int(y.sum()), int(np.ceil(0.05 * int(in_pos.sum()))))
    a = SAwMIL(fallback="any").fit(X, off, y, candidates=first)
    assert a.fallback_used_ and bool((a.instance_labels_ & ~first).any())


def test_planted_mcc_at_zero():
    (Xtr, otr, ytr), (Xte, ote, yte) = _train_test(200, 300, 576, shift=8.0, seed=1)
    m = SAwMIL().fit(Xtr, otr, ytr)
    s = m.decision_function(Xte, ote)
    assert matthews_corrcoef(yte, (s >= 0).astype(int)) >= 0.9
    assert roc_auc_score(yte, s) >= 0.99


def test_c_scaling_and_objective_helper():
    X, off, y, _, _ = make_planted_bags(80, 32, shift=4.0, seed=2)
    T = len(X)
    a = SAwMIL(C=2.0, c_scaling="per_instance", stage3_weights="none").fit(X, off, y)
    b = SAwMIL(C=2.0 / T, c_scaling="none", stage3_weights="none").fit(X, off, y)
    # stage 1 differs (it uses C itself), so compare stage 3 with the same labels (unweighted)
    assert a.c_effective_ == pytest.approx(2.0 / T)
    y3 = a.instance_labels_
    r = fit_linear_svm(X, y3, 2.0 / T)
    assert torch.allclose(r.coef, a.coef_, atol=1e-8)
    assert a.objective(X, y3, 2.0 / T) == pytest.approx(a.fit_info_["stage3"]["objective"], rel=1e-10)
    assert b.c_effective_ == pytest.approx(2.0 / T)
    # balanced (default): C_i = c T / (2 T_y), the same problem with per-instance weights
    w = SAwMIL(C=2.0).fit(X, off, y)
    n_pos = int(w.instance_labels_.sum())
    c_i = torch.where(w.instance_labels_, 2.0 / (2 * n_pos), 2.0 / (2 * (T - n_pos))).double()
    assert float(c_i.mean()) == pytest.approx(2.0 / T)
    r = fit_linear_svm(X, w.instance_labels_, c_i)
    assert torch.allclose(r.coef, w.coef_, atol=1e-8)
    assert w.objective(X, w.instance_labels_, c_i) == pytest.approx(w.fit_info_["stage3"]["objective"], rel=1e-10)


def test_weak_signal_stage3_does_not_collapse(record_property):
    """Weak planted signal, all tokens: ~3.5 % of the instances are positive after relabelling and the
    unweighted stage-3 optimum is w = 0, b = -1 (certified); the balanced default is not degenerate and
    ranks test bags at least as well as the leftover direction of the collapsed fit."""
    (Xtr, otr, ytr), (Xte, ote, yte) = _train_test(500, 500, 64, shift=2.0, seed=0)
    flat = SAwMIL(stage3_weights="none").fit(Xtr, otr, ytr)
    fixed = SAwMIL().fit(Xtr, otr, ytr)
    pos_share = float(flat.instance_labels_.double().mean())
    auc_flat = roc_auc_score(yte, flat.decision_function(Xte, ote))
    auc_fixed = roc_auc_score(yte, fixed.decision_function(Xte, ote))
    _report(record_property, "weak_signal_stage3",
            f"positives {pos_share:.3f}; unweighted |w| {float(flat.coef_.norm()):.2e} b {flat.intercept_:.4f} "
            f"AUROC {auc_flat:.3f}; balanced |w| {float(fixed.coef_.norm()):.3f} AUROC {auc_fixed:.3f}")
    assert pos_share < 0.05
    # w* = 0 exactly; the interior point lands within its certified gap of it (|w| ~ 1e-6)
    assert flat.degenerate_ and float(flat.coef_.norm()) < 1e-5 and flat.intercept_ == pytest.approx(-1.0, abs=1e-4)
    gap = flat.fit_info_["stage3"]
    assert gap["converged"] and gap["duality_gap"] <= 1e-6 * gap["objective"]   # a certified optimum
    assert not fixed.degenerate_ and float(fixed.coef_.norm()) > 0.1
    assert auc_fixed >= auc_flat
    # the probe records it (so does every result cell, as cell["degenerate"])
    bags = Features(torch.as_tensor(Xtr), torch.as_tensor(otr))
    assert SAwMILProbe(C=1.0, stage3_weights="none", accelerator="cpu").fit(bags, ytr).params()["degenerate"]
    assert not SAwMILProbe(C=1.0, accelerator="cpu").fit(bags, ytr).params()["degenerate"]


def test_input_validation():
    X, off, y, _, _ = make_planted_bags(20, 8, seed=0)
    with pytest.raises(ValueError):
        SAwMIL().fit(X, off[:-1], y)                 # offsets do not end at T
    with pytest.raises(ValueError):
        SAwMIL().fit(X, off, np.zeros_like(y))       # a single class
    with pytest.raises(ValueError):
        SAwMIL(c_scaling="bogus").fit(X, off, y)    # sklearn-style: checked in fit
    with pytest.raises(ValueError, match="stage3_weights"):
        SAwMIL(stage3_weights="inverse").fit(X, off, y)
    with pytest.raises(RuntimeError):
        SAwMIL().decision_function(X, off)


def test_merged_duplicates_same_solution():
    """Identical tokens enter each SVM once with their C summed (the fast path): the same optimum as
    the plain solve on every row, stage 1 and stage 3, to the solver's certificate."""
    X, off, y, _, _ = make_planted_bags(120, 32, shift=4.0, seed=4)
    X = X.copy()
    X[off[:-1]] = X[0]                                    # every statement opens with the same token
    X[off[:-1] + 1] = X[1]                                # ... and the same second token
    m = SAwMIL(C=10.0).fit(X, off, y)
    T = len(X)
    assert m.fit_info_["n_distinct"] == T - 2 * (len(y) - 1)
    # stage 3: the plain problem on all T rows, same labels and balanced weights
    lab = m.instance_labels_
    n_pos = int(lab.sum())
    c_i = torch.where(lab, 10.0 / (2 * n_pos), 10.0 / (2 * (T - n_pos))).to(torch.float64)
    full = fit_linear_svm(X, lab, c_i)
    P_fast = m.objective(X, lab, c_i)
    assert full.converged and m.fit_info_["stage3"]["converged"]
    assert abs(P_fast - full.objective) <= 1e-6 * full.objective
    assert P_fast == pytest.approx(m.fit_info_["stage3"]["objective"], rel=1e-10)
    s_fast = m.instance_decision_function(X)
    s_full = torch.as_tensor(X, dtype=torch.float64) @ full.coef + full.intercept
    assert float((s_fast - s_full).abs().max()) <= 1e-4 * float(s_full.abs().max())
    # stage 1: the plain sMIL problem (every negative instance a row, positive bags by their mean)
    Xt = torch.as_tensor(X, dtype=torch.float64)
    inst_pos = torch.as_tensor(np.repeat(y, np.diff(off)) > 0)
    means = torch.stack([Xt[off[i]:off[i + 1]].mean(0) for i in np.flatnonzero(y > 0)])
    lens = torch.as_tensor(np.diff(off)[y > 0], dtype=torch.float64)
    L_neg, N_pos = int((~inst_pos).sum()), int((y > 0).sum())
    Z = torch.cat([Xt[~inst_pos], means])
    y1 = torch.cat([-torch.ones(L_neg), torch.ones(N_pos)]).double()
    c1 = torch.cat([torch.full((L_neg,), 10.0 / L_neg, dtype=torch.float64),
                    torch.full((N_pos,), 10.0 / N_pos, dtype=torch.float64)])
    rho1 = torch.cat([torch.ones(L_neg, dtype=torch.float64), (2.0 - lens) / lens])
    full1 = fit_linear_svm(Z, y1, c1, rho1)
    P1_fast = hinge_objective(Z, y1, c1, m.stage1_coef_, m.stage1_intercept_, rho1)
    assert abs(P1_fast - full1.objective) <= 1e-6 * full1.objective
    assert P1_fast == pytest.approx(m.fit_info_["stage1"]["objective"], rel=1e-10)


def test_warm_started_svm_same_optimum():
    """A warm start (the solution at a neighbouring C, or a perturbed one) lands on the cold
    solve's optimum, to the certificate; a useless warm start (w = 0) still converges."""
    rng = np.random.default_rng(7)
    X = rng.normal(size=(3000, 24))
    y = (X[:, 0] + 0.7 * rng.normal(size=3000) > 0.3).astype(float)
    c = rng.uniform(0.5, 1.5, size=3000) * 1e-2
    prev = fit_linear_svm(X, y, 0.3 * c)
    for w0, b0 in ((prev.coef, prev.intercept), (prev.coef * 1.3, prev.intercept - 0.2),
                   (torch.zeros(24, dtype=torch.float64), 0.0)):
        cold = fit_linear_svm(X, y, c)
        warm = fit_linear_svm(X, y, c, w0=w0, b0=b0, warm=True)
        assert warm.converged and warm.duality_gap <= 1e-6 * warm.objective
        assert abs(warm.objective - cold.objective) <= 1e-6 * cold.objective
        assert abs(hinge_objective(X, y, c, warm.coef, warm.intercept) - warm.objective) <= 1e-12 * warm.objective
        assert float((warm.coef - cold.coef).norm()) <= 1e-2 * float(cold.coef.norm())


def test_warm_cv_equals_cold_cv():
    """C by grouped CV with warm starts (each fold along the grid, its first C from the previous fold's
    fit, the final fit from a fold's fit at the chosen C) == every fit from zero: the same chosen C, the same certified objective of
    every (fold, C) fit in both stages, and the same final model to the solver's tolerance."""
    X, off, y, _, _ = make_planted_bags(240, 32, shift=2.0, seed=5)
    train = Features(torch.as_tensor(X), torch.as_tensor(off), np.arange(240) // 2)
    probes = {w: SAwMILProbe(accelerator="cpu", warm_cv=w, Cs=(1.0, 10.0, 100.0), C_limits=None).fit(train, y)
              for w in (False, True)}
    cold, warm = probes[False], probes[True]
    assert cold.params()["C"] == warm.params()["C"]
    tol = 1e-6
    cold_fits = {(r["fold"], r["C"]): r for r in cold.cv_fits_}
    warm_fits = {(r["fold"], r["C"]): r for r in warm.cv_fits_}
    assert cold_fits.keys() == warm_fits.keys() and len(cold_fits) == 10     # 3 folds x 3 C + the final fit
    for key, rc in cold_fits.items():
        rw = warm_fits[key]
        for st in ("stage1", "stage3"):
            assert rc[f"{st}_converged"] and rw[f"{st}_converged"]
            P = rc[f"{st}_objective"]
            assert rw[f"{st}_duality_gap"] <= tol * rw[f"{st}_objective"]
            assert abs(rw[f"{st}_objective"] - P) <= 2 * tol * P, (key, st)
    for C in cold.params()["cv_auroc"]:
        assert warm.params()["cv_auroc"][C] == pytest.approx(cold.params()["cv_auroc"][C], abs=2e-3)
    s_cold, s_warm = cold.decision_function(train), warm.decision_function(train)
    assert np.abs(s_cold - s_warm).max() <= 1e-2 * np.abs(s_cold).max()


def test_dual_cd_same_optimum_and_fallback(monkeypatch):
    """Dual coordinate descent with proximal rounds on the bias, then the polish: the smoothing path's
    certified optimum, the bias far from zero included; with no coordinate-descent budget the solver
    goes on by smoothing and lands there too."""
    from probes.samil import dual_cd
    rng = np.random.default_rng(11)
    X = rng.normal(size=(2000, 24)) + 0.5
    y = (X[:, 0] + 0.7 * rng.normal(size=2000) > 1.2).astype(float)   # unbalanced: the optimal bias is far from 0
    c = rng.uniform(0.5, 1.5, size=2000) * 1e-2
    ref = fit_linear_svm(X, y, c)
    fast = fit_linear_svm(X, y, c, dual_cd=True)
    step = fast.info["history"][0]
    assert step["dual_cd"]["polish"][-1] is not None and len(fast.info["history"]) == 1   # settled by dual_cd
    assert abs(ref.intercept) > 0.5
    for r in (ref, fast):
        assert r.converged and r.duality_gap <= 1e-6 * r.objective
    assert abs(fast.objective - ref.objective) <= 1e-6 * ref.objective
    assert abs(hinge_objective(X, y, c, fast.coef, fast.intercept) - fast.objective) <= 1e-12 * fast.objective
    monkeypatch.setattr(dual_cd, "BUDGET", 0)
    fallback = fit_linear_svm(X, y, c, dual_cd=True)
    assert len(fallback.info["history"]) > 1 and fallback.converged
    assert abs(fallback.objective - ref.objective) <= 1e-6 * ref.objective


def _same_cv_fits(old, new, tol: float = 1e-6):
    """Two probes' C by CV (3 folds x 3 C + the final fit) agree: the same chosen C, and every (fold, C)
    fit of ``new`` converged in both stages to the certified objective of ``old``'s."""
    assert old.params()["C"] == new.params()["C"]
    old_fits = {(r["fold"], r["C"]): r for r in old.cv_fits_}
    assert old_fits.keys() == {(r["fold"], r["C"]) for r in new.cv_fits_} and len(old_fits) == 10
    for r in new.cv_fits_:
        o = old_fits[(r["fold"], r["C"])]
        for st in ("stage1", "stage3"):
            assert r[f"{st}_converged"] and r[f"{st}_duality_gap"] <= tol * r[f"{st}_objective"]
            assert abs(r[f"{st}_objective"] - o[f"{st}_objective"]) <= 2 * tol * o[f"{st}_objective"], (r, st)


def test_stage3_dual_cd_cv_equals_previous_solver():
    """C by grouped CV with stage 3 by dual coordinate descent (the default) == by the previous
    smoothing path: the same chosen C, the same certified objective of every (fold, C) fit in both
    stages, the same final model to the solver's tolerance (bench_samil --cv-compare on a real layer)."""
    X, off, y, _, _ = make_planted_bags(240, 32, shift=2.0, seed=5)
    train = Features(torch.as_tensor(X), torch.as_tensor(off), np.arange(240) // 2)
    old, new = (SAwMILProbe(accelerator="cpu", stage3_solver=s, Cs=(1.0, 10.0, 100.0), C_limits=None).fit(train, y)
                for s in ("smoothing", "dual_cd"))
    _same_cv_fits(old, new)
    s_old, s_new = old.decision_function(train), new.decision_function(train)
    assert np.abs(s_old - s_new).max() <= 1e-2 * np.abs(s_old).max()
    with pytest.raises(Exception, match="stage3_solver"):
        SAwMILProbe(stage3_solver="newton")


def test_rows_products_equal_float64():
    """`kernels.Rows` (float32-held rows and float64 ones, read by compiled kernels) gives the float64
    products of its rows, whatever their order: the float32-exact rows first (sMIL's stage 1), mixed, all
    exact, none exact."""
    from probes.samil.kernels import Rows
    rng = np.random.default_rng(3)
    X32 = torch.from_numpy(rng.normal(size=(700, 40)).astype(np.float32)).double()     # exact in float32
    Xm = torch.from_numpy(rng.normal(size=(90, 40))) / 3.0                               # bag-mean-like: not
    perm = torch.from_numpy(rng.permutation(790))
    D, t = torch.rand(790, dtype=torch.float64), torch.randn(790, dtype=torch.float64)
    v = torch.randn(41, dtype=torch.float64)
    for X in (torch.cat([X32, Xm]), torch.cat([X32, Xm])[perm], X32, Xm):
        rows = Rows(X)
        n = X.shape[0]
        xv = X @ v[:40]
        Mv, xv_k = rows.normal_apply(D[:n], v)
        tt = D[:n] * (xv + v[40])
        assert torch.allclose(Mv, torch.cat([X.T @ tt, tt.sum().reshape(1)]), rtol=1e-12, atol=1e-12)
        assert torch.allclose(xv_k, xv, rtol=1e-12, atol=1e-12)
        assert torch.allclose(rows.mv(v[:40]), xv, rtol=1e-12, atol=1e-12)
        assert torch.allclose(rows.rmv(t[:n]), X.T @ t[:n], rtol=1e-12, atol=1e-12)
        assert torch.equal(rows.X32, X.to(torch.float32))


def test_compiled_products_cv_equals_previous_solver(monkeypatch):
    """C by grouped CV with the interior point's products by `kernels.Rows` and its preconditioner from
    the rows above `exact.DROP_MASS` (the default) == the previous solver (torch float64 products,
    DROP_MASS 0.1): the same chosen C, the same certified objective of every (fold, C) fit in both stages
    (bench_samil --fits-json / --against on a real layer)."""
    from probes.samil import exact, kernels
    X, off, y, _, _ = make_planted_bags(240, 32, shift=2.0, seed=5)
    train = Features(torch.as_tensor(X), torch.as_tensor(off), np.arange(240) // 2)
    new = SAwMILProbe(accelerator="cpu", Cs=(1.0, 10.0, 100.0), C_limits=None).fit(train, y)
    init = kernels.Rows.__init__

    def torch_products(self, X_):
        init(self, X_)
        self.compiled = False

    monkeypatch.setattr(kernels.Rows, "__init__", torch_products)
    monkeypatch.setattr(exact, "DROP_MASS", 0.1)
    old = SAwMILProbe(accelerator="cpu", Cs=(1.0, 10.0, 100.0), C_limits=None).fit(train, y)
    _same_cv_fits(old, new)


def test_prepared_bags_shared_across_C():
    """One `prepare_bags` serves fits at several C: each equals `SAwMIL.fit` on the raw bags bit for bit
    (the probe prepares each CV fold once for its whole grid)."""
    from probes.samil.estimator import prepare_bags
    X, off, y, _, _ = make_planted_bags(120, 16, shift=2.0, seed=9)
    bags = prepare_bags(X, off, y, k=2)
    for C in (1.0, 10.0):
        a = SAwMIL(C=C).fit(X, off, y)
        b = SAwMIL(C=C).fit_prepared(bags)
        assert torch.equal(a.coef_, b.coef_) and a.intercept_ == b.intercept_
        assert torch.equal(a.stage1_coef_, b.stage1_coef_) and torch.equal(a.instance_labels_, b.instance_labels_)


def test_reference_training_bags_on_a_hand_example():
    """capped_bags: the first `limit` bags; a bag over max_bag_size keeps its last k tokens and a seeded, ordered
    draw of the others; a short bag stays whole."""
    from probes.samil.probe import capped_bags

    X = torch.arange(30, dtype=torch.float32)[:, None]
    bags = Features(X, torch.tensor([0, 3, 15, 30]), np.array([7, 8, 9]))
    capped, y = capped_bags(bags, np.array([1, 0, 1]), 5, 2, 2, seed=0)
    assert capped.offsets.tolist() == [0, 3, 8] and y.tolist() == [1, 0] and capped.groups.tolist() == [7, 8]
    kept = capped.X[3:, 0].tolist()
    assert kept[:3] == sorted(kept[:3]) and set(kept[:3]) < set(range(3, 13)) and kept[3:] == [13.0, 14.0]
    assert capped_bags(bags, np.zeros(3), 5, 2, 2, seed=0)[0].X.tolist() == capped.X.tolist()   # seeded
    assert capped_bags(bags, np.zeros(3), None, 2, None, seed=0)[0].X.tolist() == X.tolist()


def test_the_reference_preset_trains_on_capped_bags(tmp_path):
    """probe=samil_reference: cells under its own name, the reference's options recorded; a bag cap below k is
    refused in one line."""
    from probes.base import ProbeError
    from probes.pipeline import train_probes
    from tests.helpers import make_synthetic_store, run_cfg

    make_synthetic_store(tmp_path / "activations", n_real=300, n_neither=150, max_length=14)
    (path,) = train_probes(run_cfg(tmp_path, "probe=samil_reference", "task=true_vs_all", "layer=[1]",
                                   "probe.train_bag_limit=200"))
    cell = json.loads(path.read_text())
    assert "samil_reference" in str(path)
    (params,) = cell["probe_params"].values()      # one head
    assert params["max_bag_size"] == 10 and params["train_bag_limit"] == 200 and params["Cs"] == [0.05, 0.1, 0.5, 1.0, 10.0]
    assert cell["config"]["probe"]["tokens"] == "all" and cell["metrics"]["auroc"] > 0.8
    with pytest.raises(ProbeError, match="max_bag_size=1 is below k=2"):
        train_probes(run_cfg(tmp_path, "probe=samil_reference", "probe.max_bag_size=1", "layer=[1]"))
