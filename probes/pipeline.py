"""`python -m train_probe`: for each requested layer, fit a probe on the training split, map its
scores to probabilities (evaluation.calibration, fitted on out-of-fold training scores), calibrate
conformal sets on the calibration split, evaluate on test, and write one result cell per (model,
datapack, method, task, split, layer, seed) (evaluation.cells).
"""
from __future__ import annotations

import copy
import logging
import math
import time
from pathlib import Path

import lightning as L
import numpy as np
from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from evaluation.calibration import ScoreMap
from evaluation.cells import cell_path, write_cell
from evaluation.conformal import ConformalClassifier, ConformalError, ReferenceConformal, acceptance_by_label
from evaluation.metrics import auroc, evaluate, mcc, plain_prediction, resampling_groups
from evaluation.splits import entity_groups, make_split
from evaluation.tasks import task_targets
from extract.errors import check_name
from extract.store import ActivationStore, select_layers, store_path
from probes.artifacts import artifact_path, save_heads
from probes.base import Probe, ProbeError, check_choice, kfold_splits
from probes.features import Features, layer_features
from probes.schema import validate

log = logging.getLogger(__name__)
CALIBRATIONS = ("out_of_fold", "in_sample")
CONFORMAL = ("lac", "reference")


def train_probes(cfg: DictConfig) -> list[Path]:
    """Run every requested layer of one (probe, task); returns the cell paths (existing ones kept)."""
    cfg = validate(cfg)         # types and ranges of the run's options, before any work
    template = make_probe(cfg)  # bad probe options fail here, even if every cell exists
    method_name(cfg)            # so do bad calibration / conformal choices
    store = ActivationStore(store_path(cfg.store_dir, cfg.model.name, cfg.data.name))
    layers = select_layers(cfg.layer, store.n_layers, store.layers, option="layer")
    paths = {k: probe_cell_path(cfg, k) for k in layers}
    todo = [k for k in layers if cfg.overwrite or not paths[k].exists()]
    if len(todo) < len(layers):
        log.info("%d of %d cells exist already (overwrite=true recomputes them)", len(layers) - len(todo), len(layers))
    if todo:
        table = store.table
        rows, y = task_targets(table["label"].to_numpy(), cfg.task.name)
        split = make_split(table, **cfg.split)
        parts = {name: _positions(rows, getattr(split, name)) for name in ("train", "calibration", "test")}
        groups = entity_groups(table)[rows]
        for k in tqdm(todo, desc=f"{cfg.probe.name} {cfg.task.name}", unit="layer"):
            features = layer_features(store, k, template.representation, template.tokens).subset(rows)
            features.groups = groups
            cell, heads = fit_and_evaluate(cfg, template, features, y, parts)
            cell.update(layer=k, split=split.summary(), store=_store_summary(store))
            save_heads(artifact_path(paths[k]), heads)   # before the cell: a cell always has its probe
            write_cell(paths[k], cell)
    return [paths[k] for k in layers]


def method_name(cfg: DictConfig) -> str:
    """The cells' folder: the probe name, with +in_sample / +reference appended for the non-default
    calibration / conformal procedures (so their cells never replace or shadow the default ones)."""
    calibration = check_choice("calibration", cfg.calibration, CALIBRATIONS)
    conformal = check_choice("conformal.name", cfg.conformal.name, CONFORMAL)
    if conformal == "reference" and cfg.mondrian:
        raise ConformalError("mondrian=true has no counterpart in conformal=reference: use one of them")
    extras = [x for x, default in ((calibration, "out_of_fold"), (conformal, "lac")) if x != default]
    return check_name("+".join([cfg.probe.name, *extras]), "probe.name")


def probe_cell_path(cfg: DictConfig, layer: int) -> Path:
    return cell_path(cfg.results_dir, cfg.model.name, cfg.data.name, method_name(cfg), cfg.task.name, cfg.split.kind,
                     layer, cfg.seed)


