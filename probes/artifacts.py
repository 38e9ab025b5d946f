"""Fitted probes you can keep: fitted and calibrated in one call, saved beside a result cell, loaded
back without Hydra or the store.

    results/.../layer=<k>/seed=<s>.json                         the cell (config, score map, conformal
                                                                state; `heads`: file, sha256, bytes)
    results/.../layer=<k>/seed=<s>.<sha16>.probe.safetensors    the fitted heads' tensors (head<i>.<name>)

A cell and its heads are one pair on disk (probes.saved_pair): the heads file is named by its content
hash and the cell, renamed into place last, names it; every loader checks the file's size and sha256
against the cell before reading it.

`fit_probe(probe, X, y, train, cal)` fits a probe's heads on the training rows, maps their scores to
probabilities (on out-of-fold training scores) and calibrates conformal sets on the calibration rows,
as `python -m train_probe` does. `load_probe(path)` (either file) returns the same `FittedProbe`,
which scores raw activations of the stored layer exactly as the cell did: X [n, d] statement vectors
(last / mean representation, as the probe read them; the probe applies its own standardiser), or
`(X [T, d], offsets [n+1])` token bags for samil. numpy arrays and torch tensors are accepted, so
activations from other tools (nnsight, TransformerLens) can be probed too.

A cell also records the store its probe was fitted on (extract.store.store_summary); check_same_model
there refuses a store or model whose inputs differ from it (weights, tokenizer, template, dtypes).
"""
from __future__ import annotations

import copy
import importlib
import re
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf
from sklearn.base import BaseEstimator, ClassifierMixin
from sklearn.metrics import matthews_corrcoef

from evaluation.calibration import ScoreMap
from evaluation.cells import CellError, read_cell
from evaluation.conformal import ConformalClassifier, ConformalError, ReferenceConformal, check_procedure
from extract.store import ActivationStore, store_summary
from toolkit.errors import ToolkitError
from probes.card import is_card, read_card, save_card
from probes.base import Probe, ProbeError, as_features, check_choice, check_class_labels, check_rows
from probes.features import Features
from probes.fitting import CALIBRATIONS, HeadBank, calibrate, conformal_input
from probes.saved_pair import cell_of_heads, read_heads, write_probe_cell

def build_probe(spec: dict, accelerator: str = "auto") -> Probe:
    """A fresh, unfitted probe from a `probe:` config (conf/probe/*.yaml as a dict): `_target_` names a
    Probe class of this package, the other keys (except `name`) are its constructor arguments."""
    options = {k: v for k, v in spec.items() if k not in ("name", "_target_")}
    target = str(spec.get("_target_", ""))
    cls, why = _probe_class(target)
    if cls is None:
        raise ProbeError(f"probe._target_={target!r}{why}: a probe class of this toolkit (probes.*, e.g. "
                         "probes.linear.LinearProbe) is required")
    nested = [k for k, v in options.items() if isinstance(v, dict)]
    if nested:
        raise ProbeError(f"probe.{nested[0]}: probe options are plain values or lists, not nested groups; remove it")
    try:
        return cls(**options, accelerator=accelerator)
    except (TypeError, ProbeError) as err:  # an unknown or bad option
        raise ProbeError(f"probe={spec.get('name', target)}: {err}") from None


def _probe_class(target: str) -> tuple[type | None, str]:
    """The Probe subclass `target` names (a dotted path under probes.), or (None, why not)."""
    module, _, name = target.rpartition(".")
    if not (module == "probes" or module.startswith("probes.")):
        return None, ""
    try:
        cls = getattr(importlib.import_module(module), name)
    except ImportError as err:
        return None, f" cannot be imported ({err})"
    except AttributeError:
        return None, f" does not exist (no {name} in {module})"
    if not (isinstance(cls, type) and issubclass(cls, Probe)):
        return None, f" is a {type(cls).__name__}, not a Probe class"
    return cls, ""


