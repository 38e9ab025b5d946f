"""The interface every probe shares, and the helpers the probes use.

A probe is a LightningModule and a scikit-learn binary classifier on arrays:

    fit(X, y, folds=None) -> self       X: statement vectors [n, d] (numpy / torch), token bags
                                        `(tokens [T, d], offsets [n+1])` or a list of [n_i, d] bags, or
                                        Features; y [n]: two classes, classes_[1] the positive one
    decision_function(X) -> float [n]   higher = more of classes_[1]
    predict_proba(X) -> float [n, 2]    sigmoid of the decision (uncalibrated: see probes.artifacts)
    predict(X) -> classes_ [n]          classes_[1] where the decision is > 0
    score(X, y) -> float                MCC of predict(X) (sklearn's matthews_corrcoef)
    params() -> dict                    chosen hyperparameters (JSON-serialisable)

Constructor arguments are stored as given (a grid `Cs` as a tuple; get_params / set_params /
clone), checked by `_check_params` at construction and again at fit. Probes are binary heads (tag
multi_class=False; y with more classes is refused): `sklearn.multiclass.OneVsRestClassifier(probe)`
fits one head per class, as the toolkit's multiclass tasks do. Subclasses implement
`_fit(train: Features, y: int [n] in {0, 1}, folds)` and `_decision(data: Features) -> float [n]`.

Calibration, conformal abstention and metrics are computed from the scores by shared code
(evaluation/, driven by probes/pipeline.py), never inside a probe. Probes trained by gradient descent run a
`lightning.Trainer` (probes.trainer) inside `fit`; `accelerator` ("auto", "cpu", "gpu") chooses the device.

The Python API's inputs (arrays from any tool) are checked here, at its edge (`as_features`,
`check_rows`, `check_class_labels`): one ProbeError naming the argument, never a torch traceback.
"""
from __future__ import annotations

import math

import lightning as L
import numpy as np
import torch
from numba import njit
from scipy.special import expit
from sklearn.base import BaseEstimator, ClassifierMixin
from sklearn.metrics import matthews_corrcoef
from sklearn.model_selection import StratifiedKFold
from sklearn.utils.multiclass import check_classification_targets, type_of_target
from sklearn.utils.validation import check_array, check_is_fitted, column_or_1d

from toolkit.errors import ToolkitError
from probes.features import TOKEN_KINDS, Features


class ProbeError(ToolkitError):
    """A bad probe option or training data a probe cannot be fitted on."""


def check_choice(option: str, value, choices) -> str:
    """`value` if it is one of `choices`, else a one-line ProbeError naming the option."""
    if value not in choices:
        names = [repr(c) for c in choices]
        raise ProbeError(f"{option}={value!r}: use {', '.join(names[:-1])} or {names[-1]}" if len(names) > 1
                         else f"{option}={value!r}: use {names[0]}")
    return value


def check_positive(option: str, value, integer: bool = False, allow_zero: bool = False):
    """`value` if it is a finite number > 0 (>= 0 with allow_zero; a whole number with integer), else a
    one-line ProbeError naming the option."""
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value) \
            or not (value >= 0 if allow_zero else value > 0):
        what = "a whole number" if integer else "a finite number"
        raise ProbeError(f"{option}={value!r}: use {what} {'>= 0' if allow_zero else '> 0'}")
    return value