def fit_and_evaluate(cfg: DictConfig, template: Probe, features: Features, y: np.ndarray,
                     parts: dict[str, np.ndarray]) -> tuple[dict, list[Probe]]:
    """One probe at one layer: fit on train, scores -> probabilities -> conformal sets -> metrics.

    One head per class (one-vs-all) for multiclass, else one head; each a fresh copy of `template`.
    Returns the cell and the fitted heads (saved beside it by probes.artifacts).
    The score map (and the multiclass stacker) is fitted on out-of-fold training scores
    (calibration=out_of_fold: copies fitted on the grouped folds' training parts score their held-out
    parts) or on the final heads' own training scores (calibration=in_sample)."""
    train, cal, test = parts["train"], parts["calibration"], parts["test"]
    started = time.perf_counter()
    classes = int(y.max()) + 1
    targets = list(range(classes)) if classes > 2 else [1]
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    heads = [copy.deepcopy(template).fit(features.subset(train), (y[train] == c).astype(np.int64)) for c in targets]
    scores = np.stack([probe.decision_function(features) for probe in heads], axis=1)  # [N, heads]
    map_rows, map_scores, n_folds, kind = train, scores[train], 0, "in_sample"
    if cfg.calibration == "out_of_fold":
        oof = out_of_fold_scores(template, features, y, train, targets, int(cfg.calibration_folds), int(cfg.seed))
        map_rows, map_scores, n_folds = oof if oof is not None else (map_rows, map_scores, 0)
        kind = "out_of_fold" if oof is not None else "in_sample (too few groups for out-of-fold scores)"
    score_map = ScoreMap().fit(map_scores, y[map_rows])
    probs = score_map.predict_proba(scores)
    if cfg.conformal.name == "reference":  # exp(-(2y-1) f) on raw binary scores; margin on the stacker's probabilities
        values = scores[:, 0] if classes == 2 else probs
        conformal = ReferenceConformal("symmetric" if classes == 2 else "margin", classes).fit(values[cal], y[cal],
                                                                                              alpha=cfg.alpha)
    else:
        values = probs
        conformal = ConformalClassifier().fit(probs[cal], y[cal], alpha=cfg.alpha, mondrian=cfg.mondrian)
    sets = conformal.predict_sets(values[test])
    pred = conformal.predict(values[test])
    metrics = evaluate(y[test], pred, probs[test], sets=sets, seed=cfg.seed, n_boot=cfg.n_boot,
                       groups=resampling_groups(cfg.bootstrap, features.groups[test]))
    metrics["auroc_probs"] = metrics["auroc"]  # from the mapped probabilities; "auroc" is from the raw scores
    metrics["auroc"] = _finite(auroc(y[test], _rank_scores(scores[test])))
    metrics.update(acceptance_by_label(pred, classes))
    params = {str(c): probe.params() for c, probe in zip(targets, heads)}
    degenerate = any(p.get("degenerate", False) for p in params.values()) or bool((np.ptp(scores[train], 0) == 0).any())
    config = OmegaConf.to_container(cfg, resolve=True)
    config["probe"]["name"] = method_name(cfg)  # a report tells <probe>+in_sample / +reference cells apart
    cell = {
        "config": {**config, "model": {"name": cfg.model.name},
                   "data": {"name": cfg.data.name}},  # the store summary records the model itself
        "method": {"name": method_name(cfg), "probe": cfg.probe.name, "calibration": cfg.calibration,
                   "conformal": cfg.conformal.name},
        "degenerate": degenerate,  # a head with ||w|| ~ 0 or constant training scores: its metrics are a constant's
        "metrics": metrics,
        "calibration_metrics": {"mcc_all": mcc(y[cal], plain_prediction(probs[cal])),
                                "auroc": _finite(auroc(y[cal], _rank_scores(scores[cal])))},
        "probe_params": params,
        "calibration": {"kind": kind, "n_folds": n_folds, "n_rows": int(len(map_rows)), "map": score_map.to_dict()},
        "conformal": conformal.to_dict(),
        "fit_seconds": time.perf_counter() - started,
        "test": {"rows": test.tolist(), "y": y[test].tolist(), "groups": features.groups[test].tolist(),
                 "scores": scores[test].tolist(),
                 "probs": probs[test].tolist(), "sets": sets.astype(int).tolist(), "pred": pred.tolist()},
    }
    return cell, heads


