"""Zero-shot evaluation: any N x 7 option-probability file (zero_shot/scoring.py) -> result cells.

Evaluation
----------
Options map to classes: false = option 2, true = option 1, neither = options 3 + 4, abstain =
options 5 + 6 (the remaining mass is ignored). Class probabilities are the false / true /
neither group masses normalised to sum to one. Two modes:

- ``argmax``: the largest of the four groups false / true / neither / abstain; abstain when the
  abstain group wins;
- ``conformal``: split-conformal sets (:class:`evaluation.conformal.ConformalClassifier`, alpha,
  optionally Mondrian) calibrated on the calibration rows of ``split=``; abstain on empty or
  multi-label sets. With ``conformal=reference`` the reference's procedure instead
  (:class:`evaluation.conformal.ReferenceConformal`): multiclass has four classes (abstain is class
  3), the margin score on the UNNORMALISED group masses, p-values, and tie-breaking that turns a
  multi-label set into 0 or 1 (``p_0 > p_1``); a set {3} is an accepted prediction 3, so it enters
  MCC and acceptance as the reference counts it. Binary tasks (the reference evaluates zero-shot
  only as multiclass) use the same procedure on the task's two class probabilities. These cells go
  to ``zero_shot_<enumeration>_conformal+reference``.

Both are evaluated on the split's test rows (:func:`evaluation.metrics.evaluate`: MCC, W-MCC,
acceptance, AUROC, ...). Tasks: ``multiclass`` and, from the same probabilities,
``true_vs_all`` / ``false_vs_all`` / ``neither_vs_all`` (positive-class probability = that class's
normalised probability; argmax: positive iff that class's group wins) and ``true_vs_false``
(real entities only; p = true / (true + false); argmax: a winning neither group counts as an
abstention). One cell per (enumeration, mode, task), written with
:func:`evaluation.cells.write_cell` to::

    <results_dir>/<model>/<datapack>/zero_shot_<enumeration>_<mode>/<task>/<split>/layer=none/seed=<seed>.json

Any ``N x 7`` file can be evaluated the same way (``scores=``), e.g. the reference's published
``outputs/probes/prompt/<variation>/<model>/<file>/scores.npy`` (one file per source CSV; give
the folder ``.../<variation>/<model>`` or the files in datapack order). Each file's row count must
equal its source file's, and a ``targets.npy`` beside a ``scores.npy`` (the reference writes the
source's ``correct`` column there) must equal that column: files in the wrong order are refused.
Existing cells are kept unless ``overwrite=true`` (which also recomputes a computed score file;
``scores=<that file> overwrite=true`` re-evaluates only).
"""
from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import numpy as np
import pandas as pd
from omegaconf import DictConfig, OmegaConf

from evaluation.cells import cell_path, cell_test, method_name, result_cell, write_cell
from evaluation.conformal import (ConformalClassifier, ReferenceConformal, acceptance_by_label, binary_probs,
                                  check_procedure, prediction)
from evaluation.metrics import ABSTAIN, evaluate, resampling_groups
from evaluation.splits import entity_groups, make_split
from evaluation.tasks import POSITIVE, TASKS, task_targets
from toolkit.errors import check_count
from extract.statements import DATA_DIR, FALSE, NEITHER, TRUE, datapack_table
from zero_shot.schema import validate
from zero_shot.scoring import N_COLUMNS, ZeroShotError, compute_scores

log = logging.getLogger(__name__)

MODES = ("argmax", "conformal")
# 0-based option columns of each group; group order = class codes 0 false, 1 true, 2 neither, then abstain
GROUPS = (("false", (1,)), ("true", (0,)), ("neither", (2, 3)), ("abstain", (4, 5)))
ABSTAIN_GROUP = 3


def group_masses(scores: np.ndarray) -> np.ndarray:
    """[N, 7] option probabilities -> [N, 4] masses of false / true / neither / abstain."""
    return np.stack([scores[:, list(cols)].sum(1) for _, cols in GROUPS], axis=1)


def class_probs(scores: np.ndarray) -> np.ndarray:
    """[N, 7] -> [N, 3] false / true / neither masses normalised to sum 1 (uniform if all are 0)."""
    g = group_masses(scores)[:, :3].astype(np.float64)
    total = g.sum(1, keepdims=True)
    return np.where(total > 0, g / np.where(total > 0, total, 1.0), 1.0 / 3.0)


