"""`python -m train_probe`: for each requested layer, fit a probe on the training split, map its
scores to probabilities (evaluation.calibration), calibrate conformal sets on the calibration
split, evaluate on test, and write one result cell per (model, datapack, probe, task, split,
layer, seed) (evaluation.cells).
"""
from __future__ import annotations

import copy
import logging
import time
from pathlib import Path

import lightning as L
import numpy as np
from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from evaluation.calibration import ScoreMap
from evaluation.cells import cell_path, write_cell
from evaluation.conformal import ConformalClassifier, prediction
from evaluation.metrics import auroc, evaluate, mcc, plain_prediction, resampling_groups
from evaluation.splits import entity_groups, make_split
from evaluation.tasks import task_targets
from extract.errors import check_name
from extract.store import ActivationStore, select_layers, store_path
from probes.base import Probe, ProbeError
from probes.features import Features, layer_features

log = logging.getLogger(__name__)


def train_probes(cfg: DictConfig) -> list[Path]:
    """Run every requested layer of one (probe, task); returns the cell paths (existing ones kept)."""
    template = make_probe(cfg)  # bad probe options fail here, even if every cell exists
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
            cell = fit_and_evaluate(cfg, template, features, y, parts)
            cell.update(layer=k, split=split.summary(), store=_store_summary(store))
            write_cell(paths[k], cell)
    return [paths[k] for k in layers]


def probe_cell_path(cfg: DictConfig, layer: int) -> Path:
    return cell_path(cfg.results_dir, cfg.model.name, cfg.data.name, cfg.probe.name, cfg.task.name, cfg.split.kind, layer,
                     cfg.seed)


def fit_and_evaluate(cfg: DictConfig, template: Probe, features: Features, y: np.ndarray,
                     parts: dict[str, np.ndarray]) -> dict:
    """One probe at one layer: fit on train, scores -> probabilities -> conformal sets -> metrics.

    One head per class (one-vs-all) for multiclass, else one head; each a fresh copy of `template`."""
    train, cal, test = parts["train"], parts["calibration"], parts["test"]
    started = time.perf_counter()
    classes = int(y.max()) + 1
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    heads = [(c, copy.deepcopy(template).fit(features.subset(train), (y[train] == c).astype(np.int64)))
             for c in (range(classes) if classes > 2 else [1])]
    scores = np.stack([probe.decision_function(features) for _, probe in heads], axis=1)  # [N, heads]
    probs = ScoreMap().fit(scores[train], y[train]).predict_proba(scores)
    conformal = ConformalClassifier().fit(probs[cal], y[cal], alpha=cfg.alpha, mondrian=cfg.mondrian)
    sets = conformal.predict_sets(probs[test])
    pred = prediction(sets)
    metrics = evaluate(y[test], pred, probs[test], sets=sets, seed=cfg.seed, n_boot=cfg.n_boot,
                       groups=resampling_groups(cfg.bootstrap, features.groups[test]))
    return {
        "config": {**OmegaConf.to_container(cfg, resolve=True), "model": {"name": cfg.model.name},
                   "data": {"name": cfg.data.name}},  # the store summary records the model itself
        "metrics": metrics,
        "calibration_metrics": {"mcc_all": mcc(y[cal], plain_prediction(probs[cal])),
                                "auroc": auroc(y[cal], probs[cal] if classes > 2 else probs[cal, 1])},
        "probe_params": {str(c): probe.params() for c, probe in heads},
        "conformal": conformal.to_dict(),
        "fit_seconds": time.perf_counter() - started,
        "test": {"rows": test.tolist(), "y": y[test].tolist(), "groups": features.groups[test].tolist(),
                 "scores": scores[test].tolist(),
                 "probs": probs[test].tolist(), "sets": sets.astype(int).tolist(), "pred": pred.tolist()},
    }


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