def out_of_fold_scores(template: Probe, features: Features, y: np.ndarray, train: np.ndarray, targets: list[int],
                       n_folds: int, seed: int) -> tuple[np.ndarray, np.ndarray, int] | None:
    """(rows [M], scores [M, heads], folds used): the training rows held out by grouped, stratified
    folds (probes.base.kfold_splits on the training groups), scored by copies of `template` fitted on
    their fold's training part. Folds where a head's target has one class are skipped (their rows are
    left out); None when no fold is usable (too few groups)."""
    y_train = y[train]
    rarest = int(np.argmin(np.bincount(y_train, minlength=max(targets) + 1)[targets])) if len(targets) > 1 else 0
    strata = (y_train == targets[rarest]).astype(np.int64)  # stratify on the rarest head's class
    groups = None if features.groups is None else features.groups[train]
    folds = [(fit, held) for fit, held in kfold_splits(strata, groups, n_folds, seed)
             if all(len(np.unique(y_train[fit] == c)) == 2 for c in targets)]
    if not folds:
        log.warning("too few groups for out-of-fold calibration scores: the map is fitted in sample")
        return None
    rows, out = [], []
    for fit, held in folds:
        part = features.subset(train[fit])
        heads = [copy.deepcopy(template).fit(part, (y_train[fit] == c).astype(np.int64)) for c in targets]
        held_features = features.subset(train[held])
        out.append(np.stack([h.decision_function(held_features) for h in heads], axis=1))
        rows.append(train[held])
    return np.concatenate(rows), np.concatenate(out), len(folds)


def _rank_scores(scores: np.ndarray) -> np.ndarray:
    """The raw scores AUROC ranks: [N] for one head, [N, K] (head k scores class k) for multiclass."""
    return scores[:, 0] if scores.shape[1] == 1 else scores


def _finite(x: float) -> float | None:
    return None if math.isnan(x) else float(x)


def make_probe(cfg: DictConfig) -> Probe:
    """A fresh, unfitted probe from the `probe:` config: `_target_` names a Probe class of this
    package, the other keys (except `name`) are its constructor arguments, on the trainer's
    accelerator. Nested options are refused, so nothing else is ever built from the command line."""
    options = OmegaConf.to_container(cfg.probe, resolve=True)
    name = check_name(options.pop("name", None), "probe.name")
    target = str(options.pop("_target_", ""))
    if not target.startswith("probes."):
        raise ProbeError(f"probe._target_={target!r}: a probe class of this toolkit (probes.*) is required")
    nested = [k for k, v in options.items() if isinstance(v, dict)]
    if nested:
        raise ProbeError(f"probe.{nested[0]}: probe options are plain values or lists, not nested groups; "
                         "remove it")
    cls = get_class(target)
    if not (isinstance(cls, type) and issubclass(cls, Probe)):
        raise ProbeError(f"probe._target_={target!r} is not a probe class")
    try:
        return cls(**options, accelerator=cfg.trainer.accelerator)
    except (TypeError, ProbeError) as err:  # an unknown or bad option
        raise ProbeError(f"probe={name}: {err}") from None


def _positions(rows: np.ndarray, split_rows: np.ndarray) -> np.ndarray:
    """Positions within `rows` (the task's statements) of the split's statements, in rows' order."""
    return np.flatnonzero(np.isin(rows, split_rows))


def _store_summary(store: ActivationStore) -> dict:
    keys = ("model_id", "model_fingerprint", "n_layers", "hidden_size", "dtype", "chat_template", "datapack")
    return {k: (v.item() if hasattr(v, "item") else v) for k, v in store.attrs.items() if k in keys}
