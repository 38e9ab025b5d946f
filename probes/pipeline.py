"""`python -m train_probe`: for each requested layer, fit a probe on the training split, map its
scores to probabilities (evaluation.calibration, fitted on out-of-fold training scores), calibrate
conformal sets on the calibration split, evaluate on test, and write one result cell per (model,
datapack, method, task, split, layer, seed) (evaluation.cells). With several tasks (`tasks=[...]`)
each layer is read once and its heads are fitted once for all of them (probes.fitting.HeadBank).

With `augment=structure_aware | neutral` (conf/augment/) the heads are fitted on the training statements and
on their copies under a context (probes.augment: built from training statements only, extracted beside the
store), each copy with its statement's target and entity group; calibration and test stay the clean
statements. The cells go under <probe>+<kind> and record the augmentation (`augment`).
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import numpy as np
import pandas as pd
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from evaluation import cells
from evaluation.conformal import check_procedure
from evaluation.cell_metrics import cell_metrics, datapack_metrics, raw_auroc
from evaluation.metrics import mcc, plain_prediction, resampling_groups
from evaluation.splits import entity_groups, make_split
from evaluation.tracking import tracking
from evaluation.tasks import POSITIVE, TASKS, task_targets
from toolkit.errors import check_name
from extract.statements import FALSE, NEITHER, TRUE, datapack_table
from extract.store import ActivationStore, select_layers, store_path, store_summary
from probes.augment import Augmentation, augmentation
from probes.artifacts import build_probe, calibrated_heads
from probes.saved_pair import write_probe_cell
from probes.base import Probe, ProbeError, check_choice
from probes.controls import FEATURES, shuffled_positions, surprisal_features, text_features
from probes.features import Features, layer_features, pair_keys
from probes.fitting import CALIBRATIONS, HeadBank
from probes.schema import validate
from probes.trainer import trainer_logging

log = logging.getLogger(__name__)


def train_probes(cfg: DictConfig) -> list[Path]:
    """Run every requested layer of one probe and its task(s); returns the cell paths (existing ones
    kept). Each layer is read once; heads shared by several tasks are fitted once (probes.fitting)."""
    cfg = validate(cfg)         # types and ranges of the run's options, before any work
    template = make_probe(cfg)  # bad probe options fail here, even if every cell exists
    method_name(cfg)            # so do bad calibration / conformal choices
    tasks = task_names(cfg)
    kind = feature_kind(cfg, template)
    path = store_path(cfg.store_dir, cfg.model.name, cfg.data.name)
    store = ActivationStore(path) if kind == "activations" else None
    layers = [None] if store is None else select_layers(cfg.layer, store.n_layers, store.layers, option="layer")
    paths = {(t, k): probe_cell_path(cfg, k, t) for k in layers for t in tasks}
    todo = {k: [t for t in tasks if cfg.overwrite or not paths[t, k].exists()] for k in layers}
    for (t, k), cell_file in paths.items():   # an existing cell is this run's result only if made like it
        if t not in todo.get(k, ()):
            cells.check_same_settings(cell_file, cell_config(cfg, t))
    todo = {k: ts for k, ts in todo.items() if ts}
    n_todo = sum(len(ts) for ts in todo.values())
    if n_todo < len(paths):
        log.info("%d of %d cells exist already (overwrite=true recomputes them)", len(paths) - n_todo, len(paths))
    if todo:
        # a control reads the store's statements where one exists (the probes' rows, split and test rows), else
        # the datapack's own
        rows_of = store if store is not None else ActivationStore(path) if path.exists() else None
        table = datapack_table(cfg.data) if rows_of is None else rows_of.table
        labels = table["label"].to_numpy()
        targets = {t: task_targets(labels, t) for t in tasks}   # every task checked before any fit
        split = make_split(table, **cfg.split) if rows_of is None else split_of(rows_of, cfg.split)
        controls = control_features(cfg, kind, table, split)
        groups = entity_groups(table)
        negation, pair = table["negation"].to_numpy(dtype=bool), pair_keys(table)   # (ttpd, ccs)
        augment = None if cfg.get("augment") is None else augmentation(
            OmegaConf.to_container(cfg.augment, resolve=True), table, split,
            OmegaConf.to_container(cfg.model, resolve=True), str(cfg.store_dir), int(cfg.seed), bool(cfg.overwrite))
        desc = f"{cfg.probe.name} {tasks[0] if len(tasks) == 1 else f'{len(tasks)} tasks'}"
        with tracking(cfg.tracker, cfg.tracker_dir, cfg.results_dir) as tracker:
            for k in tqdm(todo, desc=desc, unit="layer"):
                features = controls if store is None else layer_features(store, k, template.representation, template.tokens)
                features.groups, features.negation, features.pair = groups, negation, pair
                copies, note = np.zeros(0, dtype=np.int64), None   # copies: the clean row of each augmented row
                if augment is not None:
                    features, copies, note = augmented_features(augment, store, split, k, template, features, cfg.data.name)
                all_labels = np.concatenate([labels, labels[copies]])
                banks: dict[bytes, tuple[HeadBank, dict, np.ndarray]] = {}   # one bank per set of statements
                fits_log = Path(cfg.results_dir, "logs", "lightning", cfg.model.name, cfg.data.name, cfg.probe.name,
                                f"layer={k}")
                for t in todo[k]:
                    rows, y = targets[t]
                    key = rows.tobytes()
                    if key not in banks:
                        bank_rows, parts, copied = training_rows(rows, split, copies, len(labels))
                        order = np.arange(len(bank_rows))       # label order: the training part permuted for a null
                        if cfg.shuffle_labels:
                            order[parts["train"]] = shuffled_positions(parts["train"], int(cfg.seed))
                        banks[key] = (HeadBank(template, features.subset(bank_rows), all_labels[bank_rows][order],
                                               parts["train"], _calibration_folds(cfg), int(cfg.seed), _share_folds(cfg)),
                                      parts, copied, order)
                    bank, parts, copied, order = banks[key]
                    with trainer_logging(cfg.trainer.logger, fits_log):
                        cell, heads = task_cell(cfg, t, bank, np.concatenate([y, y[copied]])[order], parts,
                                                head_classes(t), k, split.summary(),
                                                feature_summary(cfg, kind, features) if store is None else
                                                store_summary(store))
                    cell["metrics"].update(datapack_metrics(cfg.data.name, t, table, rows[parts["test"]],
                                                            cell["test"]["probs"], cfg.seed, cfg.n_boot))
                    if kind != "activations" or cfg.shuffle_labels:
                        cell["method"].update(features=kind, shuffle_labels=bool(cfg.shuffle_labels))
                    if augment is not None:
                        cell["method"]["augment"] = augment.kind
                        cell["augment"] = {**note, "n_training_inputs": int(len(copied))}
                    if not write_probe_cell(paths[t, k], cell, heads, overwrite=bool(cfg.overwrite)):
                        log.info("%s was written meanwhile by another run with the same settings: kept", paths[t, k])
                    elif tracker is not None:
                        tracker.log_cell(paths[t, k])
    return [paths[t, k] for k in layers for t in tasks]


def feature_kind(cfg: DictConfig, template: Probe) -> str:
    """The run's `features` (probes.controls.FEATURES), refused in one line where it cannot be combined: the
    controls' features are one vector per statement (no token bags), no augmentation."""
    kind = check_choice("features", cfg.features, FEATURES)
    if kind != "activations" and template.representation == "bags":
        raise ProbeError(f"features={kind} gives one vector per statement, which probe={cfg.probe.name} cannot read "
                         "(it reads token bags): use probe=linear, mlp, mean_diff or random_direction")
    if kind != "activations" and cfg.get("augment") is not None:
        raise ProbeError(f"features={kind} with augment={cfg.augment.kind}: augmentation adds activations of "
                         "contexts; drop one of the two")
    if cfg.shuffle_labels and cfg.get("augment") is not None:
        raise ProbeError("shuffle_labels=true with augment: the null is defined for the plain training set")
    return kind


