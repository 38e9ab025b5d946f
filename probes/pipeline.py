"""`python -m train_probe`: for each requested layer, fit a probe on the training split, map its
scores to probabilities (fitted on training scores), calibrate conformal sets on the calibration
split, evaluate on test, and write one JSON result cell per (model, datapack, probe, task, split,
layer, seed).

Cell path: <results_dir>/<model>/<datapack>/<probe>/<task>/<split>/layer=<k>/seed=<s>.json
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from pathlib import Path

import lightning as L
import numpy as np
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from sklearn.linear_model import LogisticRegression
from tqdm import tqdm

from extract.store import ActivationStore, StoreError, store_path
from probes.conformal import ConformalClassifier, binary_probs, prediction
from probes.data import task_targets, layer_features
from probes.metrics import auroc, evaluate, mcc, plain_prediction
from probes.splits import entity_groups, make_split

log = logging.getLogger(__name__)


def cell_path(cfg: DictConfig, layer: int) -> Path:
    return (Path(cfg.results_dir) / cfg.model.name / cfg.data.name / cfg.probe.name / cfg.task.name
            / cfg.split.kind / f"layer={layer}" / f"seed={cfg.seed}.json")


def resolve_layers(spec, store: ActivationStore) -> list[int]:
    """`all`, an int, or a list -> stored layer numbers; a clear error for anything else."""
    if spec == "all":
        return store.layers
    wanted = [spec] if isinstance(spec, int) else list(spec)
    for k in wanted:
        if not isinstance(k, int) or not 0 <= k <= store.n_layers:
            raise StoreError(f"layer={k} is outside 0..{store.n_layers} for this model: choose layer=0..{store.n_layers} "
                             "or layer=all")
        if k not in store.layers:
            raise StoreError(f"layer {k} was not extracted into {store.path}: extract it (layers=...) or choose one of "
                             f"{store.layers}")
    return wanted


def train_probes(cfg: DictConfig) -> list[Path]:
    """Run every requested layer of one (probe, task); returns the cell paths (existing ones kept)."""
    store = ActivationStore(store_path(cfg.store_dir, cfg.model.name, cfg.data.name))
    layers = resolve_layers(cfg.layer, store)
    representation = make_probe(cfg).representation  # bad probe options fail here, even if cells exist
    todo = [k for k in layers if cfg.overwrite or not cell_path(cfg, k).exists()]
    if len(todo) < len(layers):
        log.info("%d of %d cells exist already (overwrite=true recomputes them)", len(layers) - len(todo), len(layers))
    if not todo:
        return [cell_path(cfg, k) for k in layers]
    table = store.table
    rows, y = task_targets(table["label"].to_numpy(), cfg.task.name)
    split = make_split(table, **cfg.split)
    parts = {name: _positions(rows, getattr(split, name)) for name in ("train", "calibration", "test")}
    groups = entity_groups(table)[rows]
    for k in tqdm(todo, desc=f"{cfg.probe.name} {cfg.task.name}", unit="layer"):
        features = layer_features(store, k, representation, cfg.probe.get("tokens", "statement")).subset(rows)
        features.groups = groups
        cell = fit_and_evaluate(cfg, features, y, parts)
        cell.update(layer=k, split=split.summary(), store=_store_summary(store))
        write_cell(cell_path(cfg, k), cell)
    return [cell_path(cfg, k) for k in layers]


def fit_and_evaluate(cfg: DictConfig, features, y: np.ndarray, parts: dict[str, np.ndarray]) -> dict:
    """One probe at one layer: fit on train, scores -> probabilities -> conformal sets -> metrics."""
    train, cal, test = parts["train"], parts["calibration"], parts["test"]
    started = time.perf_counter()
    classes = int(y.max()) + 1
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    heads = [(c, make_probe(cfg).fit(features.subset(train), (y[train] == c).astype(np.int64)))
             for c in (range(classes) if classes > 2 else [1])]
    scores = np.stack([probe.decision_function(features) for _, probe in heads], axis=1)  # [N, heads]
    mapper = LogisticRegression(C=1e4, max_iter=1000).fit(scores[train], y[train])   # scores -> probabilities
    probs = mapper.predict_proba(scores)
    if classes == 2:
        probs = binary_probs(probs[:, 1])
    conformal = ConformalClassifier().fit(probs[cal], y[cal], alpha=cfg.alpha, mondrian=cfg.mondrian)
    sets = conformal.predict_sets(probs[test])
    pred = prediction(sets)
    metrics = evaluate(y[test], pred, probs[test], sets=sets, seed=cfg.seed, n_boot=cfg.n_boot)
    return {
        "config": OmegaConf.to_container(cfg, resolve=True),
        "metrics": metrics,
        "calibration_metrics": {"mcc_all": mcc(y[cal], plain_prediction(probs[cal])),
                                "auroc": auroc(y[cal], probs[cal] if classes > 2 else probs[cal, 1])},
        "probe_params": {str(c): probe.params() for c, probe in heads},
        "conformal": conformal.to_dict(),
        "fit_seconds": time.perf_counter() - started,
        "test": {"rows": test.tolist(), "y": y[test].tolist(), "scores": scores[test].tolist(),
                 "probs": probs[test].tolist(), "sets": sets.astype(int).tolist(), "pred": pred.tolist()},
    }


def make_probe(cfg: DictConfig):
    """A fresh, unfitted probe from the `probe:` config (its keys other than name / tokens are
    constructor arguments), on the trainer's accelerator."""
    kwargs = {k: v for k, v in cfg.probe.items() if k not in ("name", "tokens")}
    try:
        return instantiate(kwargs, accelerator=cfg.trainer.accelerator)
    except InstantiationException as err:  # a bad probe option: the probe's own message, one line
        raise ValueError(f"probe={cfg.probe.name}: {err.__cause__ or err}") from None


def _positions(rows: np.ndarray, split_rows: np.ndarray) -> np.ndarray:
    """Positions within `rows` (the task's statements) of the split's statements, in rows' order."""
    return np.flatnonzero(np.isin(rows, split_rows))


def _store_summary(store: ActivationStore) -> dict:
    keys = ("model_id", "model_fingerprint", "n_layers", "hidden_size", "dtype", "chat_template", "datapack")
    return {k: (v.item() if hasattr(v, "item") else v) for k, v in store.attrs.items() if k in keys}


def write_cell(path: Path, cell: dict) -> None:
    """Atomic: written to a temporary file in the same folder, then renamed over the target."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(cell, f, allow_nan=False)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