class FittedProbe(ClassifierMixin, BaseEstimator):
    """A fitted and calibrated probe (see the module docstring for the input X), a scikit-learn
    classifier that is already fitted (as sklearn's FrozenEstimator): `fit(X, y)` only checks X and
    returns it unchanged (refit with `fit_probe`), `clone` gives a fitted copy. classes_ 0..K-1 (a binary
    task: 1 = its head's class); `predict` gives the most probable class, `predict_with_abstention` -1
    where the conformal set is not one label, `score(X, y)` the MCC of `predict`.

    spec        its `probe:` config (`_target_`, options, name)
    heads       one fitted Probe (binary tasks) or one per class (multiclass, one-vs-all)
    calibration the cell's calibration block: how the score map was fitted (kind, n_folds, n_rows) and
                the map itself (heads' scores [n, heads] -> class probabilities [n, K])
    conformal   the calibrated ConformalClassifier (LAC) or ReferenceConformal
    layer, store   the layer it reads and the summary of the store it was fitted on (None / {} if unknown)
    cell        the result cell it was loaded from (None for a probe fitted in this process)
    n_features  d, the width of the vectors its heads read (None if they do not say)

    Inputs are checked before any head runs: two dimensions, d columns, finite numbers (a NaN row is
    refused, never scored as an abstention), token bags for a probe that reads bags.
    """

    def __init__(self, spec: dict, heads: list[Probe], calibration: dict, conformal, layer: int | None = None,
                 store: dict | None = None, cell: dict | None = None):
        self.spec, self.heads, self.calibration, self.conformal = spec, heads, calibration, conformal
        self.layer, self.store, self.cell = layer, store or {}, cell
        self._derive()

    def _derive(self) -> None:
        """The state that follows from the arguments (again after set_params)."""
        self.score_map = ScoreMap.from_dict(self.calibration["map"])
        self.representation, self.tokens = self.heads[0].representation, self.heads[0].tokens
        self.procedure = "reference" if isinstance(self.conformal, ReferenceConformal) else "lac"
        self.n_features = getattr(self.heads[0], "n_features_in_", None)

    def set_params(self, **params) -> "FittedProbe":
        super().set_params(**params)
        self._derive()
        return self

    def fit(self, X, y=None) -> "FittedProbe":
        """Already fitted: X is checked, nothing is refitted (use fit_probe for that)."""
        self._checked(X)
        return self

    def __sklearn_clone__(self) -> "FittedProbe":
        return copy.deepcopy(self)

    def __sklearn_is_fitted__(self) -> bool:
        return True

    @property
    def classes_(self) -> np.ndarray:
        """int [K]: 0..K-1, the columns of predict_proba."""
        return np.arange(max(2, np.size(self.score_map.intercept_)))

    @property
    def n_features_in_(self) -> int | None:
        return self.n_features

    def decision_function(self, X) -> np.ndarray:
        """float [n, heads]: one score per head (one head for binary tasks, one per class for multiclass)."""
        data = self._checked(X)
        return np.stack([np.asarray(h.decision_function(data), dtype=np.float64) for h in self.heads], axis=1)

    def token_scores(self, tokens) -> np.ndarray:
        """float [T, heads]: each token vector of `tokens` [T, d] scored as the probe scores a statement: for a
        probe of token bags (samil) each token as a bag of one (its instance score: a bag's score is the max of
        its tokens'), for the others each token's vector as if it were the statement's (last or mean) vector.
        `from_scores` turns them into per-token probabilities."""
        X = torch.as_tensor(np.asarray(tokens, dtype=np.float32))
        bags = torch.arange(len(X) + 1) if self.representation == "bags" else None
        return self.decision_function(Features(X, bags))

    def _checked(self, X) -> Features:
        """X as Features, refused in one ProbeError unless this probe can score it."""
        data = as_features(X)
        if self.representation == "bags" and not data.is_bags:
            raise ProbeError("X: this probe reads token bags: give (tokens [T, d], offsets [n+1]), e.g. "
                             "store.bags(layer)")
        if self.n_features is not None and data.X.shape[1] != self.n_features:
            where = f"layer {self.layer}'s" if self.layer is not None else "its layer's"
            raise ProbeError(f"X has {data.X.shape[1]} columns but the probe reads {self.n_features}: give "
                             f"{where} vectors of the model it was fitted on")
        return data

    def predict_proba(self, X) -> np.ndarray:
        """float [n, K] class probabilities (K = 2 for binary tasks)."""
        return self.score_map.predict_proba(self.decision_function(X))

    def score_all(self, X) -> dict[str, np.ndarray]:
        """Everything at once (the heads run once): scores [n, heads], probs [n, K], sets bool [n, K]
        and pred int [n] (the label of a one-label set, -1 = abstain)."""
        return self.from_scores(self.decision_function(X))

    def from_scores(self, scores: np.ndarray) -> dict[str, np.ndarray]:
        """score_all from the heads' scores [n, heads] (already computed, as train_probe has them)."""
        probs = self.score_map.predict_proba(scores)
        values = conformal_input(scores, probs, self.procedure)
        return {"scores": scores, "probs": probs, "sets": self.conformal.predict_sets(values),
                "pred": self.conformal.predict(values)}

    def predict_set(self, X) -> np.ndarray:
        """bool [n, K] conformal prediction sets."""
        return self.score_all(X)["sets"]

    def predict_with_abstention(self, X) -> np.ndarray:
        """int [n]: the label of a one-label set, -1 (abstain) otherwise."""
        return self.score_all(X)["pred"]

    def predict(self, X) -> np.ndarray:
        """int [n]: the most probable class (never an abstention)."""
        return self.classes_[self.predict_proba(X).argmax(axis=1)]

    def score(self, X, y, sample_weight=None) -> float:
        """MCC of predict(X) against the task's targets y [n] (sklearn's matthews_corrcoef)."""
        return float(matthews_corrcoef(y, self.predict(X), sample_weight=sample_weight))

    def to_cell(self) -> dict:
        """The probe's part of a result cell (what `load_probe` reads back with the heads' file)."""
        targets = range(len(self.heads)) if len(self.heads) > 1 else [1]
        return {"config": {"probe": self.spec}, "layer": self.layer, "store": self.store,
                "probe_params": {str(c): h.params() for c, h in zip(targets, self.heads)},
                "calibration": self.calibration, "conformal": self.conformal.to_dict()}

    def save(self, path) -> Path:
        """Write the probe as a cell without evaluation (`metrics` and `test` empty) at `path` (.json;
        a path ending in .probe.safetensors means the cell of that heads file), its heads beside it
        (write_probe_cell); `load_probe(path)` reads it back. Returns the cell's path."""
        path = cell_of_heads(Path(path))
        write_probe_cell(path, {**self.to_cell(), "metrics": {}, "test": {}}, self.heads)
        return path

    def save_card(self, folder, store=None, overwrite: bool = False) -> Path:
        """Write the probe as a probe card (probes.card: README.md with YAML metadata, model.safetensors,
        config.json) at `folder`, its evaluation included where it was loaded from a result cell; `store` (an
        ActivationStore) adds the sha256 of its statements. `load_probe(folder)` reads it back."""
        return save_card(self, folder, store, overwrite)