def control_features(cfg: DictConfig, kind: str, table: pd.DataFrame, split) -> Features | None:
    """The statements' features of a control (probes.controls), None for activations (read per layer)."""
    statements = table["statement"].tolist()
    if kind == "text":
        features = text_features(statements, split.train)
    elif kind == "surprisal":
        features = surprisal_features(cfg.model, statements,
                                      Path(cfg.results_dir, cfg.model.name, cfg.data.name, "surprisal"),
                                      overwrite=bool(cfg.overwrite))
    else:
        return None
    features.groups = entity_groups(table)
    return features


def feature_summary(cfg: DictConfig, kind: str, features: Features) -> dict:
    """A control cell's `store` block: what its features were (no store was read)."""
    return {"features": kind, "hidden_size": int(features.X.shape[1]), "n_layers": None,
            "model_label": None if kind == "text" else cfg.model.name}


def augmented_features(augment: Augmentation, store: ActivationStore, split, layer: int, template: Probe,
                       features: Features, datapack: str) -> tuple[Features, np.ndarray, dict]:
    """(the N clean statements' features followed by the A augmented inputs' (grouped with their statement),
    int [A] the clean row of each augmented input, the cells' `augment` record); the inputs extracted at
    `layer` first if their store is not complete (probes.augment)."""
    extra = augment.store(store, split, layer, datapack)
    more = layer_features(extra, layer, template.representation, template.tokens)
    copies = augment.frame["target_row"].to_numpy(dtype=np.int64)
    more.groups, more.negation = features.groups[copies], features.negation[copies]
    more.pair = np.full(len(copies), -1, dtype=np.int64)   # a copy is no statement's contrast partner
    return features.extend(more), copies, augment.summary(extra)


