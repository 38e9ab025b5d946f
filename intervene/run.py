"""`python -m intervene`: does the model use a probe's direction? Push the residual stream along it and read what
the model then says, against random directions of the same norm.

1. The probe of `cell=` (a binary task's result cell of this model and datapack) gives its direction w [d] in the
   model's coordinates (`coef_`: standardisation undone); v = w / |w|, oriented towards the task's class 1.
2. The dose unit s: the standard deviation of the projection x . v over the training statements' tokens of the
   cell's split at its layer (every statement token, or each statement's last one with `at=last`). A push of
   alpha adds alpha * s * u at the steered positions, for every direction u (unit vectors):
     probe             v;
     probe_orthogonal  v with its component along the mean-difference direction (the training class means'
                       difference at that layer) removed, renormalised: does the probe's direction act beyond
                       the class-mean difference? (absent where v is within 1e-3 of it);
     random_<j>        `n_random` Gaussian directions (seed `seed`): the same norm of push, no label chose them.
3. The statements: `n_statements` of the cell's test rows (label-stratified, whole subjects:
   extract.statements.limit_statements; the likelihood readout: up to `n_statements` pairs of all its test rows);
   steered at the statement's tokens (`at=statement`) or its last token.
4. Readouts, each per (direction, alpha) through the one batched scorer (extract.scorer; the shared prefix's
   cache is computed unsteered and never covers a steered position):
     zero_shot   the paper's prompt (zero_shot.prompts), the false / true / neither masses
                 (zero_shot.run.class_probs); readout = log p(class 1) - log p(its rest) of the cell's task;
     likelihood  for each subject with a true and a false affirmative statement of the same wording up to the
                 object ("The city of X is located in"), log P(true object) - log P(false object) after that
                 context (truthfulqa.likelihood's plain encoding), steered at the context's tokens.
5. Effects: steered minus unsteered per item, averaged: `effect[direction][alpha]`; the difference in
   differences probe - mean of the random directions (`did`, and `did_orthogonal`), with 95 % bootstrap intervals
   resampling subject entities and the random directions jointly; the dose-response `slope` (the least-squares
   slope over alpha of probe - random mean), its interval and the verdict it gives; whether the probe's mean
   effect lies outside the random directions' range at each alpha (`outside_random_band`).

Output `<results_dir>/<model>/<datapack>/interventions/<probe>/<task>/<split>/layer=<k>/seed=<s>.json` (written
atomically, with provenance; an existing one is kept unless overwrite=true). Progress is saved after every
(direction, alpha) in `<that>.partial.npz`; a rerun with the same settings continues from it.
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from omegaconf import DictConfig, OmegaConf

from evaluation.cells import check_cell_source, read_cell, write_record

from toolkit.disk import atomic_write
from evaluation.selective import bootstrap_p, cluster_bootstrap_indices
from evaluation.splits import make_split
from evaluation.tasks import task_targets
from toolkit.errors import ToolkitError, check_name
from extract.models import load_model
from extract.scorer import score
from extract.statements import limit_statements
from extract.store import ActivationStore, check_same_model, store_path, store_summary
from intervene.schema import validate
from intervene.steer import SteeredCompletion, SteeredOptions, Steering
from probes.artifacts import load_probe
from probes.features import layer_features
from truthfulqa.likelihood import encode_pair
from zero_shot.prompts import PromptRenderer, get_enumeration, option_token_ids
from zero_shot.run import class_probs
from zero_shot.scoring import PromptScorer

log = logging.getLogger(__name__)
CLASS_OF_TASK = {"true_vs_all": (1, (0, 2)), "false_vs_all": (0, (1, 2)), "neither_vs_all": (2, (0, 1)),
                 "true_vs_false": (1, (0,))}   # (class 1's column of class_probs, its rest's columns)


class InterveneError(ToolkitError):
    """Bad input or settings of `python -m intervene`; one line naming the fix."""


def resolve_cell(cfg: DictConfig) -> tuple[Path, dict]:
    """(the cell's path, the cell), refusing a cell of another model or datapack or of a multiclass task."""
    path = Path(str(cfg.cell))
    if path.suffix != ".json" or not path.is_file():
        raise InterveneError(f"cell={cfg.cell!r}: give a probe's result cell (results/.../layer=<k>/seed=<s>.json)")
    cell = read_cell(path)
    check_cell_source(path, cell, cfg.model.name, cfg.data.name)
    config = cell["config"]
    if config["task"]["name"] not in CLASS_OF_TASK:
        raise InterveneError(f"{path} is a {config['task']['name']} cell (one head per class): give a binary task's "
                             f"cell ({', '.join(CLASS_OF_TASK)})")
    return path, cell


def output_path(cfg: DictConfig, cell: dict) -> Path:
    c = cell["config"]
    return (Path(cfg.results_dir) / check_name(cfg.model.name, "model.name") / check_name(cfg.data.name, "data.name")
            / "interventions" / check_name(c["probe"]["name"], "probe.name") / c["task"]["name"] / c["split"]["kind"]
            / f"layer={int(cell['layer'])}" / f"seed={int(c['seed'])}.json")


def probe_direction(probe, path: Path) -> np.ndarray:
    """float64 [d]: the probe's one direction in the model's coordinates (decision = x . w + b)."""
    head = probe.heads[0]
    w = getattr(head, "coef_", None)
    if w is None or len(probe.heads) != 1:
        raise InterveneError(f"{path}: probe {probe.spec.get('name')!r} has no single direction to push along (a "
                             "nonlinear head): give a cell of linear, mean_diff, samil, ttpd, spca or ccs")
    w = np.asarray(w, dtype=np.float64)
    if not np.isfinite(w).all() or not np.linalg.norm(w) > 0:
        raise InterveneError(f"{path}: the probe's direction is zero or not finite (a degenerate fit): give "
                             "another cell")
    return w


def directions(v: np.ndarray, mean_diff: np.ndarray, n_random: int, seed: int) -> dict[str, np.ndarray]:
    """{name: unit vector float64 [d]}: probe, probe_orthogonal (where it exists), random_0.. (see the module)."""
    out = {"probe": v}
    m = mean_diff / np.linalg.norm(mean_diff)
    rest = v - (v @ m) * m
    if np.linalg.norm(rest) > 1e-3:
        out["probe_orthogonal"] = rest / np.linalg.norm(rest)
    rng = np.random.default_rng(seed)
    for j in range(n_random):
        r = rng.standard_normal(len(v))
        out[f"random_{j}"] = r / np.linalg.norm(r)
    return out


def training_geometry(store: ActivationStore, cell: dict, layer: int, task: str, at: str, v: np.ndarray):
    """(s, the projection's sd over the training statements' tokens (see the module), mean-difference direction
    float64 [d] of the training statements' last tokens, the split)."""
    table = store.table
    split = make_split(table, **cell["config"]["split"])
    if split.fingerprint() != cell.get("split", {}).get("fingerprint", split.fingerprint()):
        raise InterveneError("the store's split differs from the cell's: retrain the probe on this store")
    rows, y = task_targets(table["label"].to_numpy(), task)
    keep = np.isin(rows, split.train)
    rows, y = rows[keep], y[keep]
    last = layer_features(store, layer, "last").X.double().numpy()
    if at == "last":
        tokens = last[rows]
    else:
        bags = layer_features(store, layer, "bags")
        offsets = bags.offsets.numpy()
        tokens = np.concatenate([bags.X[offsets[r]:offsets[r + 1]].double().numpy() for r in rows])
    mean_diff = last[rows[y == 1]].mean(0) - last[rows[y == 0]].mean(0)
    return float(np.std(tokens @ v)), mean_diff, split


def chosen_rows(table: pd.DataFrame, test: np.ndarray, n: int) -> np.ndarray:
    """int [<= n]: test rows (table positions, ascending), label-stratified with whole subjects."""
    sub = table.iloc[test].assign(_row=test)
    return np.sort(limit_statements(sub, n)["_row"].to_numpy())


def statement_positions(tokenizer, text: str, statement: str, ids: np.ndarray, at: str, chat: bool) -> np.ndarray:
    """int [n]: positions in `ids` (the tokenisation of `text`) of the tokens that overlap `statement` (its
    last occurrence in text); at=last: the last of them."""
    start = text.rfind(statement)
    encoded = tokenizer(text, add_special_tokens=not chat, return_offsets_mapping=True)
    if start < 0 or list(encoded["input_ids"]) != ids.tolist():
        raise InterveneError("the prompt's tokens cannot be mapped back to the statement (a slow tokenizer?): "
                             "use a model with a fast tokenizer")
    end = start + len(statement)
    inside = np.array([i for i, (a, b) in enumerate(encoded["offset_mapping"]) if b > start and a < end and b > a])
    return inside[-1:] if at == "last" else inside


def zero_shot_items(loaded, table: pd.DataFrame, rows: np.ndarray, at: str, enumeration: str):
    """(prompt ids per row, steered positions per row, the option ids)."""
    renderer = PromptRenderer(loaded.tokenizer, get_enumeration(enumeration), loaded.use_chat_template)
    seqs, positions = [], []
    for r in rows:
        statement = table["statement"].iat[r]
        ids = renderer.ids(statement)
        seqs.append(ids)
        positions.append(statement_positions(loaded.tokenizer, renderer.text(statement), statement, ids, at,
                                             renderer.use_chat_template))
    return seqs, positions, option_token_ids(loaded.tokenizer, get_enumeration(enumeration).labels)


def likelihood_items(tokenizer, table: pd.DataFrame, rows: np.ndarray, at: str, n_pairs: int):
    """(context + completion ids [2M], steered positions [2M], completion lengths [2M], subject of each pair [M]):
    the first `n_pairs` (by subject) of the pairs among `rows`, each a true and a false affirmative statement of
    one subject with the same context (the text before their object), the true completion first."""
    frame = table.iloc[rows]
    frame = frame[~frame["negation"].astype(bool) & frame["label"].isin([0, 1]) & (frame["object_2"] != "")]
    contexts = [s[: s.rfind(o)].rstrip() if o and s.rfind(o) > 0 else None
                for s, o in zip(frame["statement"], frame["object_2"])]
    frame = frame.assign(context=contexts).dropna(subset=["context"])
    seqs, positions, n_cont, subjects = [], [], [], []
    for (subject, context), g in frame.groupby(["object_1", "context"], sort=True):
        true, false = g[g["label"] == 1], g[g["label"] == 0]
        if true.empty or false.empty or len(subjects) == n_pairs:
            continue
        for row in (true.iloc[0], false.iloc[0]):
            ctx, cont = encode_pair(tokenizer, context, " " + row["object_2"])
            special = set(tokenizer.all_special_ids)
            inside = np.array([i for i, t in enumerate(ctx) if t not in special])
            seqs.append(np.asarray(ctx + cont, dtype=np.int64))
            positions.append(inside[-1:] if at == "last" else inside)
            n_cont.append(len(cont))
        subjects.append(subject)
    return seqs, positions, n_cont, np.asarray(subjects, dtype=object)


def readout_values(kind: str, raw: np.ndarray, task: str) -> np.ndarray:
    """float64 [M]: zero_shot: log p(class 1) - log p(rest) from option probabilities [M, 7]; likelihood:
    log P(true object) - log P(false object) from the pairs' log-likelihoods [2M]."""
    if kind == "likelihood":
        return raw[0::2] - raw[1::2]
    p = class_probs(raw)
    pos, rest = CLASS_OF_TASK[task]
    return np.log(np.clip(p[:, pos], 1e-12, None)) - np.log(np.clip(p[:, list(rest)].sum(1), 1e-12, None))


def effects(values: np.ndarray, names: list[str], alphas: list[float], groups: np.ndarray, n_boot: int,
            seed: int) -> dict:
    """values float64 [M, directions, alphas] (alpha 0: unsteered) -> the effects of the module docstring. The
    intervals resample subject entities and, jointly, the random directions (the baseline's own spread)."""
    alphas_ = np.asarray(alphas, dtype=np.float64)
    change = values - values[:, :1, [alphas.index(0.0)]]                           # steered - unsteered [M, D, A]
    random = np.array([j for j, n in enumerate(names) if n.startswith("random_")])
    centred = alphas_ - alphas_.mean()
    rng = np.random.default_rng(seed)
    draws = [(rows, rng.choice(random, size=len(random)))
             for rows in cluster_bootstrap_indices(groups, n_boot, rng)]

    def summary(d: int) -> dict:
        """Direction d - the random mean: per alpha with intervals, and the slope over alpha with its interval."""
        def did(rows, rand):
            per_item = change[rows, d] - change[np.ix_(rows, rand)].mean(1)        # [m, A]
            return per_item.mean(0), float((per_item @ centred).mean() / (centred @ centred))
        point, slope = did(np.arange(len(change)), random)
        resampled = [did(rows, rand) for rows, rand in draws]
        means, slopes = np.array([r[0] for r in resampled]), np.array([r[1] for r in resampled])
        return {"diff": point.tolist(), "ci": np.percentile(means, [2.5, 97.5], axis=0).T.tolist(), "slope": slope,
                "slope_ci": np.percentile(slopes, [2.5, 97.5]).tolist(), "slope_p": bootstrap_p(slopes)}

    mean_change = change.mean(0)                                                  # [D, A]
    band = (mean_change[random].min(0), mean_change[random].max(0))
    out = {"effect": {n: mean_change[j].tolist() for j, n in enumerate(names)},
           "random_band": [band[0].tolist(), band[1].tolist()],
           "outside_random_band": ((mean_change[0] < band[0]) | (mean_change[0] > band[1])).tolist(),
           "did": summary(0)}
    if "probe_orthogonal" in names:
        out["did_orthogonal"] = summary(names.index("probe_orthogonal"))
    lo, hi = out["did"]["slope_ci"]
    out["verdict"] = ("moves the answer toward the probe's class beyond random directions" if lo > 0 else
                      "moves the answer away from the probe's class beyond random directions" if hi < 0 else
                      "no effect beyond random directions")
    return out


def _signature(**parts) -> str:
    h = hashlib.sha256()
    for key in sorted(parts):
        value = parts[key]
        h.update(key.encode())
        h.update(np.ascontiguousarray(value).tobytes() if isinstance(value, np.ndarray) else
                 json.dumps(value, sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


def steered_runs(cfg: DictConfig, loaded, layer: int, units: dict[str, np.ndarray], scale: float, kind: str,
                 seqs, positions, make, partial: Path, signature: str) -> np.ndarray:
    """The raw readout [directions, alphas, N, ...] of every (direction, alpha), alpha 0 once (unsteered, copied
    to every direction); saved to `partial` after each, resumed from it when its signature matches."""
    names, alphas = list(units), [float(a) for a in cfg.alphas]
    raw, done = None, np.zeros((len(names), len(alphas)), dtype=bool)
    if partial.exists() and not cfg.overwrite:
        try:
            with np.load(partial, allow_pickle=False) as z:
                if str(z["signature"]) == signature:
                    raw, done = z["raw"].copy(), z["done"].copy()
        except (OSError, ValueError, KeyError, EOFError) as err:
            log.warning("%s is not a readable checkpoint (%s): starting again", partial, type(err).__name__)
    zero = alphas.index(0.0)
    with Steering(loaded.model, layer) as steering:
        for a, alpha in enumerate(alphas):
            for j, name in enumerate(names):
                if done[j, a] or (alpha == 0.0 and j > 0):
                    continue
                delta = None if alpha == 0.0 else torch.from_numpy(alpha * scale * units[name]).float()
                reduce = make(steering, delta)
                result = score(loaded, seqs, reduce, int(cfg.batch_size), prefix_cache=True,
                               desc=f"{kind} {name} alpha={alpha:g}").results
                if raw is None:
                    raw = np.full((len(names), len(alphas), *result.shape), np.nan)
                raw[j, a] = result
                done[j, a] = True
                if alpha == 0.0:
                    raw[:, zero], done[:, zero] = result, True
                atomic_write(partial, lambda f: np.savez(f, raw=raw, done=done, signature=np.str_(signature)))
    return raw


def run(cfg: DictConfig) -> Path:
    cfg = validate(cfg)                       # every option typed and in range before any work
    path, cell = resolve_cell(cfg)
    out = output_path(cfg, cell)
    if out.exists() and not cfg.overwrite:
        log.info("%s exists (overwrite=true recomputes it)", out)
        return out
    started = time.perf_counter()
    probe = load_probe(path)
    w = probe_direction(probe, path)
    task, layer = cell["config"]["task"]["name"], int(probe.layer)
    store = ActivationStore(store_path(cfg.store_dir, cfg.model.name, cfg.data.name))
    check_same_model(probe.store, store_summary(store), str(store.path))
    if layer not in store.layers:
        raise InterveneError(f"{path}: layer {layer} is not in {store.path}")
    v = w / np.linalg.norm(w)
    scale, mean_diff, split = training_geometry(store, cell, layer, task, cfg.at, v)
    units = directions(v, mean_diff, int(cfg.n_random), int(cfg.seed))
    table = store.table
    task_rows, _ = task_targets(table["label"].to_numpy(), task)
    test_rows = np.intersect1d(split.test, task_rows)
    rows = chosen_rows(table, test_rows, int(cfg.n_statements))
    loaded = load_model(cfg.model)
    check_same_model(probe.store, {**probe.store, "model_fingerprint": loaded.fingerprint}, f"model={cfg.model.name}")
    if layer > loaded.n_layers:
        raise InterveneError(f"{path}: layer {layer}, but {cfg.model.name} has layers 0..{loaded.n_layers}")
    names, alphas = list(units), [float(a) for a in cfg.alphas]
    record = {"cell": str(path), "probe": cell["config"]["probe"]["name"], "task": task, "layer": layer,
              "model": cfg.model.name, "model_label": loaded.label, "datapack": cfg.data.name, "at": cfg.at,
              "alphas": alphas, "scale": scale, "directions": names, "n_random": int(cfg.n_random),
              "cos_probe_mean_diff": float(v @ mean_diff / np.linalg.norm(mean_diff)),
              "n_test_rows": int(len(rows)), "readouts": {}}
    for kind in cfg.readouts:
        if kind == "zero_shot":
            seqs, positions, option_ids = zero_shot_items(loaded, table, rows, cfg.at, cfg.enumeration)
            prompt = PromptScorer(loaded.model, option_ids, loaded.device)
            groups = table["object_1"].to_numpy()[rows]

            def make(steering, delta, seqs=seqs, positions=positions, prompt=prompt):
                return SteeredOptions(prompt, steering, seqs, positions, delta)
        else:
            seqs, positions, n_cont, groups = likelihood_items(loaded.tokenizer, table, test_rows, cfg.at,
                                                               int(cfg.n_statements))

            def make(steering, delta, seqs=seqs, positions=positions, n_cont=n_cont):
                return SteeredCompletion(n_cont, steering, seqs, positions, delta)
        if len(groups) < 2:
            record["readouts"][kind] = {"skipped": f"{len(groups)} items among the chosen test rows"}
            log.info("%s readout skipped: %s", kind, record["readouts"][kind]["skipped"])
            continue
        signature = _signature(cell=cell["heads"]["sha256"], fingerprint=loaded.fingerprint, layer=layer, at=cfg.at,
                               alphas=alphas, units=np.stack(list(units.values())), scale=scale, kind=kind,
                               seqs=np.concatenate(seqs), lengths=[len(x) for x in seqs], batch=int(cfg.batch_size),
                               enumeration=cfg.enumeration)
        partial = out.with_name(f"{out.stem}.{kind}.partial.npz")
        out.parent.mkdir(parents=True, exist_ok=True)
        raw = steered_runs(cfg, loaded, layer, units, scale, kind, seqs, positions, make, partial, signature)
        values = np.stack([np.stack([readout_values(kind, raw[j, a], task) for a in range(len(alphas))], 1)
                           for j in range(len(names))], 1)                       # [M, D, A]
        record["readouts"][kind] = {"n_items": int(len(values)), "n_groups": int(len(set(groups))),
                                    **effects(values, names, alphas, np.asarray(groups), int(cfg.n_boot),
                                              int(cfg.seed)),
                                    "values": np.round(values, 6).tolist()}
    record["seconds"] = time.perf_counter() - started
    write_record(out, record, OmegaConf.to_container(cfg, resolve=True))
    for kind in cfg.readouts:
        out.with_name(f"{out.stem}.{kind}.partial.npz").unlink(missing_ok=True)
    log.info("written: %s", out)
    return out