class Probe(ClassifierMixin, BaseEstimator, L.LightningModule):
    """Base class (see the module docstring). `representation` and `tokens` say which features the
    pipeline loads; `state_dict()` carries the fitted tensors and `params()`, and a freshly built probe
    of the same settings loads it (a loaded head is fitted, classes_ [0, 1])."""

    representation = "last"  # "last" | "mean" | "bags": which features the pipeline loads
    tokens = "statement"     # "statement" | "all": which token kinds those features use
    width_buffer = "mean"    # the [d] buffer whose length is the fitted width d (empty before fit)
    representations = ("last", "mean")   # the representations a probe class reads
    supported_tasks: tuple[str, ...] | None = None   # the tasks whose heads it can fit (None: every task)

    def _check_params(self) -> None:
        """One-line ProbeError for a bad constructor argument (at construction, and at fit after set_params)."""
        check_choice("representation", self.representation, self.representations)
        check_choice("tokens", self.tokens, tuple(TOKEN_KINDS))

    def fit(self, X, y, folds: list | None = None) -> "Probe":
        """Fit on X with labels y [n] (two classes). `folds`: grouped folds [(fit positions, held
        positions)] of X for a probe that chooses a hyperparameter by cross-validation, instead of its
        own; it then sets `held_out_scores_` float [n] (NaN outside the held parts): each held part
        scored by its fold's fit at the chosen value. Other probes ignore `folds`."""
        self._check_params()
        data = self._features(X)
        return self._fit(data, self._binary_target(y, len(data)), folds)

    def _fit(self, train: Features, y: np.ndarray, folds: list | None) -> "Probe":
        raise NotImplementedError

    def _decision(self, data: Features) -> np.ndarray:
        raise NotImplementedError

    def decision_function(self, X) -> np.ndarray:
        """float64 [n]: higher = more of classes_[1]."""
        check_is_fitted(self)
        return self._decision(self._features(X, self.n_features_in_))

    def predict_proba(self, X) -> np.ndarray:
        """float64 [n, 2]: sigmoid of the decision, columns classes_ (a logistic / MLP head's own
        probability; a monotone map of mean_diff, hinge and sAwMIL scores; FittedProbe calibrates)."""
        p = expit(self.decision_function(X))
        return np.stack([1.0 - p, p], axis=1)

    def predict(self, X) -> np.ndarray:
        """[n]: classes_[1] where the decision is > 0, else classes_[0] (never an abstention)."""
        positive = self.decision_function(X) > 0
        return self.classes_[positive.astype(np.int64)]

    def score(self, X, y, sample_weight=None) -> float:
        """MCC of predict(X) against y (sklearn's matthews_corrcoef)."""
        return float(matthews_corrcoef(y, self.predict(X), sample_weight=sample_weight))

    def _features(self, X, width: int | None = None) -> Features:
        """X as Features (arrays checked by sklearn's check_array, then `as_features`), refused in one
        ProbeError if a bag probe gets vectors or if X is not `width` wide."""
        if not isinstance(X, (Features, tuple)) and not is_bag_list(X):
            X = check_array(X.detach().cpu().numpy() if isinstance(X, torch.Tensor) else X,
                            dtype=(np.float64, np.float32))
        data = X if isinstance(X, Features) else as_features(X)
        if self.representation == "bags" and not data.is_bags:
            raise ProbeError("X: this probe reads token bags: give (tokens [T, d], offsets [n+1]) or a list of "
                             "[n_i, d] bags")
        if width is not None and data.X.shape[1] != width:
            raise ProbeError(f"X has {data.X.shape[1]} features, but {type(self).__name__} is expecting {width} "
                             "features as input")
        return data

    def _binary_target(self, y, n: int) -> np.ndarray:
        """int64 [n] targets: 1 for classes_[1] (sets classes_, the two sorted labels of y)."""
        labels = column_or_1d(y.detach().cpu().numpy() if isinstance(y, torch.Tensor) else y, warn=True)
        if len(labels) != n:
            raise ProbeError(f"{len(labels)} labels for {n} statements")
        check_classification_targets(labels)
        kind = type_of_target(labels, input_name="y")
        if kind != "binary":
            raise ProbeError(f"Only binary classification is supported. The type of the target is {kind}: a probe "
                             "is one binary head; OneVsRestClassifier(probe) fits one per class")
        classes, target = np.unique(labels, return_inverse=True)
        if len(classes) < 2:
            raise ProbeError(f"y holds one class ({classes[0]!r}): both classes must be present in the training split")
        self.classes_ = classes
        return target.astype(np.int64)

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.classifier_tags.multi_class = False
        return tags

    def __sklearn_is_fitted__(self) -> bool:
        return self._width() is not None

    def params(self) -> dict:
        return dict(getattr(self, "_params", {}))

    def _width(self) -> int | None:
        """The length of the [d] buffer `width_buffer` names, None while it is empty (not fitted)."""
        tensor = getattr(self, self.width_buffer)
        return int(tensor.numel()) if tensor.numel() > 0 else None

    @property
    def n_features_in_(self) -> int:
        """d, the width of the vectors a fitted probe reads: the length of its fitted standardiser
        (`mean`), direction or coefficients; an AttributeError before fit."""
        width = self._width()
        if width is None:
            raise AttributeError(f"{type(self).__name__} is not fitted: it has no n_features_in_")
        return width

    def get_extra_state(self):
        return {"params": self.params()}

    def set_extra_state(self, state) -> None:
        self._params = dict(state.get("params", {}))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        resize_placeholders(self, state_dict, prefix)
        self.classes_ = np.arange(2)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def resize_placeholders(module: torch.nn.Module, state_dict: dict, prefix: str) -> None:
    """Before `load_state_dict`: give the module's own unfitted (empty) parameters and buffers the
    shapes stored in `state_dict`, so a fresh probe can load a fitted one's state."""
    for name, tensor in list(module._parameters.items()) + list(module._buffers.items()):
        stored = state_dict.get(prefix + name)
        if tensor is None or stored is None or stored.shape == tensor.shape or tensor.numel() != 0:
            continue
        fresh = torch.zeros(stored.shape, dtype=tensor.dtype, device=tensor.device)
        if name in module._parameters:
            module._parameters[name] = torch.nn.Parameter(fresh, requires_grad=tensor.requires_grad)
        else:
            module._buffers[name] = fresh