def training_rows(rows: np.ndarray, split, copies: np.ndarray, n: int) -> tuple[np.ndarray, dict, np.ndarray]:
    """The statements a task's bank holds: its rows (int [M] of the N clean statements), then the augmented
    inputs (rows n + i of the features) whose clean row copies[i] is one of them, which join the training
    part. Returns (bank rows [M + A'], the parts' positions among them, int [A'] the position among `rows`
    of each of those inputs' statement); without augmented inputs, (rows, the split's parts, [])."""
    parts = {name: _positions(rows, getattr(split, name)) for name in ("train", "calibration", "test")}
    kept = np.flatnonzero(np.isin(copies, rows))
    parts["train"] = np.concatenate([parts["train"], len(rows) + np.arange(len(kept))])
    position = pd.Series(np.arange(len(rows)), index=rows)
    return np.concatenate([rows, n + kept]), parts, position[copies[kept]].to_numpy(dtype=np.int64)


_SPLITS: dict[tuple, object] = {}


def split_of(store: ActivationStore, options: DictConfig):
    """make_split of the store's table, computed once per process for each (store file, its mtime,
    split options): a sweep worker runs many one-layer jobs of the same store."""
    key = (str(Path(store.path).resolve()), Path(store.path).stat().st_mtime_ns,
           json.dumps(OmegaConf.to_container(options, resolve=True), sort_keys=True))
    if key not in _SPLITS:
        _SPLITS.clear()
        _SPLITS[key] = make_split(store.table, **options)
    return _SPLITS[key]


def task_names(cfg: DictConfig) -> list[str]:
    """The run's tasks: `tasks=[...]` (several tasks sharing each layer's heads) or the `task` group."""
    option, tasks = ("task", [cfg.task.name]) if cfg.get("tasks") is None else ("tasks", list(cfg.tasks))
    for t in tasks:
        check_choice(option, t, TASKS)
    return list(dict.fromkeys(tasks))


def head_classes(task: str) -> list[int]:
    """The label-column classes whose heads a task uses: one per class for multiclass, else the
    positive class."""
    return [FALSE, TRUE, NEITHER] if task == "multiclass" else [POSITIVE[task]]


def method_name(cfg: DictConfig) -> str:
    """The cells' folder (evaluation.cells.method_name): the probe name, +structure_aware / +neutral for an
    augmented fit, +out_of_fold / +in_sample / +reference for the non-default calibration / conformal
    procedures."""
    base = cfg.probe.name if cfg.get("features", "activations") == "activations" else f"{cfg.probe.name}+{cfg.features}"
    base = base if cfg.get("augment") is None else f"{base}+{cfg.augment.kind}"
    base = f"{base}+shuffled" if cfg.get("shuffle_labels") else base
    return cells.method_name(base, check_choice("calibration", cfg.calibration, CALIBRATIONS),
                             check_procedure(cfg.conformal.name, cfg.mondrian))


def probe_cell_path(cfg: DictConfig, layer: int, task: str | None = None) -> Path:
    return cells.cell_path(cfg.results_dir, cfg.model.name, cfg.data.name, method_name(cfg), task or cfg.task.name,
                     cfg.split.kind, layer, cfg.seed)


def _calibration_folds(cfg: DictConfig) -> int:
    return int(cfg.calibration_folds) if cfg.calibration.startswith("out_of_fold") else 0


def _share_folds(cfg: DictConfig) -> bool:
    return cfg.calibration == "out_of_fold_cv"


