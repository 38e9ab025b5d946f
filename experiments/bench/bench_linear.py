"""Benchmark of probes.linear.LinearProbe (grouped k-fold CV over a C grid, then a final fit) against
scikit-learn's LogisticRegressionCV with the same folds, grid and objective, on one layer of a store.

Data as the pipeline's `train_probes` builds it: the layer's last-token statement vectors, the
true_vs_all targets, the entity_disjoint split (config defaults) and subject-entity groups. The folds
are `probes.base.kfold_splits` of the training split with the probe's seed, given to both.

sklearn is fitted on vectors standardised on the whole training split (LogisticRegressionCV cannot
standardise per fold, the probe does), with class_weight="balanced", the probe's C grid, the
class-balanced held-out log-loss as its CV score (the probe's cv_metric="log_loss"), and its default
lbfgs settings (tol 1e-4, max_iter 100: its CV losses differ from the converged ones in the third
decimal) and tol 1e-6, max_iter 1000 (converged like the probe: the same CV losses to ~1e-4). Both run at the same thread count (torch's threads and
every BLAS / OpenMP pool, `threadpoolctl`), one thread and all cores by default, alternating, `--repeats`
times each: prints the median times, their ratio (and the range of the per-repeat ratios), both chosen C,
the test AUROC of both, sklearn's most lbfgs iterations of a fit, and the load average at each start.

Usage:  python -m experiments.bench.bench_linear --store /tmp/real/act/smollm2/city_locations.h5 --layer 16
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

import numpy as np
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LogisticRegressionCV
from sklearn.metrics import log_loss, roc_auc_score
from threadpoolctl import threadpool_limits
import torch

from evaluation.splits import entity_groups, make_split
from evaluation.tasks import task_targets
from extract.store import ActivationStore
from probes.base import balanced_weights, kfold_splits, standardiser
from probes.features import layer_features
from probes.linear import LinearProbe


def load(store_path: str, layer: int, split_seed: int = 0):
    """(features of all task statements, y int64 [M], train positions, test positions)."""
    store = ActivationStore(store_path)
    table = store.table
    rows, y = task_targets(table["label"].to_numpy(), "true_vs_all")
    split = make_split(table, kind="entity_disjoint", seed=split_seed)
    features = layer_features(store, layer, "last", "statement").subset(rows)
    features.groups = entity_groups(table)[rows]
    train, test = (np.flatnonzero(np.isin(rows, getattr(split, p))) for p in ("train", "test"))
    return features, y, train, test


def balanced_log_loss(estimator, X, y) -> float:
    """CV score for LogisticRegressionCV: minus the class-balanced log-loss (the probe's cv_metric)."""
    return -log_loss(y, estimator.predict_proba(X)[:, 1], sample_weight=balanced_weights(y, "balanced"),
                     labels=[0, 1])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", required=True)
    ap.add_argument("--layer", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0, help="fold seed (the probe's seed)")
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--Cs", type=float, nargs="+", default=[0.001, 0.01, 0.1, 1.0, 10.0])
    ap.add_argument("--sk-tol", type=float, nargs="+", default=[1e-4, 1e-6],
                    help="LogisticRegressionCV tol of each sklearn variant (its default, then converged like ours)")
    ap.add_argument("--sk-max-iter", type=int, nargs="+", default=[100, 1000], help="max_iter of each variant")
    ap.add_argument("--accelerator", default="cpu")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 0], help="thread counts to compare at (0: all cores)")
    ap.add_argument("--repeats", type=int, default=3, help="fits of each per thread count (medians printed)")
    args = ap.parse_args(argv)

    features, y, train, test = load(args.store, args.layer)
    tr_feat, te_feat = features.subset(train), features.subset(test)
    folds = kfold_splits(y[train], tr_feat.groups, args.folds, args.seed)
    print(f"layer {args.layer}: {len(train)} training / {len(test)} test statements, d={features.X.shape[1]}, "
          f"{len(folds)} grouped folds x {len(args.Cs)} C values")

    LinearProbe(Cs=args.Cs, cv_folds=args.folds, seed=args.seed, accelerator=args.accelerator).fit(
        tr_feat.subset(np.arange(min(200, len(train)))), y[train][:200])  # warm-up: imports, first Trainer
    mean, std = standardiser(tr_feat.X)
    Z_tr, Z_te = ((tr_feat.X - mean) / std).double().numpy(), ((te_feat.X - mean) / std).double().numpy()

    def ours():
        probe = LinearProbe(Cs=args.Cs, cv_folds=args.folds, seed=args.seed, accelerator=args.accelerator)
        probe.fit(tr_feat, y[train])
        return probe, roc_auc_score(y[test], probe.decision_function(te_feat))

    def theirs(tol, max_iter):
        sk = LogisticRegressionCV(Cs=list(args.Cs), cv=folds, class_weight="balanced", scoring=balanced_log_loss,
                                  tol=tol, max_iter=max_iter)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", (ConvergenceWarning, FutureWarning))
            sk.fit(Z_tr, y[train])
        return sk, roc_auc_score(y[test], sk.decision_function(Z_te))

    variants = {f"sklearn tol={tol:g} max_iter={it}": (tol, it) for tol, it in zip(args.sk_tol, args.sk_max_iter)}
    for threads in args.threads:
        n = os.cpu_count() if threads == 0 else threads
        times, fitted = {"ours": [], **{v: [] for v in variants}}, {}
        with threadpool_limits(limits=n):
            torch.set_num_threads(n)
            for _ in range(args.repeats):
                for name in times:
                    started = time.perf_counter()
                    fitted[name] = ours() if name == "ours" else theirs(*variants[name])
                    times[name].append(time.perf_counter() - started)
        med = {k: statistics.median(v) for k, v in times.items()}
        probe, ours_auroc = fitted["ours"]
        p = probe.params()
        print(f"{n} thread(s), {args.repeats} repeats each, alternating (load average {os.getloadavg()[0]:.1f} after):")
        print(f"  LinearProbe                      {med['ours']:8.3f} s   C={p['C']:<6g} test AUROC {ours_auroc:.5f}   "
              f"cv_loss {p['cv_loss']}")
        for name in variants:
            sk, sk_auroc = fitted[name]
            ratios = [b / a for a, b in zip(times["ours"], times[name])]
            print(f"  {name:<32} {med[name]:8.3f} s   C={float(sk.C_[0]):<6g} test AUROC {sk_auroc:.5f}   "
                  f"cv_loss {(-sk.scores_[1].mean(0)).round(6).tolist()}   max lbfgs iterations {int(sk.n_iter_.max())}")
            print(f"    ratio of medians (sklearn / ours) {med[name] / med['ours']:6.2f}x   (per repeat "
                  f"{min(ratios):.2f}-{max(ratios):.2f}x)   |AUROC difference| {abs(ours_auroc - sk_auroc):.5f}")

if __name__ == "__main__":
    main()
