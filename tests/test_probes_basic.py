"""Linear, MLP and mean-difference probes on synthetic data with a planted direction."""
from __future__ import annotations


import lightning as L
import numpy as np
import pytest
import torch
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import matthews_corrcoef
from sklearn.preprocessing import StandardScaler

from probes.base import Features
from probes.linear import LinearProbe
from probes.mean_diff import MeanDiffProbe, within_class_ledoit_wolf
from probes.mlp import MLPProbe
from probes.spca import SupervisedPCAProbe



@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny problems: one intra-op thread is much faster than two on a busy 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def planted(N=800, d=64, seed=0, sep=5.0):
    """30 / 70 labels; features = anisotropic Gaussian noise + offset + label * sep along a unit
    direction u (so the label is the sign of the projection on u, up to noise)."""
    rng = np.random.default_rng(seed)
    y = (rng.random(N) < 0.3).astype(np.int64)
    u = rng.standard_normal(d)
    u /= np.linalg.norm(u)
    X = rng.standard_normal((N, d)) * rng.uniform(0.5, 2.0, d) + 3.0
    X += np.outer(y - 0.3, u) * sep
    groups = rng.integers(0, N // 4, N)
    return X.astype(np.float32), y, groups


@pytest.fixture(scope="module")
def data():
    X, y, groups = planted()
    tr, te = np.arange(600), np.arange(600, 800)
    train = Features(torch.from_numpy(X[tr]), None, groups[tr])
    test = Features(torch.from_numpy(X[te]))
    return X, y, tr, te, train, test


PROBES = {
    "linear": lambda: LinearProbe(cv_folds=3),
    "linear_hinge": lambda: LinearProbe(loss="hinge", cv_folds=3, cv_metric="mcc", Cs=(0.01, 0.1, 1.0)),
    "mlp": lambda: MLPProbe(max_epochs=40, patience=5),
    "mean_diff": lambda: MeanDiffProbe(covariance="none"),
    "mean_diff_shrinkage": lambda: MeanDiffProbe(covariance="shrinkage"),
    "spca": lambda: SupervisedPCAProbe(grid=(1, 10, 50)),   # (ttpd and ccs need polarity: tests/test_baselines.py)
}


@pytest.mark.parametrize("name", list(PROBES))
def test_planted_direction_found(data, name):
    X, y, tr, te, train, test = data
    L.seed_everything(0, verbose=False)
    probe = PROBES[name]().fit(train, y[tr])
    score = probe.decision_function(test)
    assert score.shape == (len(te),) and np.isfinite(score).all()
    assert matthews_corrcoef(y[te], (score > 0).astype(int)) >= 0.9
    params = probe.params()
    assert params["representation"] == "last"
    if name.startswith("linear"):  # C chosen by grouped CV from the grid, CV curves recorded
        assert params["C"] in params["Cs"] and len(params["cv_mcc"]) == len(params["Cs"]) == len(params["cv_loss"])


def test_linear_agrees_with_sklearn(data):
    X, y, tr, te, train, test = data
    C = 0.1
    probe = LinearProbe(C=C).fit(train, y[tr])
    scaler = StandardScaler().fit(X[tr])
    ref = LogisticRegression(C=C, class_weight="balanced", max_iter=10_000, tol=1e-8)
    ref.fit(scaler.transform(X[tr]), y[tr])
    ours, theirs = probe.decision_function(test), ref.decision_function(scaler.transform(X[te]))
    assert np.mean((ours > 0) == (theirs > 0)) >= 0.98
    assert np.corrcoef(ours, theirs)[0, 1] > 0.999
    # the raw-space direction reproduces the scores
    np.testing.assert_allclose(X[te] @ probe.coef_ + probe.intercept_, ours, rtol=1e-4, atol=1e-3)
    assert probe.params()["C"] == C and "cv_mcc" not in probe.params()


def test_mean_diff_direction_by_hand(data):
    X, y, tr, te, train, test = data
    probe = MeanDiffProbe(covariance="none").fit(train, y[tr])
    Xtr = X[tr].astype(np.float64)
    mu1, mu0 = Xtr[y[tr] == 1].mean(0), Xtr[y[tr] == 0].mean(0)
    w = mu1 - mu0
    b = -0.5 * (w @ mu1 + w @ mu0)
    np.testing.assert_allclose(probe.coef_, w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(probe.intercept_, b, rtol=1e-5)
    np.testing.assert_allclose(probe.decision_function(test), X[te].astype(np.float64) @ w + b, rtol=1e-4, atol=1e-4)


def test_shrinkage_uses_within_class_covariance(data):
    from sklearn.covariance import ledoit_wolf

    X, y, tr, te, train, test = data
    Xtr, ytr = X[tr].astype(np.float64), y[tr]
    Sigma, a = within_class_ledoit_wolf(torch.from_numpy(Xtr), ytr)
    # matches sklearn's Ledoit-Wolf on the data centred per class
    Z = Xtr - np.stack([Xtr[ytr == c].mean(0) for c in (0, 1)])[ytr]
    ref, ref_a = ledoit_wolf(Z, assume_centered=True)
    assert a == pytest.approx(ref_a, rel=1e-8) and 0 < a < 1
    np.testing.assert_allclose(Sigma.numpy(), ref, rtol=1e-8, atol=1e-10)
    # a large constant offset added to one class moves its mean only: the covariance is unchanged
    shifted = Xtr + 100.0 * ytr[:, None]
    Sigma2, a2 = within_class_ledoit_wolf(torch.from_numpy(shifted), ytr)
    np.testing.assert_allclose(Sigma2.numpy(), Sigma.numpy(), rtol=1e-6, atol=1e-8)
    assert a2 == pytest.approx(a, rel=1e-6)
    # ... whereas a globally centred covariance would absorb the offset
    pooled, _ = ledoit_wolf(shifted - shifted.mean(0), assume_centered=True)
    assert np.abs(pooled - ref).max() > 100
    # the probe's direction is Sigma^-1 (mu1 - mu0) with that Sigma, and its bias the midpoint
    for Xfit in (Xtr, shifted):
        probe = MeanDiffProbe(covariance="shrinkage").fit(Features(torch.from_numpy(Xfit.astype(np.float32))), ytr)
        assert probe.params()["shrinkage"] == pytest.approx(a, rel=1e-4)
        mu1, mu0 = Xfit[ytr == 1].mean(0), Xfit[ytr == 0].mean(0)
        w = np.linalg.solve(Sigma.numpy(), mu1 - mu0)
        np.testing.assert_allclose(probe.coef_, w, rtol=1e-3, atol=1e-4 * np.abs(w).max())
        assert probe.intercept_ == pytest.approx(-0.5 * (w @ mu1 + w @ mu0), rel=1e-3)


@pytest.mark.parametrize("make", [lambda: LinearProbe(cv_folds=3),
                                  lambda: MLPProbe(max_epochs=6, patience=3)], ids=["linear", "mlp"])
def test_deterministic_for_a_seed(data, make):
    X, y, tr, te, train, test = data
    runs = []
    for seed in (3, 3) if isinstance(make(), LinearProbe) else (3, 3, 4):
        L.seed_everything(seed, verbose=False)
        probe = make().fit(train, y[tr])
        runs.append((probe.decision_function(test), probe.params()))
    np.testing.assert_array_equal(runs[0][0], runs[1][0])
    assert runs[0][1] == runs[1][1]
    if isinstance(probe, MLPProbe):  # another seed: another init / batch order
        assert not np.array_equal(runs[0][0], runs[2][0])


def test_mlp_own_seed_leaves_global_rng(data):
    X, y, tr, te, train, test = data
    torch.manual_seed(0)
    before = torch.get_rng_state()
    a = MLPProbe(max_epochs=3, seed=7).fit(train, y[tr]).decision_function(test)
    assert torch.equal(torch.get_rng_state(), before)
    b = MLPProbe(max_epochs=3, seed=7).fit(train, y[tr]).decision_function(test)
    np.testing.assert_array_equal(a, b)


def test_mean_representation_recorded_and_bags_reduced(data):
    X, y, tr, te, train, test = data
    rng = np.random.default_rng(1)
    lengths = torch.from_numpy(rng.integers(1, 5, len(te)))
    offsets = torch.zeros(len(te) + 1, dtype=torch.long)
    offsets[1:] = torch.cumsum(lengths, 0)
    tokens = torch.from_numpy(rng.standard_normal((int(offsets[-1]), X.shape[1])).astype(np.float32))
    means = torch.stack([tokens[offsets[i]:offsets[i + 1]].mean(0) for i in range(len(te))])
    lasts = tokens[offsets[1:] - 1]
    bags = Features(tokens, offsets)
    for make in (lambda r: LinearProbe(C=1.0, representation=r), lambda r: MLPProbe(max_epochs=2, representation=r),
                 lambda r: MeanDiffProbe(representation=r)):
        L.seed_everything(0, verbose=False)
        probe = make("mean").fit(train, y[tr])
        assert probe.representation == "mean" and probe.params()["representation"] == "mean"
        np.testing.assert_allclose(probe.decision_function(bags), probe.decision_function(Features(means)),
                                   rtol=1e-5, atol=1e-5)
        assert make("last").representation == "last"
    last_probe = MeanDiffProbe(representation="last").fit(train, y[tr])
    np.testing.assert_allclose(last_probe.decision_function(bags), last_probe.decision_function(Features(lasts)), rtol=1e-6)
    with pytest.raises(ValueError):
        LinearProbe(representation="bags")


def test_hydra_configs_instantiate():
    from toolkit.config import compose_config
    from probes.pipeline import make_probe
    from probes.ccs import CCSProbe
    from probes.samil import SAwMILProbe
    from probes.ttpd import TTPDProbe

    expected = {"linear": LinearProbe, "mlp": MLPProbe, "mean_diff": MeanDiffProbe, "samil": SAwMILProbe,
                "sawmil": SAwMILProbe, "ttpd": TTPDProbe, "spca": SupervisedPCAProbe, "ccs": CCSProbe}
    for name, cls in expected.items():
        probe = make_probe(compose_config("train_probe", f"probe={name}"))
        assert type(probe) is cls and probe.representation == ("bags" if cls is SAwMILProbe else "last")
    linear = make_probe(compose_config("train_probe", "probe=linear", "probe.representation=mean", "probe.C=0.5"))
    assert linear.representation == "mean" and linear.C == 0.5 and linear.Cs == (0.001, 0.01, 0.1, 1.0, 10.0)


def test_state_dict_round_trip(data):
    X, y, tr, te, train, test = data
    L.seed_everything(0, verbose=False)
    for make in (lambda: LinearProbe(C=1.0), lambda: MLPProbe(max_epochs=2, depth=2, hidden=32),
                 lambda: MeanDiffProbe(), lambda: SupervisedPCAProbe(grid=(1, 10))):
        fitted = make().fit(train, y[tr])
        fresh = make()
        fresh.load_state_dict(fitted.state_dict())
        np.testing.assert_array_equal(fresh.decision_function(test), fitted.decision_function(test))
        assert fresh.params() == fitted.params()


def test_stratified_group_folds_equal_sklearn():
    """Our grouped stratified folds are scikit-learn's StratifiedGroupKFold(shuffle=True) folds,
    index for index, on random labels (2-3 classes), group sizes, fold counts and seeds."""
    import warnings

    from sklearn.model_selection import StratifiedGroupKFold

    from probes.base import stratified_group_folds

    rng = np.random.default_rng(0)
    checked = 0
    for _ in range(200):
        n, n_classes = int(rng.integers(20, 500)), int(rng.integers(2, 4))
        y = rng.integers(0, n_classes, n)
        groups = rng.integers(0, int(rng.integers(6, max(7, n // 2))), n) * 3 + 7
        k, seed = int(rng.integers(2, 7)), int(rng.integers(0, 1000))
        if len(np.unique(groups)) < k or np.bincount(y).min() < k:
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            expected = list(StratifiedGroupKFold(n_splits=k, shuffle=True, random_state=seed).split(
                np.zeros(n), y, groups))
        ours = stratified_group_folds(y, groups, k, seed)
        assert len(ours) == k
        for (tr, te), (tr_ref, te_ref) in zip(ours, expected):
            np.testing.assert_array_equal(tr, tr_ref)
            np.testing.assert_array_equal(te, te_ref)
        checked += 1
    assert checked > 100


def test_standardiser_equals_float64_torch():
    """The compiled CPU standardiser gives the float64 torch computation's float32 mean and std, bit for bit
    (offset, wide-ranging and constant columns; float32 and float64 input; a strided view)."""
    from probes.base import standardiser

    g = torch.Generator().manual_seed(0)
    X = torch.randn(3001, 40, generator=g) * torch.logspace(-3, 3, 40) + torch.linspace(-50, 50, 40)
    X[:, 7] = 2.5                                   # constant: std floored to 1
    for x in (X, X.double(), X[::2, ::3]):
        xd = x.double()
        std = xd.std(0, unbiased=False)
        std = torch.where(std > 1e-8 * max(float(std.max()), 1.0), std, torch.ones_like(std))
        mean, got_std = standardiser(x)
        assert mean.dtype == got_std.dtype == torch.float32
        assert torch.equal(mean, xd.mean(0).float()) and torch.equal(got_std, std.float())
    assert float(standardiser(X)[1][7]) == 1.0