# ----------------------------------------------------------------------------------------------
# helpers shared by the probes
# ----------------------------------------------------------------------------------------------
_EPS = 1e-8


def balanced_weights(y: np.ndarray, class_weight: str | None) -> np.ndarray:
    """float32 [N] sample weights: n / (2 n_c) per class for "balanced" (sklearn's rule), else ones."""
    y = np.asarray(y)
    if class_weight is None or class_weight == "none":
        return np.ones(len(y), dtype=np.float32)
    check_choice("class_weight", class_weight, ("balanced", None))
    counts = np.bincount(y, minlength=2).astype(np.float64)
    w = len(y) / (2.0 * np.maximum(counts, 1.0))
    return w[y].astype(np.float32)


def draw_seed(seed: int | None) -> int:
    """`seed` itself, or a seed drawn from torch's global generator (set by `seed_everything`)."""
    if seed is not None:
        return int(seed)
    return int(torch.randint(0, 2**31 - 1, (1,)).item())


def stratified_group_folds(y: np.ndarray, groups: np.ndarray, n_splits: int, seed: int):
    """The folds of scikit-learn's ``StratifiedGroupKFold(n_splits, shuffle=True, random_state=seed)``
    (1.9), identical, ~10x faster: each candidate fold of a group is scored at once (the probes call it
    for every fit).  Groups, shuffled by ``RandomState(seed)``, are taken in decreasing order of the std
    of their class counts and each goes to the fold that minimises the mean over classes of the std
    over folds of the class shares (ties, up to ``isclose``: the fold with fewest statements).
    y int [n], groups [n] -> [(train_idx, test_idx)] * n_splits."""
    _, y_inv, y_cnt = np.unique(y, return_inverse=True, return_counts=True)
    _, g_inv = np.unique(groups, return_inverse=True)
    n_groups = int(g_inv.max()) + 1
    counts = np.zeros((n_groups, len(y_cnt)))
    np.add.at(counts, (g_inv, y_inv), 1)
    perm = np.arange(n_groups)
    np.random.RandomState(seed).shuffle(perm)
    counts = counts[perm]
    inv_perm = np.empty_like(perm)
    inv_perm[perm] = np.arange(n_groups)
    g_inv = inv_perm[g_inv]
    fold_counts = np.zeros((n_splits, len(y_cnt)))
    fold_of = np.empty(n_groups, dtype=np.int64)
    eye = np.eye(n_splits)[:, :, None]
    for g in np.argsort(-np.std(counts, axis=1), kind="stable"):
        candidates = fold_counts[None] + eye * counts[g]                      # [k, k, classes]
        scores = np.std(candidates / y_cnt.reshape(1, 1, -1), axis=1).mean(1)  # [k]
        sizes = fold_counts.sum(1)
        best, best_score, best_size = 0, np.inf, np.inf
        for i in range(n_splits):
            score = scores[i]
            if score < best_score or (abs(score - best_score) <= 1e-8 + 1e-5 * abs(best_score)
                                      and sizes[i] < best_size):
                best, best_score, best_size = i, score, sizes[i]
        fold_counts[best] += counts[g]
        fold_of[g] = best
    row_fold = fold_of[g_inv]
    return [(np.flatnonzero(row_fold != i), np.flatnonzero(row_fold == i)) for i in range(n_splits)]


