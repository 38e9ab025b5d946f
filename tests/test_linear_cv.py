"""LinearProbe's batched cross-validation against independent fits of each (fold, C) alone."""
import numpy as np
import pytest
import torch
from scipy.optimize import minimize
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import matthews_corrcoef

from probes.base import balanced_weights, kfold_splits
from probes.features import Features
from probes.linear import LinearProbe

CS = (0.01, 0.1, 1.0, 10.0)


@pytest.fixture(scope="module")
def data():
    """Imbalanced, grouped, badly scaled data with a planted direction (X float32 [300, 12])."""
    rng = np.random.default_rng(0)
    n, d = 300, 12
    X = rng.normal(size=(n, d)) * rng.uniform(0.1, 20.0, size=d) + rng.normal(size=d) * 5
    y = ((X[:, 0] / 10 + X[:, 1] + rng.normal(scale=1.5, size=n)) > 1.0).astype(np.int64)
    groups = np.repeat(np.arange(n // 3), 3)
    return torch.from_numpy(X.astype(np.float32)), y, groups


def _standardise(X_fit: np.ndarray, X: np.ndarray) -> np.ndarray:
    """X standardised with X_fit's column mean and population std, in float64."""
    return (X - X_fit.mean(0)) / X_fit.std(0)


def _alone(X_tr, y_tr, X_te, C):
    """Held-out scores of sklearn's LogisticRegression(C) fitted alone on one fold's standardised,
    class-balanced training part (the probe's objective times C * n)."""
    model = LogisticRegression(C=C, solver="newton-cholesky", tol=1e-12, max_iter=1000)
    model.fit(_standardise(X_tr, X_tr), y_tr, sample_weight=balanced_weights(y_tr, "balanced"))
    return model.decision_function(_standardise(X_tr, X_te))


@pytest.mark.parametrize("cv_metric", ["log_loss", "mcc"])
def test_batched_cv_equals_separate_fits(data, cv_metric):
    X, y, groups = data
    probe = LinearProbe(Cs=CS, cv_folds=4, cv_metric=cv_metric, seed=7, tol=1e-9, accelerator="cpu")
    probe.fit(Features(X, groups=groups), y)
    folds = kfold_splits(y, groups, 4, 7)
    Xn = X.double().numpy()
    loss, mcc = np.zeros((len(folds), len(CS))), np.zeros((len(folds), len(CS)))
    for f, (tr, te) in enumerate(folds):
        s_te = balanced_weights(y[te], "balanced")
        for j, C in enumerate(CS):
            scores = _alone(Xn[tr], y[tr], Xn[te], C)
            np.testing.assert_allclose(probe.cv_scores_[j, te], scores, atol=1e-5)
            loss[f, j] = (s_te * np.logaddexp(0, -(2 * y[te] - 1) * scores)).sum() / s_te.sum()
            mcc[f, j] = matthews_corrcoef(y[te], (scores > 0).astype(int))
    np.testing.assert_allclose(probe.params()["cv_loss"], loss.mean(0), atol=1e-5)
    np.testing.assert_allclose(probe.params()["cv_mcc"], mcc.mean(0), atol=1e-6)
    if cv_metric == "log_loss":
        expected = CS[int(np.argmin(loss.mean(0)))]
    else:
        expected = max(zip(mcc.mean(0).round(12), -loss.mean(0), CS))[2]
    assert probe.params()["C"] == expected


def test_final_fit_matches_sklearn(data):
    X, y, groups = data
    probe = LinearProbe(Cs=CS, cv_folds=4, seed=7, tol=1e-9, accelerator="cpu").fit(Features(X, groups=groups), y)
    C = probe.params()["C"]
    Xn = X.double().numpy()
    model = LogisticRegression(C=C, solver="newton-cholesky", tol=1e-12, max_iter=1000)
    model.fit(_standardise(Xn, Xn), y, sample_weight=balanced_weights(y, "balanced"))
    np.testing.assert_allclose(probe.weight.numpy(), model.coef_[0], atol=1e-4)
    assert abs(float(probe.bias) - model.intercept_[0]) < 1e-4
    fixed = LinearProbe(C=C, tol=1e-9, accelerator="cpu").fit(Features(X), y)  # no CV: the same fit alone
    np.testing.assert_allclose(fixed.weight.numpy(), model.coef_[0], atol=1e-4)


def _hinge_alone(Z: np.ndarray, y: np.ndarray, C: float) -> np.ndarray:
    """(w, b) minimising the documented squared-hinge objective with scipy's L-BFGS-B."""
    n, d = Z.shape
    t, s = 2.0 * y - 1.0, balanced_weights(y, "balanced").astype(np.float64)

    def objective(theta):
        slack = np.maximum(0.0, 1.0 - t * (Z @ theta[:d] + theta[d]))
        g = -2.0 * s * slack * t / n
        value = (s * slack ** 2).sum() / n + theta[:d] @ theta[:d] / (2 * C * n)
        return value, np.append(Z.T @ g + theta[:d] / (C * n), g.sum())

    return minimize(objective, np.zeros(d + 1), jac=True, method="L-BFGS-B",
                    options={"gtol": 1e-12, "ftol": 1e-15, "maxiter": 20000}).x


def test_hinge_cv_and_final_fit(data):
    X, y, groups = data
    probe = LinearProbe(loss="hinge", Cs=CS, cv_folds=4, seed=7, tol=1e-9, accelerator="cpu")
    probe.fit(Features(X, groups=groups), y)
    p = probe.params()
    assert p["C"] in CS and len(p["cv_loss"]) == len(CS) and np.isfinite(probe.cv_scores_[:, np.isfinite(probe.cv_scores_[0])]).all()
    Xn = X.double().numpy()
    theta = _hinge_alone(_standardise(Xn, Xn), y, p["C"])
    np.testing.assert_allclose(probe.weight.numpy(), theta[:-1], atol=1e-4)
    tr, te = kfold_splits(y, groups, 4, 7)[0]
    j = CS.index(10.0)
    theta = _hinge_alone(_standardise(Xn[tr], Xn[tr]), y[tr], 10.0)
    np.testing.assert_allclose(probe.cv_scores_[j, te], _standardise(Xn[tr], Xn[te]) @ theta[:-1] + theta[-1], atol=1e-4)
