"""Benchmark of probes.samil.SAwMIL (PyTorch, primal) against the `sawmil` package (OSQP).

One run prints:
  1. our fit time vs the package's on identical synthetic bags (dim 576, ~14
     tokens a bag; 250 and 500 bags by default): the time ratio and both held-out
     bag AUROCs, at the same C, eta and candidates (ours with c_scaling="none",
     which is the package's stage-3 C; ours with the defaults is printed too);
  2. our fit on 5000 synthetic bags (dim 576, ~14 tokens): wall / CPU time and
     peak memory (peak RSS of this process during the fit, reset before it via
     /proc/self/clear_refs; CUDA peak when fitted on a GPU);
  3. with --store: our fit on every training bag of a real store (entity-disjoint
     training split, true_vs_all, statement tokens standardised as the probe does,
     at --layer and --C): time, memory and test bag AUROC; then the probe's fit with C
     chosen by grouped CV over its default grid (skip with --skip-cv);
  4. with --store and --cv-compare REPS (instead of 3): the probe's C-by-CV fit with stage 3 solved
     by the previous path (stage3_solver="smoothing") and by dual coordinate descent (the default),
     alternating: times, ratio, chosen C, and per (fold, C, stage) the certified objectives and gaps.

Usage:  python experiments/bench/bench_samil.py [--sizes 250 500] [--big 5000]
        [--skip-package] [--device cuda] [--store activations/smollm2/city_locations.h5]
        [--cv-compare 2]

`fit_and_measure(X, offsets, y)` is reusable on real activations, e.g.
    from experiments.bench.bench_samil import fit_and_measure
    out = fit_and_measure(X, offsets, y, C=1.0)      # X [T, d], offsets [N+1], y [N]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import resource
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # repo root, for `probes`

from probes.samil import SAwMIL, last_k_candidates, make_planted_bags  # noqa: E402


# ----------------------------------------------------------------------------
# measurement helpers (reusable)
# ----------------------------------------------------------------------------
def _rss_mb(field: str) -> float | None:
    """VmRSS / VmHWM of this process in MiB (Linux), else None."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return None


def _reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False when unavailable."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def _cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def fit_and_measure(X, offsets, y, candidates=None, **params) -> dict:
    """Fit ``SAwMIL(**params)`` on ``X [T, d]``, ``offsets [N+1]``, ``y [N]``; time and memory.

    Returns a dict: ``model``, ``seconds`` (wall), ``cpu_seconds`` (this
    process, all threads), ``rss_before_mb``, ``peak_rss_mb`` (peak resident
    memory of the process during the fit; falls back to the lifetime peak
    ``ru_maxrss`` where the peak cannot be reset), ``peak_increment_mb``
    (peak minus the RSS before the fit: what the fit itself added),
    ``cuda_peak_mb`` (device fits), and the data sizes.
    """
    device = params.get("device")
    cuda = device is not None and torch.device(device).type == "cuda"
    rss_before = _rss_mb("VmRSS")
    exact_peak = _reset_peak_rss()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        torch.cuda.synchronize(device)
    c0, t0 = _cpu_seconds(), time.perf_counter()
    model = SAwMIL(**params).fit(X, offsets, y, candidates=candidates)
    if cuda:
        torch.cuda.synchronize(device)
    seconds, cpu = time.perf_counter() - t0, _cpu_seconds() - c0
    peak = _rss_mb("VmHWM") if exact_peak else None
    if peak is None:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    return dict(
        model=model, seconds=seconds, cpu_seconds=cpu,
        rss_before_mb=rss_before, peak_rss_mb=peak,
        peak_increment_mb=(peak - rss_before) if rss_before is not None else None,
        peak_is_exact=exact_peak,
        cuda_peak_mb=(torch.cuda.max_memory_allocated(device) / 2**20) if cuda else None,
        n_bags=len(offsets) - 1, n_tokens=int(offsets[-1]), dim=int(X.shape[1]),
    )