def argmax_prediction(scores: np.ndarray) -> np.ndarray:
    """[N, 7] -> int [N]: 0 false / 1 true / 2 neither, -1 when the abstain group is largest."""
    w = np.argmax(group_masses(scores), axis=1)
    return np.where(w == ABSTAIN_GROUP, ABSTAIN, w).astype(np.int64)


def task_view(scores: np.ndarray, task: str) -> tuple[np.ndarray, np.ndarray]:
    """Probabilities the task evaluates ([N, 3] multiclass, [N, 2] binary) and the argmax
    prediction with abstentions (int [N]); rows are all of `scores` (select the task's after)."""
    p3 = class_probs(scores)
    pred3 = argmax_prediction(scores)
    if task == "multiclass":
        return p3, pred3
    if task != "true_vs_false" and task in POSITIVE:
        c = POSITIVE[task]
        return binary_probs(p3[:, c]), np.where(pred3 == ABSTAIN, ABSTAIN, (pred3 == c).astype(np.int64))
    if task == "true_vs_false":
        tf = p3[:, TRUE] + p3[:, FALSE]
        p = np.where(tf > 0, p3[:, TRUE] / np.where(tf > 0, tf, 1.0), 0.5)
        pred = np.where((pred3 == ABSTAIN) | (pred3 == NEITHER), ABSTAIN, (pred3 == TRUE).astype(np.int64))
        return binary_probs(p), pred
    raise ZeroShotError(f"unknown task {task!r}: choose from {', '.join(TASKS)}")


def resolve_score_files(spec, table) -> list[Path]:
    """`scores=`: one .npy, a list of them (concatenated), or a folder holding <source>/scores.npy
    for each source file of the datapack (the reference's published layout)."""
    items = [spec] if isinstance(spec, (str, Path)) else list(spec)
    if len(items) == 1 and Path(items[0]).is_dir():
        folder = Path(items[0])
        sources = [Path(s).stem for s in dict.fromkeys(table["source_file"])]
        files = [folder / s / "scores.npy" for s in sources]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ZeroShotError(f"{folder} lacks {', '.join(missing)}: give the score files themselves")
        return files
    files = [Path(str(x)) for x in items]
    for f in files:
        if not f.is_file():
            raise ZeroShotError(f"score file {f} not found")
    return files


def load_scores(files: list[Path], table) -> np.ndarray:
    """Concatenate score files -> float32 [N, 7] aligned with the datapack's rows.

    One file for the whole datapack, or one per source file in datapack order: each file's rows
    must number its source's, and a `targets.npy` beside a file must equal its source's `correct`
    column. A row of NaN is a statement that was not scored (limit, rows=heldout); any other NaN,
    an inf or a negative option probability is refused.
    """
    counts = table["source_file"].value_counts(sort=False)
    per_file = ", ".join(f"{k} {v}" for k, v in counts.items())
    if len(files) not in (1, len(counts)):
        raise ZeroShotError(f"{len(files)} score files for {len(counts)} source files ({per_file}): give one "
                            "file for the whole datapack or one per source file, in this order")
    parts = []
    for i, f in enumerate(files):
        try:
            a = np.load(f, allow_pickle=False)
        except (OSError, ValueError) as err:
            raise ZeroShotError(f"{f}: not a readable .npy file ({str(err).splitlines()[0]})") from None
        if a.ndim != 2 or a.shape[1] != N_COLUMNS:
            raise ZeroShotError(f"{f}: expected an N x {N_COLUMNS} array (six options + remaining mass), "
                                f"got shape {a.shape}")
        if len(files) == len(counts):  # one file per source: check it against its source
            source = counts.index[i]
            if a.shape[0] != counts.iloc[i]:
                raise ZeroShotError(f"{f} has {a.shape[0]} rows but source file {source} has {counts.iloc[i]} "
                                    f"({per_file}): give one file per source file, in this order")
            _check_targets(Path(f).with_name("targets.npy"), source)
        parts.append(a.astype(np.float32))
    scores = np.concatenate(parts)
    if scores.shape[0] != len(table):
        raise ZeroShotError(f"scores have {scores.shape[0]} rows but the datapack has {len(table)} "
                            f"({per_file}): give one file per source file, in this order")
    nan = np.isnan(scores)
    if (nan.any(1) & ~nan.all(1)).any() or np.isinf(scores).any():
        raise ZeroShotError(f"{files[0]}: scores contain inf or partly-NaN rows")
    if np.nanmin(scores[:, :6], initial=0.0) < -1e-3:
        raise ZeroShotError(f"{files[0]}: scores contain negative probabilities")
    return np.where(nan, np.nan, np.clip(scores, 0.0, None)).astype(np.float32)


