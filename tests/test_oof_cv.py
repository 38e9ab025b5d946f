"""calibration=out_of_fold_cv (probes.fitting.HeadBank share_folds): a probe choosing C by CV runs its CV
on the calibration folds, and its fold fits at the chosen C give the out-of-fold scores, so a head costs
one `fit` instead of 1 + n_folds; probes without such a choice refit as before."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from probes.base import Probe
from probes.features import Features
from probes.fitting import HeadBank
from probes.linear import LinearProbe
from probes.mlp import MLPProbe
from probes.samil import SAwMILProbe, make_planted_bags
from probes.pipeline import train_probes
from tests.helpers import make_synthetic_store, run_cfg


def vectors(n: int = 360, d: int = 12, seed: int = 0) -> tuple[Features, np.ndarray]:
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 3, n)
    X = rng.standard_normal((n, d)).astype(np.float32)
    X[:, 0] += labels.astype(np.float32)            # a weak signal: held-out scores differ from in-sample ones
    return Features(torch.from_numpy(X), None, np.arange(n) // 3), labels


def bags(n: int = 150, seed: int = 0) -> tuple[Features, np.ndarray]:
    X, offsets, y, _ = make_planted_bags(n, dim=8, mean_len=6, shift=1.5, seed=seed)[:4]
    return Features(torch.as_tensor(X), torch.as_tensor(offsets), np.arange(n) // 2), np.asarray(y)


def counting(probe: Probe, monkeypatch) -> list[bool]:
    """The class's fit wrapped to record each call (True: given folds); HeadBank's copies share the class."""
    calls = []
    original = type(probe).fit

    def fit(self, *args, **kwargs):
        calls.append(kwargs.get("folds") is not None)
        return original(self, *args, **kwargs)
    monkeypatch.setattr(type(probe), "fit", fit)
    return calls


@pytest.mark.parametrize("make,cls,options", [
    (vectors, LinearProbe, dict(Cs=(0.01, 1.0), accelerator="cpu", seed=0)),
    (bags, SAwMILProbe, dict(Cs=(1.0, 100.0), accelerator="cpu")),
])
def test_shared_folds_fit_each_head_once_and_score_held_rows_by_the_fold_fits(make, cls, options, monkeypatch):
    features, labels = make()
    train = np.arange(len(features))[: int(0.8 * len(features))]
    calls = counting(cls(**options), monkeypatch)
    shared = HeadBank(cls(**options), features, labels, train, 3, seed=0, share_folds=True)
    rows, oof = shared.out_of_fold([1])
    assert calls == [True]                        # one fit, with the bank's folds, for the head
    head = shared.head(1)
    C = head.params()["C"]
    for f, (fit, held) in enumerate(shared.folds):   # each held part: its fold's fit at the chosen C
        target = (labels[train[fit]] == 1).astype(np.int64)
        alone = cls(**options, C=C).fit(features.subset(train[fit]), target)
        start = sum(len(h) for _, h in shared.folds[:f])
        expected = alone.decision_function(features.subset(train[held]))
        np.testing.assert_allclose(oof[start:start + len(held), 0], expected, rtol=1e-5, atol=1e-5)
    before = len(calls)
    nested = HeadBank(cls(**options), features, labels, train, 3, seed=0)
    nested_rows, _ = nested.out_of_fold([1])
    np.testing.assert_array_equal(rows, nested_rows)
    assert calls[before:] == [False] * len(nested.folds)      # nested: one copy per fold, each with its own CV


def test_a_probe_without_cv_refits_each_fold_and_gives_the_nested_scores():
    features, labels = vectors()
    train = np.arange(300)
    options = dict(hidden=8, max_epochs=3, accelerator="cpu", seed=0)
    shared = HeadBank(MLPProbe(**options), features, labels, train, 3, seed=0, share_folds=True).out_of_fold([0, 1, 2])
    nested = HeadBank(MLPProbe(**options), features, labels, train, 3, seed=0).out_of_fold([0, 1, 2])
    np.testing.assert_array_equal(shared[0], nested[0])
    np.testing.assert_array_equal(shared[1], nested[1])


def test_train_probe_default_is_out_of_fold_cv_and_the_nested_cells_have_their_own_method(tmp_path):
    make_synthetic_store(tmp_path / "activations", n_real=300, n_neither=150)
    for calibration, method in (("out_of_fold_cv", "linear"), ("out_of_fold", "linear+out_of_fold")):
        paths = train_probes(run_cfg(tmp_path, "probe=linear", "layer=[1]", *(
            [f"calibration={calibration}"] if calibration != "out_of_fold_cv" else []), f"results_dir={tmp_path / 'r'}"))
        cell = json.loads(paths[0].read_text())
        assert cell["method"]["name"] == method and method in paths[0].parts
        assert cell["calibration"]["kind"] == calibration and cell["calibration"]["n_folds"] == 3


def test_samil_heads_of_a_bank_share_their_statements_distinct_tokens(monkeypatch):
    """A bank's one-vs-all samil heads fit the same statements (its folds, then its training rows): their
    standardised distinct tokens are computed once per set of statements (Features.derived), and each
    head equals the same probe fitted on its own (bit for bit)."""
    import probes.samil.probe as samil_probe

    features, labels = bags()
    labels = labels + np.arange(len(labels)) % 2          # three classes: 0, 1, 2
    train = np.arange(len(features))[: int(0.8 * len(features))]
    calls = []
    original = samil_probe.distinct_tokens
    monkeypatch.setattr(samil_probe, "distinct_tokens", lambda X, device=None: calls.append(len(X)) or original(X, device))
    options = dict(Cs=(1.0, 100.0), C_limits=None, accelerator="cpu")   # the grid as given: one pass of fits
    bank = HeadBank(SAwMILProbe(**options), features, labels, train, 3, seed=0, share_folds=True)
    heads = [bank.head(c) for c in (0, 1, 2)]
    assert len(calls) == len(bank.folds) + 1                 # not once per head
    assert len({h.mean.data_ptr() for h in heads}) == len({h.std.data_ptr() for h in heads}) == 3   # own buffers
    for c, head in enumerate(heads):
        alone = SAwMILProbe(**options).fit(features.subset(train), (labels[train] == c).astype(np.int64),
                                           folds=bank.folds)
        assert torch.equal(alone.coef, head.coef) and float(alone.intercept) == float(head.intercept)
    assert len(calls) == (len(bank.folds) + 1) * (1 + 3)   # each lone fit (no shared memo) computes its own