def bag_auroc(y, scores) -> float:
    from sklearn.metrics import roc_auc_score
    return float(roc_auc_score(np.asarray(y), np.asarray(scores)))


def split_bags(X, offsets, y, idx):
    """Bags ``idx`` of a padding-free set -> (X, offsets, y)."""
    rows = np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in idx])
    lens = np.array([offsets[i + 1] - offsets[i] for i in idx])
    return X[rows], np.concatenate([[0], np.cumsum(lens)]).astype(np.int64), y[idx]


# ----------------------------------------------------------------------------
# the package (OSQP)
# ----------------------------------------------------------------------------
def blas_one_thread():
    # numpy's OpenBLAS can crash on large X @ X.T with 2 threads on these machines
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return contextlib.nullcontext()
    return threadpool_limits(1)


def package_fit_and_score(Xtr, otr, ytr, cand, Xte, ote, C, eta):
    """Fit sawmil.sAwMIL (OSQP in both stages) and score the test bags. -> (scores, seconds)."""
    import sawmil
    logging.getLogger("sparse_mil.kernels").setLevel(logging.ERROR)

    class PkgSAwMIL(sawmil.sAwMIL):
        """The package's sAwMIL with `solver` forwarded to its stage 1 (it is not, upstream)."""

        def __fit_mil__(self, bags):
            smil = sawmil.sMIL(C=self.C, kernel=self.kernel, normalizer=self.normalizer, p=self.p,
                               scale_C=self.scale_C, tol=self.tol, verbose=self.verbose,
                               solver=self.solver, solver_params=self.solver_params)
            smil.fit(bags)
            self.smil_ = smil

    def bags(X, off, y=None, m=None):
        return [sawmil.Bag(X=np.asarray(X[off[i]:off[i + 1]], dtype=np.float64),
                           y=0.0 if y is None else float(y[i]),
                           intra_bag_mask=None if m is None else m[off[i]:off[i + 1]].astype(float))
                for i in range(len(off) - 1)]

    train = bags(Xtr, otr, ytr, cand)
    test = bags(Xte, ote)
    with blas_one_thread():
        t0 = time.perf_counter()
        model = PkgSAwMIL(C=C, kernel=sawmil.Linear(), solver="osqp", eta=eta).fit(train)
        seconds = time.perf_counter() - t0
        scores = model.decision_function(test)
    return scores, seconds


# ----------------------------------------------------------------------------
# the runs
# ----------------------------------------------------------------------------
def compare_with_package(n_bags: int, dim: int = 576, C: float = 0.1, eta: float = 0.1,
                         shift: float = 8.0, n_test: int = 500, seed: int = 0, device=None):
    X, off, y, _, _ = make_planted_bags(n_bags + n_test, dim, shift=shift, seed=seed)
    Xtr, otr, ytr = split_bags(X, off, y, np.arange(n_bags))
    Xte, ote, yte = split_bags(X, off, y, np.arange(n_bags, n_bags + n_test))
    cand = last_k_candidates(otr, k=2).numpy()
    print(f"[{n_bags} bags, {len(Xtr)} tokens, dim {dim}; C={C}, eta={eta}; test {n_test} bags]", flush=True)
    same = fit_and_measure(Xtr, otr, ytr, candidates=cand, C=C, eta=eta, c_scaling="none",
                          stage3_weights="none", device=device)
    same1 = fit_and_measure(Xtr, otr, ytr, candidates=cand, C=C, eta=eta, c_scaling="none", stage3_weights="none",
                            device=device, num_threads=1)
    dflt = fit_and_measure(Xtr, otr, ytr, device=device)
    auc_ours = bag_auroc(yte, same["model"].decision_function(Xte, ote))
    auc_dflt = bag_auroc(yte, dflt["model"].decision_function(Xte, ote))
    print(f"  ours, c_scaling='none'           fit {same['seconds']:8.2f} s   bag AUROC {auc_ours:.4f}"
          f"   (cpu {same['cpu_seconds']:.1f} s, {torch.get_num_threads()} threads)")
    print(f"  ours, c_scaling='none', 1 thread fit {same1['seconds']:8.2f} s"
          f"   (identical model: {bool(torch.equal(same['model'].coef_, same1['model'].coef_))})")
    print(f"  ours, defaults                   fit {dflt['seconds']:8.2f} s   bag AUROC {auc_dflt:.4f}", flush=True)
    s_pkg, t_pkg = package_fit_and_score(Xtr, otr, ytr, cand, Xte, ote, C, eta)
    auc_pkg = bag_auroc(yte, s_pkg)
    print(f"  package sAwMIL (OSQP)            fit {t_pkg:8.2f} s   bag AUROC {auc_pkg:.4f}")
    print(f"  time ratio package / ours        {t_pkg / same['seconds']:8.1f}x "
          f"({t_pkg / same1['seconds']:.1f}x with 1 thread)  (target >= 100x at 250 bags)")
    print(f"  AUROC ours - package             {auc_ours - auc_pkg:+.4f}    (target >= 0)", flush=True)
    return dict(n_bags=n_bags, t_pkg=t_pkg, t_ours=same["seconds"], t_ours_1thread=same1["seconds"],
                auc_pkg=auc_pkg, auc_ours=auc_ours, auc_default=auc_dflt)