def check_classes(classes, labels: np.ndarray) -> list[int]:
    """fit_probe's `classes` (None: [1] for 0/1 labels, else every label) as whole numbers that occur in
    `labels` [n], each once: else one ProbeError line naming the bad value."""
    if classes is None:
        return [1] if labels.max() <= 1 else list(range(int(labels.max()) + 1))
    items = list(classes) if isinstance(classes, (list, tuple, np.ndarray)) else None
    if not items:
        raise ProbeError(f"classes={classes!r}: give the labels with a head, e.g. classes=[1] (binary: y == 1) or "
                         "classes=[0, 1, 2] (multiclass), or None for the default")
    present = sorted(int(v) for v in np.unique(labels))
    for c in items:
        if isinstance(c, bool) or not isinstance(c, (int, np.integer)) or int(c) not in present:
            raise ProbeError(f"classes={items!r}: {c!r} is not a label of y (its labels: {present}); give labels of y")
    if len(set(int(c) for c in items)) < len(items):
        raise ProbeError(f"classes={items!r}: a label is listed twice: list each once")
    return [int(c) for c in items]


def fit_probe(probe: str | dict, X: np.ndarray | tuple | Features, y: np.ndarray, train: np.ndarray,
              cal: np.ndarray, *, classes: list[int] | None = None, groups: np.ndarray | None = None,
              layer: int | None = None, store: ActivationStore | None = None, alpha: float = 0.1, mondrian: bool = False,
              conformal: str = "lac", calibration: str = "out_of_fold_cv", calibration_folds: int = 3, seed: int = 0,
              accelerator: str = "auto", **options) -> FittedProbe:
    """Fit and calibrate a probe on rows `train` / `cal` of X, as `python -m train_probe` does
    (probes.fitting: the same heads, folds, score map and conformal sets).

    The heads are fitted on `train`; the score map on their out-of-fold training scores
    (calibration="out_of_fold_cv", the default: `calibration_folds` grouped folds, also the probes' CV
    folds, each scored by its fold fit at the chosen C, see probes.fitting.HeadBank; "out_of_fold": the
    same folds, each scored by a refitted copy with its own CV; "in_sample": on the final heads'
    training scores); conformal sets (lac, or the reference code's p-values) on `cal` at level `alpha`.
    Every argument is checked before any fit, as one ProbeError naming it: X [n, d] of finite numbers
    (bags for samil, their offsets cutting the tokens into n bags), y and groups with n entries, train /
    cal non-empty whole row numbers in 0..n-1 that share no row.

    Args:
        probe: a probe name of conf/probe/ (linear, mlp, mean_diff, samil), its options overridden by
            `options` (e.g. C=1.0), or a whole `probe:` config dict.
        X: statement vectors [n, d], `(tokens [T, d], offsets [n+1])` bags, or Features.
        y: int [n] labels (the store's 0 false / 1 true / 2 neither, or any 0..K-1 coding).
        train: int row indices into X: the heads' training rows.
        cal: int row indices into X: the conformal calibration rows.
        classes: the labels with a head: one label for a binary probe (target y == it), several for a
            multiclass one (targets y, one-vs-all heads); default [1] for 0/1 labels, else every label.
        groups: int [n] entity of each row (grouped folds), or None (then Features' own groups, if any).
        layer: recorded with the probe.
        store: an ActivationStore, recorded with the probe (its model and settings).
    """
    if isinstance(probe, str):
        from toolkit.config import compose_config  # Hydra composition, only for a probe given by name

        spec = {**OmegaConf.to_container(compose_config("train_probe", f"probe={probe}").probe, resolve=True),
                **options}
    else:
        spec = {**probe, **options}
    check_choice("calibration", calibration, CALIBRATIONS)
    check_procedure(conformal, mondrian)
    if calibration.startswith("out_of_fold") and (isinstance(calibration_folds, bool) or
                                         not isinstance(calibration_folds, (int, np.integer)) or calibration_folds < 2):
        raise ProbeError(f"calibration_folds={calibration_folds!r}: use a whole number >= 2")
    template = build_probe(spec, accelerator)
    features = as_features(X)
    if template.representation == "bags" and not features.is_bags:
        raise ProbeError(f"X: probe {spec.get('name', spec.get('_target_'))} reads token bags: give "
                         "(tokens [T, d], offsets [n+1]), e.g. store.bags(layer)")
    n = len(features)
    labels = check_class_labels(y, n)
    if groups is not None:
        groups = np.asarray(groups)
        if groups.ndim != 1 or len(groups) != n:
            raise ProbeError(f"groups has shape {tuple(groups.shape)} for X's {n} statements: give one group per "
                             "row of X (or groups=None)")
        features = Features(features.X, features.offsets, groups)
    train, cal = check_rows(train, n, "train"), check_rows(cal, n, "cal")
    shared = np.intersect1d(train, cal)
    if shared.size:
        raise ProbeError(f"train and cal share {shared.size} row(s) (e.g. {shared[0]}): calibrate on rows held out "
                         "from training, or the conformal sets lose their guarantee")
    classes = check_classes(classes, labels)
    target = labels if len(classes) > 1 else (labels == classes[0]).astype(np.int64)
    folds = int(calibration_folds) if calibration.startswith("out_of_fold") else 0
    bank = HeadBank(template, features, labels, train, folds, int(seed), calibration == "out_of_fold_cv")
    return calibrated_heads(bank, classes, target, cal, spec, calibration, alpha, conformal, mondrian, layer,
                            None if store is None else store_summary(store))


