"""`python -m ncb`: Neighbour-Consistency Belief of one method on one datapack, and its stress tests.

1. The method (ncb.methods) gives each statement of its task P(y), the probability of its correct label.
2. Targets = the task's scored statements with at least one neighbour (ncb.neighbourhoods; the others
   are counted and skipped); ncb and ncb_arith of each; valid = the plain prediction (argmax) is right.
3. Stress inputs (contexts.interference) for every test target; the high / low groups at each fraction are
   drawn from the valid test targets that have stress inputs.
4. Each (interference, level): accuracy of the method's plain prediction on the perturbed inputs of
   each group, its drop from the clean accuracy (1 for valid targets, so drop = 1 - accuracy), the
   gap high - low, with cluster-bootstrap 95 % intervals resampling subject entities (ncb.stress).
5. method=zero_shot: the other settings of `zero_shot.settings` (ncb.settings: chain of thought,
   reflection) on the group pool's clean statements and stress inputs, and the self-consistency of
   every setting (ncb.self_consistency).

Options are checked first (ncb.schema: types, booleans, ranges, templates, a writable results_dir).
Outputs, `<results_dir>/<model>/<datapack>/ncb/<method>/`, written atomically and skipped when all
exist (overwrite=true recomputes them, and re-extracts the stress store):

    targets.json  [{row, part, y, p_y, neighbour_rows, neighbour_p, ncb, ncb_arith, valid, group}, ...]
                  (group: {"0.05": "high" | "low" | null, "0.2": ..., "0.35": ...})
    stress.json   {method, model, datapack, info, split, options, counts (test_neighbourhood_sizes: {number of
                  neighbours: test targets}), notes, provenance, results: [{interference, level,
                  fraction, high: {n, n_entities, p_y_mean, ncb_mean, clean_accuracy, accuracy,
                  accuracy_ci, drop, drop_ci}, low: {...}, gap, gap_ci, gap_p}, ...]}
    inputs.csv    one row per stress input: target_row, entity (its object_1), interference, level, p_y (the
                  probability of the target's correct label under that context), correct (plain prediction)
    stress-<setting>.json, inputs-<setting>.csv, self_consistency.json   method=zero_shot (ncb.settings)
"""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pandas as pd
from omegaconf import DictConfig, OmegaConf

from evaluation.cells import write_json, write_record
from toolkit.errors import check_name
from contexts.interference import perturbations
from ncb.methods import Method, load_method, resolve
from ncb.neighbourhoods import PARTS, ncb_scores, neighbourhoods, part_of_rows, select_groups
from ncb.schema import validate
from ncb.settings import output_paths, run_settings
from ncb.stress import stress_results, write_csv

log = logging.getLogger(__name__)