def big_fit(n_bags: int = 5000, dim: int = 576, seed: int = 1, device=None, n_test: int = 1000,
            num_threads=None):
    X, off, y, _, _ = make_planted_bags(n_bags + n_test, dim, shift=8.0, seed=seed)
    Xtr, otr, ytr = split_bags(X, off, y, np.arange(n_bags))
    Xte, ote, yte = split_bags(X, off, y, np.arange(n_bags, n_bags + n_test))
    del X
    out = fit_and_measure(Xtr, otr, ytr, device=device, num_threads=num_threads)
    m, info = out["model"], out["model"].fit_info_
    print(f"[{n_bags} bags, {out['n_tokens']} tokens, dim {dim}, float32 input "
          f"{Xtr.nbytes / 2**20:.0f} MiB; {m.get_params()}]")
    print(f"  fit wall {out['seconds']:.1f} s, cpu {out['cpu_seconds']:.1f} s "
          f"(stage 1 {info['stage1']['seconds']:.1f} s / {info['stage1']['n_iter']} Newton steps, "
          f"stage 3 {info['stage3']['seconds']:.1f} s / {info['stage3']['n_iter']})  (target < 60 s)")
    print(f"  memory: RSS before {out['rss_before_mb']:.0f} MiB, peak during fit {out['peak_rss_mb']:.0f} MiB"
          f"{'' if out['peak_is_exact'] else ' (lifetime peak)'}, added by the fit "
          f"{out['peak_increment_mb']:.0f} MiB  (target < 2048 MiB)"
          + (f", CUDA peak {out['cuda_peak_mb']:.0f} MiB" if out["cuda_peak_mb"] is not None else ""))
    print(f"  converged: stage 1 {info['stage1']['converged']} (gap {info['stage1']['duality_gap']:.1e}), "
          f"stage 3 {info['stage3']['converged']} (gap {info['stage3']['duality_gap']:.1e}); "
          f"eta_ {m.eta_:.3f}, fallback {m.fallback_used_}")
    print(f"  held-out bag AUROC ({n_test} bags) {bag_auroc(yte, m.decision_function(Xte, ote)):.4f}")
    return out