def _check_targets(path: Path, source: str) -> None:
    """A `targets.npy` (the reference's copy of the source's `correct` column) must equal that column
    of the vendored source file; nothing to check without either."""
    source_path = DATA_DIR / source
    if not path.is_file() or not source_path.is_file():
        return
    raw = pd.read_csv(source_path, dtype=str, keep_default_na=False)
    if "correct" not in raw:
        return
    correct = raw["correct"].str.strip().str.lower().isin(["true", "1"]).to_numpy()
    try:
        targets = np.load(path, allow_pickle=False).ravel().astype(bool)
    except (OSError, ValueError) as err:
        raise ZeroShotError(f"{path}: not a readable .npy file ({str(err).splitlines()[0]})") from None
    if targets.shape != correct.shape or not np.array_equal(targets, correct):
        differ = int((targets != correct).sum()) if targets.shape == correct.shape else "all"
        raise ZeroShotError(f"{path} does not match the `correct` column of {source} ({differ} of {len(correct)} "
                            "rows differ): these scores belong to another source file; give the files in "
                            "datapack order")


def _sha256_file(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def evaluate_scores(cfg: DictConfig, scores: np.ndarray, table, source: dict) -> list[Path]:
    """Write one result cell per (task, mode) from [len(table), 7] scores (NaN rows = not scored).

    The split is that of the whole table (the probes' split). Every test row (and, for
    conformal, calibration row) of the task must be scored, except that with limit=N only
    the split's rows among the first N statements are used.
    """
    modes, tasks = _modes_tasks(cfg)
    scored = ~np.isnan(scores).any(1)
    limit = check_count(cfg.get("limit"), "limit", none_ok=True) or len(table)
    split = make_split(table, **cfg.split)
    groups = entity_groups(table)   # subject entities: the cluster-bootstrap unit
    labels = table["label"].to_numpy()
    config = OmegaConf.to_container(cfg, resolve=True)
    if source.get("kind") == "external":
        config["model"] = {"name": cfg.model.name}
    filled = np.where(scored[:, None], scores, 0.0)
    paths = []
    for task in tasks:
        probs_all, argmax_all = task_view(filled, task)
        rows, y = task_targets(labels, task)
        keep = rows < limit
        rows, y = rows[keep], y[keep]
        parts = {name: np.flatnonzero(np.isin(rows, getattr(split, name))) for name in ("calibration", "test")}
        for name in ("test", "calibration") if "conformal" in modes else ("test",):
            missing = int((~scored[rows[parts[name]]]).sum())
            if missing:
                raise ZeroShotError(f"{missing} {name} rows of the {split.kind} split (seed {split.seed}) have no "
                                    "scores: score them (rows=all, or rows=heldout with this split)")
        if len(parts["test"]) == 0:
            raise ZeroShotError(f"no test row of the {split.kind} split among the first {limit} statements: "
                                "score more statements (a larger limit)")
        probs = probs_all[rows]
        test, cal = parts["test"], parts["calibration"]
        for mode in modes:
            path = zero_shot_cell_path(cfg, mode, task)
            if path.exists() and not cfg.overwrite:
                log.info("%s exists (overwrite=true recomputes it)", path)
                paths.append(path)
                continue
            conformal, sets, cell_probs = None, None, probs[test]
            if mode == "argmax":
                pred = argmax_all[rows][test]
            elif cfg.conformal.name == "reference":
                # multiclass: the four unnormalised group masses (abstain = class 3); binary: the task's probabilities
                values = group_masses(filled)[rows].astype(np.float64) if task == "multiclass" else probs
                conformal = ReferenceConformal("margin", values.shape[1], tie_breaking=True).fit(values[cal], y[cal],
                                                                                                alpha=cfg.alpha)
                sets, pred = conformal.predict_sets(values[test]), conformal.predict(values[test])
                total = values[test].sum(1, keepdims=True)
                cell_probs = np.where(total > 0, values[test] / np.where(total > 0, total, 1.0), 1.0 / values.shape[1])
            else:
                conformal = ConformalClassifier().fit(probs[cal], y[cal], alpha=cfg.alpha, mondrian=cfg.mondrian)
                sets = conformal.predict_sets(probs[test])
                pred = prediction(sets)
            metrics = evaluate(y[test], pred, cell_probs, sets=sets, seed=cfg.seed, n_boot=cfg.n_boot,
                               groups=resampling_groups(cfg.bootstrap, groups[rows[test]]))
            metrics.update(acceptance_by_label(pred, cell_probs.shape[1]))
            name = zero_shot_method(cfg, mode)
            cell = result_cell(
                # probe / task / layer as in the probes' cells, so a report can treat both alike
                config={**config, "probe": {"name": name}, "task": {"name": task}, "layer": None},
                method={"name": name, "enumeration": cfg.enumeration, "mode": mode, "task": task,
                        "conformal": cfg.conformal.name if mode == "conformal" else None,
                        "groups": {g: [c + 1 for c in cols] for g, cols in GROUPS}},
                layer=None, split=split.summary(), metrics=metrics,
                conformal=conformal.to_dict() if conformal is not None else None,
                scores_source=source, n_scored=int(scored.sum()),
                test=cell_test(test, y[test], groups[rows[test]], scores[rows[test]].astype(float), cell_probs, sets,
                               pred, table_rows=rows[test]))
            if mode == "argmax":  # no calibration involved: the same rule on every scored row of the task
                ok = scored[rows]
                cell["metrics_all_scored_rows"] = evaluate(y[ok], argmax_all[rows][ok], probs[ok], seed=cfg.seed,
                                                           groups=resampling_groups(cfg.bootstrap, groups[rows[ok]]),
                                                           n_boot=cfg.n_boot)
            write_cell(path, cell)
            paths.append(path)
            if task == "multiclass":
                log.info("%s %s: MCC %.3f  W-MCC %.3f  acceptance %.3f  (test n=%d)", cell["method"]["name"],
                         task, metrics["mcc"], metrics["wmcc"], metrics["acceptance"], metrics["n"])
    return paths


def _modes_tasks(cfg: DictConfig) -> tuple[list[str], list[str]]:
    """The requested modes and tasks, checked (with the conformal procedure)."""
    modes = [cfg.modes] if isinstance(cfg.modes, str) else list(cfg.modes)
    tasks = [cfg.tasks] if isinstance(cfg.tasks, str) else list(cfg.tasks)
    for m in modes:
        if m not in MODES:
            raise ZeroShotError(f"unknown mode {m!r}: choose from {', '.join(MODES)}")
    check_procedure(cfg.conformal.name, cfg.mondrian)
    return modes, tasks


def zero_shot_method(cfg: DictConfig, mode: str) -> str:
    """zero_shot_<enumeration>_<mode>, +reference for the sets of conformal=reference (evaluation.cells.method_name)."""
    return method_name(f"zero_shot_{cfg.enumeration}_{mode}", conformal=cfg.conformal.name if mode == "conformal" else None)


def zero_shot_cell_path(cfg: DictConfig, mode: str, task: str) -> Path:
    return cell_path(cfg.results_dir, cfg.model.name, cfg.data.name, zero_shot_method(cfg, mode), task,
                     cfg.split.kind, None, cfg.seed)


def run(cfg: DictConfig) -> list[Path]:
    """`python -m zero_shot`: compute (or resume, or reuse) the scores, then write the cells;
    with `scores=...` evaluate those files instead of running the model. Existing cells are kept
    (nothing is scored when every requested cell exists) unless overwrite=true."""
    cfg = validate(cfg)   # types and ranges of every option, before any work
    modes, tasks = _modes_tasks(cfg)
    existing = [zero_shot_cell_path(cfg, m, t) for t in tasks for m in modes]
    if cfg.get("evaluate", True) and not cfg.overwrite and all(p.exists() for p in existing):
        log.info("all %d cells exist (overwrite=true recomputes them)", len(existing))
        return existing
    table = datapack_table(cfg.data)
    if cfg.get("scores"):
        files = resolve_score_files(cfg.scores, table)
        scores = load_scores(files, table)
        source = {"kind": "external", "files": [str(f) for f in files],
                  "sha256": [_sha256_file(f) for f in files]}
    else:
        path = compute_scores(cfg)
        if not cfg.get("evaluate", True):
            return [path]
        scores = load_scores([path], table)
        meta = json.loads(path.with_suffix(".json").read_text())
        source = {"kind": "computed", "files": [str(path)], "sha256": [_sha256_file(path)],
                  "meta": {k: meta[k] for k in ("signature", "model_label", "prompt", "option_tokens",
                                                "batch_size", "rows", "prefix_tokens", "seconds") if k in meta}}
    return evaluate_scores(cfg, scores, table, source)