def calibrated_heads(bank: HeadBank, classes: list[int], target: np.ndarray, cal: np.ndarray, spec: dict,
                     calibration: str, alpha: float, conformal: str, mondrian: bool, layer: int | None = None,
                     store: dict | None = None) -> FittedProbe:
    """The one fit-and-calibrate step (fit_probe's and train_probe's): the bank's heads of `classes`, their
    score map fitted on out-of-fold training scores (calibration out_of_fold*) or in sample, and the
    conformal predictor (lac / reference) calibrated on rows `cal` of the bank at level `alpha`.
    target int [M]: the task's labels of the bank's M statements (0/1, or 0..K-1 with a head per class)."""
    heads, scores = [bank.head(c) for c in classes], bank.scores(classes)
    oof = bank.out_of_fold(classes) if calibration.startswith("out_of_fold") else None
    _, predictor, summary = calibrate(scores, target, bank.train, cal, oof, len(bank.folds), calibration, alpha,
                                      conformal, mondrian)
    return FittedProbe(spec, heads, summary, predictor, layer, store)


def load_probe(path) -> FittedProbe:
    """The fitted probe of a result cell; `path` is the cell's .json, its .probe.safetensors or a probe card's
    folder (probes.card, its files checked against their recorded sha256). Anything
    in the pair that cannot make a working probe (a block missing, heads of another shape or width than
    the cell records, NaN weights or thresholds, a `_target_` that is no probe class) is one CellError
    naming the cell, never a traceback or a probe that silently abstains."""
    if is_card(path):
        cell, tensors = read_card(path)
        try:
            return _probe_of_cell(cell, tensors)
        except ToolkitError as err:
            raise CellError(f"{path}: {err}; save the card again from its result cell") from None
    cell_file = cell_of_heads(Path(path))
    cell = read_cell(cell_file)
    try:
        tensors = read_heads(cell_file, cell)
    except CellError:   # a writer may have replaced the pair between the two reads: read the new one
        cell = read_cell(cell_file)
        tensors = read_heads(cell_file, cell)
    try:
        return _probe_of_cell(cell, tensors)
    except ToolkitError as err:
        raise CellError(f"{cell_file}: {err}; rerun the command that wrote it (train_probe overwrite=true)") from None