def real_fit(store_path: str, layer: int, C: float, device=None, cv: bool = True, fits_json: str | None = None,
             against: str | None = None):
    """sAwMIL on every training bag of a store (true_vs_all, entity-disjoint split, seed 0).

    Prints one fit at ``C`` (time, memory, test bag AUROC) and, with ``cv``, the probe's fit with C
    chosen by grouped CV over its default grid (``SAwMILProbe().Cs``, ``cv_folds`` folds + the final fit);
    ``fits_json``: its chosen C and (fold, C) fits written there, ``against``: compared with such a file
    (another checkout's solver, `compare_fits`).
    """
    from probes.base import standardiser
    from probes.samil import SAwMILProbe

    train, y_train, test, y_test = load_real(store_path, layer)
    mean, std = standardiser(train.X)
    out = fit_and_measure((train.X - mean) / std, train.offsets, y_train, C=C, device=device)
    m, info = out["model"], out["model"].fit_info_
    print(f"[{store_path} layer {layer}: {out['n_bags']} training bags, {out['n_tokens']} tokens "
          f"({info['n_distinct']} distinct), C={C}]")
    print(f"  one fit {out['seconds']:.2f} s (target <= 1 s; stage 1 {info['stage1']['seconds']:.2f} s, "
          f"stage 3 {info['stage3']['seconds']:.2f} s), peak RSS during fit {out['peak_rss_mb']:.0f} MiB, "
          f"added by the fit {out['peak_increment_mb']:.0f} MiB; eta_ {m.eta_:.3f}, fallback {m.fallback_used_}; "
          f"test bag AUROC {bag_auroc(y_test, m.decision_function((test.X - mean) / std, test.offsets)):.3f}")
    print(f"  duality gap / objective: stage 1 {info['stage1']['duality_gap'] / info['stage1']['objective']:.1e}, "
          f"stage 3 {info['stage3']['duality_gap'] / info['stage3']['objective']:.1e} (tol {m.tol:.0e})", flush=True)
    if cv:
        probe = SAwMILProbe(accelerator="cpu" if device is None else str(device))
        t0 = time.perf_counter()
        probe.fit(train, y_train)
        seconds = time.perf_counter() - t0
        p = probe.params()
        print(f"  C by {probe.cv_folds}-fold grouped CV over {list(probe.Cs)} + final fit: {seconds:.1f} s; "
              f"chosen C {p['C']:g} (CV AUROC {p['cv_auroc']}); test bag AUROC "
              f"{bag_auroc(y_test, probe.decision_function(test)):.3f}", flush=True)
        fits = dict(C=p["C"], cv_auroc=p["cv_auroc"], fits=probe.cv_fits_)
        if fits_json:
            Path(fits_json).write_text(json.dumps(fits))
        if against:
            compare_fits(json.loads(Path(against).read_text()), fits, probe.tol or 1e-6)
    return out


def fit_pairs(old: list[dict], new: list[dict]) -> list[tuple]:
    """The (fold, C) fits of two C-by-CV runs (`SAwMILProbe.cv_fits_`) side by side, per stage:
    ``(old fit, new fit, stage, |P_new - P_old| / |P_old|, the larger gap / objective of the two)``."""
    by_key = {(r["fold"], r["C"]): r for r in old}
    pairs = []
    for r in new:
        o = by_key[(r["fold"], r["C"])]
        for st in ("stage1", "stage3"):
            P_o, P_n = o[f"{st}_objective"], r[f"{st}_objective"]
            pairs.append((o, r, st, abs(P_n - P_o) / abs(P_o),
                          max(r[f"{st}_duality_gap"] / abs(P_n), o[f"{st}_duality_gap"] / abs(P_o))))
    return pairs


def compare_fits(old: dict, new: dict, tol: float) -> None:
    """Two C-by-CV runs of the same data (``real_fit``'s ``fits_json``: another solver's, ``new`` this
    one's): the chosen C, and per (fold, C) fit and stage the relative difference of the certified
    objectives and both gaps / objective (each <= ``tol``: the two optima agree to the certificate)."""
    pairs = fit_pairs(old["fits"], new["fits"])
    diffs, gaps = [p[3] for p in pairs], [p[4] for p in pairs]
    print(f"  against {len(old['fits'])} fits of another run: chosen C {old['C']:g} -> {new['C']:g} "
          f"({'same' if old['C'] == new['C'] else 'DIFFERENT'}), CV AUROC largest difference "
          f"{max(abs(old['cv_auroc'][c] - new['cv_auroc'][c]) for c in new['cv_auroc']):.1e}; objectives of the "
          f"{len(diffs)} (fold, C, stage) fits: largest relative difference {max(diffs):.1e}, largest gap / "
          f"objective {max(gaps):.1e} (tol {tol:.0e})", flush=True)