def kfold_splits(y: np.ndarray, groups: np.ndarray | None, n_splits: int, seed: int):
    """(train_idx, test_idx) pairs: class-stratified k-fold, grouped (no group in two folds) when
    `groups` is given. Fewer folds when there are too few groups / minority-class members;
    an empty list when fewer than 2 folds are possible."""
    y = np.asarray(y)
    n_min = int(np.bincount(y, minlength=2).min())
    if groups is not None:
        n_groups = len(np.unique(groups))
        k = min(n_splits, n_groups, n_min)
        if k < 2:
            return []
        folds = stratified_group_folds(y, groups, k, seed)
    else:
        k = min(n_splits, n_min)
        if k < 2:
            return []
        folds = list(StratifiedKFold(n_splits=k, shuffle=True, random_state=seed).split(np.zeros(len(y)), y))
    # a fold whose training part misses a class cannot be fitted
    return [(tr, te) for tr, te in folds if len(np.unique(y[tr])) == len(np.unique(y)) and len(te) > 0]


def holdout_split(y: np.ndarray, groups: np.ndarray | None, fraction: float, seed: int):
    """(fit_idx, val_idx): about `fraction` of the statements held out, class-stratified, and grouped
    (whole groups held out) when `groups` is given."""
    n_splits = max(2, int(round(1.0 / fraction)))
    folds = kfold_splits(y, groups, n_splits, seed)
    if not folds:  # too few groups: hold out statements
        folds = kfold_splits(y, None, n_splits, seed)
    if not folds:
        raise ProbeError("too few statements of the minority class for a held-out split")
    return folds[0]


def resolve_device(accelerator: str) -> torch.device:
    """The device a closed-form probe computes on: "auto" -> cuda when available, else cpu."""
    acc = str(accelerator).lower()
    if acc == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if acc in ("gpu", "cuda"):
        return torch.device("cuda")
    return torch.device(acc)


@njit(cache=True)
def _column_moments(X):  # pragma: no cover (compiled)
    """Column mean and population variance of ``X [n, d]``, two passes reading each row once, in float64."""
    n, d = X.shape
    mean, var = np.zeros(d), np.zeros(d)
    for i in range(n):
        for j in range(d):
            mean[j] += X[i, j]
    mean /= max(n, 1)
    for i in range(n):
        for j in range(d):
            dev = X[i, j] - mean[j]
            var[j] += dev * dev
    return mean, var / max(n, 1)