def _probe_of_cell(cell: dict, tensors: dict[str, torch.Tensor]) -> FittedProbe:
    """The FittedProbe of a cell and its (hash-checked) heads' tensors, every block checked."""
    missing = [k for k in ("probe_params", "calibration", "conformal", "layer") if k not in cell]
    spec = cell["config"].get("probe") if isinstance(cell["config"], dict) else None
    if missing or not isinstance(spec, dict):
        raise CellError(f"no {'config.probe' if not isinstance(spec, dict) else missing[0]} block (not a cell of "
                        "a saved probe, or edited by hand)")
    template = build_probe(spec, accelerator="cpu")
    params = cell["probe_params"]
    if not isinstance(params, dict) or not params or not all(isinstance(v, dict) for v in params.values()):
        raise CellError("probe_params is not one {option: value} block per head")
    by_head: dict[int, dict] = {}
    for key, tensor in tensors.items():
        match = re.fullmatch(r"head(\d+)\.(.+)", key)
        if match is None:
            raise CellError(f"its heads file holds a tensor {key!r}, not head<i>.<name>")
        by_head.setdefault(int(match.group(1)), {})[match.group(2)] = tensor
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise CellError(f"its heads file holds NaN or inf in {key}")
    if sorted(by_head) != list(range(len(params))):
        raise CellError(f"its heads file holds {len(by_head)} head(s), probe_params {len(params)}")
    heads = []
    for i, head_params in enumerate(params.values()):
        head, state = copy.deepcopy(template), dict(by_head[i])
        if "_extra_state" in head.state_dict():
            state["_extra_state"] = {"params": head_params}
        try:
            head.load_state_dict(state)
        except (RuntimeError, ValueError, KeyError) as err:
            raise CellError(f"head {i} does not fit probe {spec.get('name', spec.get('_target_'))} "
                            f"({' '.join(str(err).split())[:300]})") from None
        heads.append(head.eval())
    widths = {getattr(h, "n_features_in_", None) for h in heads}
    hidden = (cell.get("store") or {}).get("hidden_size")
    if len(widths) > 1 or (hidden is not None and widths != {hidden} and widths != {None}):
        raise CellError(f"its heads read vectors of width {sorted(w for w in widths if w)}, but the store it "
                        f"records has hidden_size {hidden}")
    conformal = cell["conformal"]
    kind = ReferenceConformal if isinstance(conformal, dict) and "calibration_scores" in conformal else \
        ConformalClassifier
    try:
        probe = FittedProbe(spec, heads, cell["calibration"], kind.from_dict(conformal), cell["layer"],
                            cell.get("store"), cell)
    except ConformalError:
        raise
    except (KeyError, TypeError, ValueError, IndexError) as err:
        raise CellError(f"its calibration block is not a score map ({type(err).__name__}: {err})") from None
    _check_scores(probe)
    return probe


def _check_scores(probe: FittedProbe) -> None:
    """One zero statement through the whole probe: heads, score map and conformal sets must run and give
    finite numbers (what a hash cannot vouch for in a hand-made pair)."""
    d = probe.n_features or (probe.store or {}).get("hidden_size")
    if d is None:
        return
    X = np.zeros((1, int(d)), dtype=np.float32)
    try:
        out = probe.score_all((X, np.array([0, 1])) if probe.representation == "bags" else X)
        probs = out["probs"]
    except ToolkitError:
        raise
    except Exception as err:   # whatever a crafted head or map makes torch / numpy raise
        raise CellError(f"its probe cannot score a vector of width {d} ({type(err).__name__}: "
                        f"{str(err).splitlines()[0] if str(err) else ''})") from None
    if not (np.isfinite(out["scores"]).all() and np.isfinite(probs).all()):
        raise CellError("its probe gives NaN or inf scores or probabilities (NaN in the score map?)")