def wide_cost(n_bags: int, dim: int, base_dim: int = 576, shift: float = 1.5, seed: int = 2, device=None):
    """What C by grouped CV costs at width ``dim`` on ``n_bags`` planted bags (three statements an entity
    group), from three measurements in this run: the probe's CV fit of one head (its grid and folds, warm
    starts, + the final fit) and one fit at C = 100, both at ``base_dim``, and one fit at C = 100 at ``dim``.
    Estimate at ``dim``: its one fit x (CV / one fit at ``base_dim``), for one head and for a layer job's
    four heads (three one-vs-all and true_vs_false)."""
    from probes.features import Features
    from probes.samil import SAwMILProbe

    def timed(width: int, C):
        X, off, y, _, _ = make_planted_bags(n_bags, width, shift=shift, seed=seed)
        probe = SAwMILProbe(C=C, accelerator="cpu" if device is None else str(device))
        t0 = time.perf_counter()
        probe.fit(Features(torch.from_numpy(X), torch.from_numpy(off), np.arange(n_bags) // 3), y)
        return time.perf_counter() - t0, probe

    cv_base, probe = timed(base_dim, None)
    fit_base, _ = timed(base_dim, 100.0)
    print(f"[{n_bags} planted bags, shift {shift}, {torch.get_num_threads()} threads]")
    print(f"  d = {base_dim}: C by {probe.cv_folds}-fold grouped CV over {list(probe.Cs)} + final fit "
          f"({len(probe.cv_fits_)} sAwMIL fits, chosen C {probe.params()['C']:g}) {cv_base:.0f} s; one fit at C = 100 "
          f"{fit_base:.1f} s; ratio {cv_base / fit_base:.1f}", flush=True)
    fit_wide, _ = timed(dim, 100.0)
    head = fit_wide * cv_base / fit_base
    print(f"  d = {dim}: one fit at C = 100 {fit_wide:.0f} s ({fit_wide / fit_base:.0f}x d = {base_dim}'s)")
    print(f"  estimate at d = {dim}: C by CV of one head ~{head / 60:.0f} min, one layer job (four heads) "
          f"~{4 * head / 3600:.1f} h on this machine", flush=True)


def load_real(store_path: str, layer: int):
    """(train, y_train, test, y_test) Features of a store (true_vs_all, entity-disjoint split, seed 0)."""
    from extract.store import ActivationStore
    from evaluation.tasks import task_targets
    from probes.features import layer_features
    from evaluation.splits import entity_groups, make_split

    store = ActivationStore(store_path)
    table = store.table
    rows, y = task_targets(table["label"].to_numpy(), "true_vs_all")
    split = make_split(table, kind="entity_disjoint", seed=0)
    features = layer_features(store, layer, "bags")
    features.groups = entity_groups(table)
    features = features.subset(rows)
    in_train, in_test = np.flatnonzero(np.isin(rows, split.train)), np.flatnonzero(np.isin(rows, split.test))
    return features.subset(in_train), y[in_train], features.subset(in_test), y[in_test]


def cv_compare(store_path: str, layer: int, device=None, reps: int = 1):
    """The probe's C-by-CV fit (its default grid and folds + the final fit) with stage 3 solved by the
    previous path (``stage3_solver="smoothing"``) and by dual coordinate descent (the default),
    alternating, ``reps`` times each: wall times, the ratio, the chosen C, and per (fold, C) and stage
    the relative difference of the certified objectives and the largest relative gap."""
    from probes.samil import SAwMILProbe

    train, y_train, test, y_test = load_real(store_path, layer)
    acc = "cpu" if device is None else str(device)
    solvers = ("smoothing", "dual_cd")
    times = {k: [] for k in solvers}
    probes = {}
    for _ in range(reps):
        for solver in solvers:
            probe = SAwMILProbe(accelerator=acc, stage3_solver=solver)
            t0 = time.perf_counter()
            probe.fit(train, y_train)
            times[solver].append(time.perf_counter() - t0)
            probes[solver] = probe
            print(f"  stage3_solver={solver}: {times[solver][-1]:.1f} s, C {probe.params()['C']:g}", flush=True)
    old, new = probes["smoothing"], probes["dual_cd"]
    pairs = fit_pairs(old.cv_fits_, new.cv_fits_)
    diffs, gaps = [p[3] for p in pairs], [p[4] for p in pairs]
    for o, r, st, diff, _ in pairs:
        P_o, P_n = o[f"{st}_objective"], r[f"{st}_objective"]
        print(f"    fold {r['fold']} C {r['C']:g} {st}: objective previous {P_o:.10g} dual_cd {P_n:.10g} "
              f"(rel diff {diff:.1e}); gap/objective previous {o[f'{st}_duality_gap'] / abs(P_o):.1e} "
              f"dual_cd {r[f'{st}_duality_gap'] / abs(P_n):.1e}; seconds previous {o['seconds']:.2f} "
              f"dual_cd {r['seconds']:.2f}")
    print(f"[{store_path} layer {layer}: C by {old.cv_folds}-fold grouped CV over {list(old.Cs)} + final fit, "
          f"warm starts]")
    for name, probe in (("previous (stage 3 by smoothing)", old), ("dual_cd (stage 3 by dual coordinate descent)", new)):
        key = probe.stage3_solver
        print(f"  {name}: {min(times[key]):.1f} s (runs {[round(t, 1) for t in times[key]]}), chosen C "
              f"{probe.params()['C']:g}, CV AUROC {probe.params()['cv_auroc']}, test bag AUROC "
              f"{bag_auroc(y_test, probe.decision_function(test)):.4f}")
    print(f"  ratio previous / dual_cd (best of each) {min(times['smoothing']) / min(times['dual_cd']):.2f}x; "
          f"objectives of the {len(diffs)} (fold, C, stage) fits: largest relative difference {max(diffs):.1e}, "
          f"largest gap / objective {max(gaps):.1e}", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="*", default=[250, 500])
    ap.add_argument("--big", type=int, default=5000)
    ap.add_argument("--dim", type=int, default=576)
    ap.add_argument("--skip-package", action="store_true")
    ap.add_argument("--device", default=None)
    ap.add_argument("--store", default=None, help="also fit every training bag of this store")
    ap.add_argument("--layer", type=int, default=16)
    ap.add_argument("--C", type=float, default=100.0)
    ap.add_argument("--skip-cv", action="store_true", help="with --store: no C-by-CV fit")
    ap.add_argument("--cv-compare", type=int, default=0, metavar="REPS",
                    help="with --store: the probe's CV fit, stage 3 by the previous solver vs dual_cd, REPS alternating runs each "
                         "(instead of the one fit and the CV fit)")
    ap.add_argument("--fits-json", default=None, help="with --store: write the CV fit's chosen C and fits here")
    ap.add_argument("--against", default=None,
                    help="with --store: compare the CV fit with another run's --fits-json (e.g. the previous solver's)")
    ap.add_argument("--wide", type=int, default=0, metavar="N_BAGS",
                    help="the cost of C by CV at width --dim on N_BAGS planted bags (see wide_cost)")
    args = ap.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    if not args.skip_package:
        for n in args.sizes:
            compare_with_package(n, args.dim, device=args.device)
    if args.big:
        big_fit(args.big, args.dim, device=args.device)
        if args.device is None or torch.device(args.device).type == "cpu":
            big_fit(args.big, args.dim, device=args.device, num_threads=1)
    if args.store and args.cv_compare:
        cv_compare(args.store, args.layer, device=args.device, reps=args.cv_compare)
    elif args.store:
        real_fit(args.store, args.layer, args.C, device=args.device, cv=not args.skip_cv, fits_json=args.fits_json,
                 against=args.against)
    if args.wide:
        wide_cost(args.wide, args.dim, device=args.device)
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