def run(cfg: DictConfig) -> list[Path]:
    """Compute (or keep) targets.json, stress.json and inputs.csv of `method=`; returns their paths."""
    cfg = validate(cfg)                       # every option typed and in range before any work
    fractions = list(cfg.fractions)
    name, cell = resolve(cfg)
    out = Path(cfg.results_dir) / check_name(cfg.model.name, "model.name") / check_name(cfg.data.name, "data.name") \
        / "ncb" / name
    paths = [out / "targets.json", out / "stress.json", out / "inputs.csv"]
    paths += output_paths(cfg, out) if cell is None else []
    if all(p.exists() for p in paths) and not cfg.overwrite:
        log.info("%s exists (overwrite=true recomputes it)", out)
        return paths
    method = load_method(cfg, cell, out)
    targets = belief_targets(method, float(cfg.clip))
    test = targets[targets["part"] == "test"]
    frame = perturbations(method.table, test["row"].to_numpy(), OmegaConf.to_container(cfg.stress.interferences),
                          str(cfg.stress.neutral))
    log.info("%d stress inputs for %d test targets", len(frame), frame["target_row"].nunique())
    stress_probs, notes = method.score_stress(frame)
    by_row = targets.set_index("row")
    y = by_row.loc[frame["target_row"], "y"].to_numpy()
    correct = np.argmax(stress_probs, axis=1) == y
    inputs = pd.DataFrame({"target_row": frame["target_row"].to_numpy(),
                           "entity": method.table["object_1"].to_numpy()[frame["target_row"].to_numpy()],
                           "interference": frame["interference"].to_numpy(), "level": frame["level"].astype(str),
                           "p_y": stress_probs[np.arange(len(y)), y], "correct": correct})
    pool = test[test["valid"] & test["row"].isin(frame["target_row"])]
    groups = {f: tuple(pool["row"].to_numpy()[g] for g in select_groups(
        pool["ncb"].to_numpy(), pool["p_y"].to_numpy(), f, bool(cfg.balance_by_py), int(cfg.n_bins)))
        for f in fractions}
    sides = {f"{f:g}": {**{int(r): "low" for r in lo}, **{int(r): "high" for r in h}} for f, (h, lo) in groups.items()}
    targets["group"] = [{f: side.get(int(r)) for f, side in sides.items()} for r in targets["row"]]
    results = stress_results(frame, correct, groups, by_row, method.table["object_1"].to_numpy(), cfg)
    summary = {"method": name, "model": cfg.model.name, "datapack": cfg.data.name, "info": method.info,
               "split": method.split.summary(),
               "options": {k: OmegaConf.to_container(cfg, resolve=True)[k]
                           for k in ("fractions", "balance_by_py", "n_bins", "clip", "n_boot", "seed", "stress")},
               "counts": {**method_counts(method, targets), "test_targets": int(len(test)),
                          "stress_inputs": int(len(frame)), "stress_targets": int(frame["target_row"].nunique()),
                          "group_pool": int(len(pool)),
                          "test_neighbourhood_sizes": neighbourhood_sizes(test)},
               "notes": notes, "results": results}
    outputs = {paths[0]: (write_json, targets.to_dict(orient="records")),
               paths[1]: (write_record, summary, OmegaConf.to_container(cfg, resolve=True)),
               paths[2]: (write_csv, inputs)}
    if cell is None:                          # zero-shot: the other settings and self-consistency
        outputs.update(run_settings(method, cfg, frame, pool, by_row, groups, correct, out))
    for path, (write, *arguments) in outputs.items():
        write(path, *arguments)
    return paths


def belief_targets(method: Method, clip: float) -> pd.DataFrame:
    """One row per target (scored task statement with a neighbour): row, part, y, p_y, neighbour_rows,
    neighbour_p, ncb, ncb_arith, valid (argmax right)."""
    scored = ~np.isnan(method.probs).any(1)
    rows, y, probs = method.rows[scored], method.y[scored], method.probs[scored]
    p_y = probs[np.arange(len(rows)), y]
    position = pd.Series(np.arange(len(rows)), index=rows)
    parts = part_of_rows(method.split)
    neighbours = neighbourhoods(method.table["object_1"].to_numpy(), parts, rows)
    neighbour_p = [p_y[position[n].to_numpy()] for n in neighbours]
    geo, arith = ncb_scores(p_y, neighbour_p, clip)
    keep = np.array([len(n) > 0 for n in neighbours], dtype=bool)
    log.info("%d targets, %d without neighbours skipped", int(keep.sum()), int((~keep).sum()))
    frame = pd.DataFrame({"row": rows, "part": [PARTS[p] if p >= 0 else "dropped" for p in parts[rows]], "y": y,
                          "p_y": p_y, "neighbour_rows": [n.tolist() for n in neighbours],
                          "neighbour_p": [p.tolist() for p in neighbour_p], "ncb": geo, "ncb_arith": arith,
                          "valid": np.argmax(probs, axis=1) == y})
    return frame[keep].reset_index(drop=True)


def neighbourhood_sizes(targets: pd.DataFrame) -> dict[str, int]:
    """{number of neighbours: number of targets}, ascending: how many statements each NCB averages over
    (a one-neighbour NCB is P(y) times a single other statement's p, not a neighbourhood mean)."""
    sizes = np.bincount([len(n) for n in targets["neighbour_rows"]])
    return {str(k): int(c) for k, c in enumerate(sizes) if c}


def method_counts(method: Method, targets: pd.DataFrame) -> dict:
    scored = int((~np.isnan(method.probs).any(1)).sum())
    return {"task_rows": int(len(method.rows)), "not_scored": int(len(method.rows)) - scored,
            "no_neighbour": scored - int(len(targets)), "targets": int(len(targets)),
            "valid": int(targets["valid"].sum())}