def standardiser(X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Column mean and (population) std of X [n, d], accumulated in float64, std floored so constant
    columns divide by 1; float32 [d] each. On the CPU a compiled pass over X's own storage (no float64 copy
    of X), elsewhere torch in float64."""
    if X.device.type == "cpu" and len(X):
        mean, var = (torch.from_numpy(v) for v in _column_moments(np.ascontiguousarray(X.numpy())))
        std = var.sqrt()
    else:
        Xd = X.double()
        mean, std = Xd.mean(0), Xd.std(0, unbiased=False)
    std = torch.where(std > _EPS * max(float(std.max()), 1.0), std, torch.ones_like(std))
    return mean.float(), std.float()


# ----------------------------------------------------------------------------------------------
# inputs of the Python API (fit_probe, FittedProbe), checked at its edge: one ProbeError naming the
# argument and the fix, never a failure deep inside torch
# ----------------------------------------------------------------------------------------------
def is_bag_list(X) -> bool:
    """Whether X is a non-empty list of token bags, each an array [n_i, d]."""
    return isinstance(X, list) and len(X) > 0 and all(np.ndim(bag) == 2 for bag in X)


def as_features(X, what: str = "X") -> Features:
    """Features from statement vectors [n, d] (numpy or torch), `(tokens [T, d], offsets [n+1])` bags,
    a list of bags [n_i, d], or Features, checked at the API's edge (one ProbeError naming `what` and the
    fix): two dimensions, finite numbers only, offsets that cut the tokens into n bags."""
    if is_bag_list(X):
        bags = [_float_array(bag, f"{what}'s bag {i}") for i, bag in enumerate(X)]
        X = (np.concatenate(bags), np.cumsum([0] + [len(bag) for bag in bags]))
    if isinstance(X, Features):
        data = X
    elif isinstance(X, tuple):
        if len(X) != 2:
            raise ProbeError(f"{what} is a tuple of {len(X)}: give statement vectors [n, d], or token bags as "
                             "(tokens [T, d], offsets [n+1])")
        tokens, offsets = _float_array(X[0], f"{what}'s tokens"), np.asarray(X[1])
        data = Features(torch.as_tensor(tokens), torch.as_tensor(_offsets(offsets, len(tokens), what)))
    else:
        data = Features(torch.as_tensor(_float_array(X, what)))
    _check_finite(data, what)
    return data


def _float_array(X, what: str) -> np.ndarray:
    """float32 [n, d] from an array-like, or a ProbeError naming `what`."""
    try:
        array = np.asarray(X.detach().cpu() if isinstance(X, torch.Tensor) else X, dtype=np.float32)
    except (TypeError, ValueError) as err:
        raise ProbeError(f"{what} is not an array of numbers ({err}): give statement vectors [n, d]") from None
    if array.ndim != 2:
        fix = "; one statement is X[None, :]" if array.ndim == 1 else ""
        raise ProbeError(f"{what} has shape {tuple(array.shape)}: give statement vectors [n, d] (one row per "
                         f"statement){fix}")
    return array


def _offsets(offsets: np.ndarray, n_tokens: int, what: str) -> np.ndarray:
    """int64 [n+1] offsets that start at 0, never decrease and end at the token count, or a ProbeError."""
    fix = f"offsets [n+1] must start at 0, never decrease and end at {n_tokens} (the tokens' rows)"
    if offsets.ndim != 1 or len(offsets) < 2 or not np.issubdtype(offsets.dtype, np.integer):
        raise ProbeError(f"{what}'s offsets have shape {tuple(offsets.shape)} and dtype {offsets.dtype}: {fix}, "
                         "as whole numbers")
    offsets = offsets.astype(np.int64)
    if offsets[0] != 0 or offsets[-1] != n_tokens or bool((np.diff(offsets) < 0).any()):
        bad = "decrease" if bool((np.diff(offsets) < 0).any()) else f"run from {offsets[0]} to {offsets[-1]}"
        raise ProbeError(f"{what}'s offsets {bad}: {fix}")
    return offsets


def _check_finite(data: Features, what: str) -> None:
    finite = torch.isfinite(data.X).all(dim=1) if data.X.ndim == 2 else torch.isfinite(data.X)
    if not bool(finite.all()):
        rows = torch.nonzero(~finite).flatten()
        if data.is_bags:   # the statements that own those token rows
            rows = torch.unique(torch.searchsorted(data.offsets, rows, right=True) - 1)
        shown = ", ".join(str(int(r)) for r in rows[:5]) + (", ..." if len(rows) > 5 else "")
        raise ProbeError(f"{what} holds NaN or inf in {len(rows)} statement(s) (rows {shown}): a probe scores "
                         "finite vectors only; drop those rows or re-extract them")


def check_rows(rows, n: int, what: str) -> np.ndarray:
    """int64 positions into n statements, or a ProbeError naming `what`."""
    array = np.asarray(rows)
    if array.ndim != 1 or array.size == 0 or not np.issubdtype(array.dtype, np.integer):
        raise ProbeError(f"{what} must be a non-empty list of whole row numbers into X (got shape "
                         f"{tuple(array.shape)}, dtype {array.dtype})")
    if array.min() < 0 or array.max() >= n:
        bad = int(array.min()) if array.min() < 0 else int(array.max())
        raise ProbeError(f"{what} holds row {bad}, outside X's {n} statements: give positions 0..{n - 1}")
    return array.astype(np.int64)


def check_class_labels(y, n: int) -> np.ndarray:
    """int64 [n] labels (whole numbers >= 0), or a ProbeError."""
    labels = np.asarray(y)
    if labels.ndim != 1 or len(labels) != n:
        raise ProbeError(f"y has shape {tuple(labels.shape)} for X's {n} statements: give one label per row of X")
    values = labels.astype(np.float64) if labels.dtype == bool or np.issubdtype(labels.dtype, np.number) else None
    if values is None or not bool(np.isfinite(values).all()) or bool((values != np.round(values)).any()) \
            or values.min(initial=0) < 0:
        raise ProbeError("y must hold whole-number labels >= 0 (the store's 0 false / 1 true / 2 neither, or any "
                         "0..K-1 coding)")
    return labels.astype(np.int64)