def task_cell(cfg: DictConfig, task: str, bank: HeadBank, y: np.ndarray, parts: dict[str, np.ndarray],
              classes: list[int], layer: int | None = None, split: dict | None = None,
              store: dict | None = None) -> tuple[dict, list[Probe]]:
    """One task's cell at one layer from the bank's heads of `classes`: scores -> probabilities (map
    fitted on out-of-fold training scores, or in sample) -> conformal sets -> metrics on test.
    Returns the cell and the task's fitted heads (saved beside it by probes.saved_pair)."""
    train, cal, test = parts["train"], parts["calibration"], parts["test"]
    started = time.perf_counter()
    fitted = calibrated_heads(bank, classes, y, cal, OmegaConf.to_container(cfg.probe, resolve=True), cfg.calibration,
                              cfg.alpha, cfg.conformal.name, cfg.mondrian)
    heads, scores = fitted.heads, bank.scores(classes)  # scores [M, heads]
    probs = fitted.score_map.predict_proba(scores)
    out = fitted.from_scores(scores[test])
    sets, pred = out["sets"], out["pred"]
    n_classes = int(y.max()) + 1
    metrics = cell_metrics(y[test], scores[test], probs[test], pred, sets, seed=cfg.seed, n_boot=cfg.n_boot,
                           groups=resampling_groups(cfg.bootstrap, bank.features.groups[test]))
    targets = list(range(n_classes)) if n_classes > 2 else [1]
    params = {str(c): probe.params() for c, probe in zip(targets, heads)}
    reasons = degenerate_reasons(params, scores[train], metrics)
    edges = [r for r in reasons if r.startswith("C_at_grid_edge")]
    if len(edges) < len(reasons):
        log.warning("%s %s: degenerate fit (%s): its metrics describe a constant or a one-label probe",
                    cfg.probe.name, task, "; ".join(r for r in reasons if r not in edges))
    if edges:
        log.warning("%s %s: %s: C was chosen at the end of its grid, which could not be extended further "
                    "(the bound probe.C_limits, or C_limits=null): wider limits may hold a better C",
                    cfg.probe.name, task, "; ".join(edges))
    cell = cells.result_cell(
        config=cell_config(cfg, task),
        method={"name": method_name(cfg), "probe": cfg.probe.name, "calibration": cfg.calibration,
                "conformal": cfg.conformal.name},
        layer=layer, split=split, metrics=metrics, store=store,
        degenerate=bool(reasons),  # see degenerate_reasons: its metrics are not a healthy probe's
        degenerate_reasons=reasons,
        calibration_metrics={"mcc_all": mcc(y[cal], plain_prediction(probs[cal])),
                             "auroc": raw_auroc(y[cal], scores[cal])},
        probe_params=params, calibration=fitted.calibration, conformal=fitted.conformal.to_dict(),
        fit_seconds=time.perf_counter() - started,  # heads another task of the layer fitted first cost 0 here
        test=cells.cell_test(test, y[test], bank.features.groups[test], scores[test], probs[test], sets, pred))
    return cell, heads


def cell_config(cfg: DictConfig, task: str) -> dict:
    """The `config` a cell of `task` records: the run's resolved options, its task, the probe named as its
    method (a report tells <probe>+in_sample / +reference cells apart), model and datapack by name only
    (the store summary records the model itself)."""
    config = OmegaConf.to_container(cfg, resolve=True)
    config.pop("tasks", None)
    config["task"] = {"name": task}
    config["probe"]["name"] = method_name(cfg)
    return {**config, "model": {"name": cfg.model.name}, "data": {"name": cfg.data.name}}


def degenerate_reasons(params: dict[str, dict], train_scores: np.ndarray, metrics: dict) -> list[str]:
    """Why a task's fit is not a healthy probe (empty when it is): "zero_weights" (a head with ||w|| ~ 0),
    "constant_scores" (a head's training scores [n, heads] all equal), "single_label_accepted" (its
    conformal sets accept one label only, so MCC on the accepted rows is 0 whatever the scores),
    "C_at_grid_edge:lower" / ":upper" (a head's C chosen by CV sits on the edge of its searched grid: the
    grid was extended up to its bound C_limits, or not at all, and may not hold the best C), each reason once."""
    reasons = []
    if any(p.get("degenerate", False) for p in params.values()):
        reasons.append("zero_weights")
    if bool((np.ptp(train_scores, 0) == 0).any()):
        reasons.append("constant_scores")
    if metrics.get("single_label_accepted"):
        reasons.append("single_label_accepted")
    for p in params.values():
        edge = grid_edge(p)
        if edge and f"C_at_grid_edge:{edge}" not in reasons:
            reasons.append(f"C_at_grid_edge:{edge}")
    return reasons


def grid_edge(params: dict) -> str | None:
    """"lower" / "upper" when a head's C was chosen by CV over `Cs` (params record both and the CV
    scores) and is the grid's smallest / largest value, else None."""
    Cs, C = params.get("Cs"), params.get("C")
    if not Cs or C is None or len(Cs) < 2 or not (params.get("cv_loss") or params.get("cv_auroc")):
        return None
    return "lower" if C == min(Cs) else "upper" if C == max(Cs) else None


def make_probe(cfg: DictConfig) -> Probe:
    """A fresh, unfitted probe from the `probe:` config (probes.artifacts.build_probe: `_target_` a
    Probe class of this package, the other keys its constructor arguments, nested options refused),
    on the trainer's accelerator."""
    options = OmegaConf.to_container(cfg.probe, resolve=True)
    check_name(options.get("name"), "probe.name")
    return build_probe(options, cfg.trainer.accelerator)


def _positions(rows: np.ndarray, split_rows: np.ndarray) -> np.ndarray:
    """Positions within `rows` (the task's statements) of the split's statements, in rows' order."""
    return np.flatnonzero(np.isin(rows, split_rows))
