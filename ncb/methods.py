"""The two methods NCB reads: a saved probe at one layer (`method=<cell.json>`) and the zero-shot prompt
(`method=zero_shot`). Each gives class probabilities [M, K] for the task's statements and scores the
stress inputs (contexts.interference) the same way.

Probe: the cell's task, split and layer. The clean statements are read from the datapack's store; the
stress inputs are extracted (extract.run.extract, resumable) into
`<store_dir>/<model>/<datapack>.ncb-stress.<split>-seed<s>.L<layer>[-<layer>...].h5` (its CSV beside it; the
probe's layer and those of `stress_layers=`, in the clean store's dtype) and read with the probe's own representation and tokens
(tokens=statement: the target's tokens only, never the context's).

Zero-shot: the probabilities of zero_shot.run.task_view (task `zero_shot.task`, multiclass by default:
the false / true / neither masses renormalised) from the score file of `python -m zero_shot` (the full
one if it exists, else the held-out one, computed if missing). A stress input's prompt is the zero-shot
prompt with the context put just before its "Question: Is the following statement correct?" line, in
the same user turn, so the statement to judge is still the target alone; the N x 7 scores are kept in
the output folder (`stress_scores.npz`, saved every `save_every` batches, resumed on a rerun).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd
from omegaconf import DictConfig, OmegaConf

from evaluation.cells import check_cell_source, read_cell

from toolkit.disk import atomic_write
from evaluation.splits import Split, make_split
from evaluation.tasks import task_targets
from toolkit.errors import ToolkitError, check_name
from extract.models import load_model
from extract.scorer import Checkpoint, score
from extract.statements import TRILEMMA, datapack_table
from extract.store import KIND_STATEMENT, ActivationStore, check_same_model, store_path, store_summary
from toolkit.schema import literal_config
from contexts.stores import extract_inputs, input_store_name
from probes.artifacts import load_probe
from probes.features import layer_features
from zero_shot.prompts import PromptRenderer, get_enumeration, option_token_ids
from zero_shot.run import load_scores, task_view
from zero_shot.scoring import PromptScorer, compute_scores, scores_path

log = logging.getLogger(__name__)
QUESTION = "Question: Is the following statement correct? "
STRESS_SCORES = "stress_scores"     # <output folder>/stress_scores.npz: the direct setting's stress scores


class NCBError(ToolkitError):
    """Bad input or settings of `python -m ncb`; one line naming the fix."""


@dataclass
class Method:
    """One method's view of a datapack.

    name     the output folder's name
    table    the statement table (extract.statements), N rows
    split    the split its cells use
    task     evaluation.tasks name; rows int [M] (table rows) and y int [M] their targets
    probs    float [M, K] class probabilities of `rows` (NaN rows: not scored)
    score_stress  stress inputs (contexts.interference.perturbations) -> (probs [P, K], notes for stress.json)
    info     what stress.json records of the method
    """
    name: str
    table: pd.DataFrame
    split: Split
    task: str
    rows: np.ndarray
    y: np.ndarray
    probs: np.ndarray
    score_stress: Callable[[pd.DataFrame], tuple[np.ndarray, dict]]
    info: dict
    options: np.ndarray | None = None   # zero-shot: float32 [M, 7] option probabilities of `rows` (clean)


def resolve(cfg: DictConfig) -> tuple[str, dict | None]:
    """(output folder name, the probe's cell or None for zero_shot), refusing a cell of another model
    or datapack; reads only the cell."""
    suffix = "+balance_by_py" if cfg.balance_by_py else ""
    if str(cfg.method) == "zero_shot":
        z = cfg.zero_shot
        return check_name(f"zero_shot_{z.enumeration}_{z.task}_{cfg.split.kind}{suffix}", "method"), None
    path = Path(str(cfg.method))
    if path.suffix != ".json":
        raise NCBError(f"method={cfg.method!r}: give a probe's result cell (results/.../seed=<s>.json) or zero_shot")
    cell = read_cell(path)
    check_cell_source(path, cell, cfg.model.name, cfg.data.name)
    config = cell["config"]
    name = f"{config['probe']['name']}_{config['task']['name']}_{config['split']['kind']}_layer{cell['layer']}" \
           f"_seed{config['seed']}{suffix}"
    return check_name(name, "method"), cell


def require_entities(table: pd.DataFrame, datapack: str) -> None:
    if (table["object_1"] == "").all():
        raise NCBError(f"datapack {datapack!r} has no subject entities (object_1): NCB needs statements grouped by "
                       f"entity; use {', '.join(TRILEMMA)} or a CSV with object_1")


def load_method(cfg: DictConfig, cell: dict | None, out_dir: Path) -> Method:
    return probe_method(cfg, cell) if cell is not None else zero_shot_method(cfg, out_dir)


def probe_method(cfg: DictConfig, cell: dict) -> Method:
    """The probe of `cell` applied to the datapack's store (the one it was fitted on)."""
    probe = load_probe(Path(str(cfg.method)))
    clean = ActivationStore(store_path(cfg.store_dir, cfg.model.name, cfg.data.name))
    check_same_model(probe.store, store_summary(clean), str(clean.path))
    table = clean.table
    require_entities(table, cfg.data.name)
    split = make_split(table, **cell["config"]["split"])
    if split.fingerprint() != cell.get("split", {}).get("fingerprint", split.fingerprint()):
        raise NCBError(f"{cfg.method}: the store's split differs from the cell's: retrain the probe on this store")
    task = cell["config"]["task"]["name"]
    rows, y = task_targets(table["label"].to_numpy(), task)
    layer = int(probe.layer)
    missing = sorted(set(cfg.stress_layers) - set(clean.layers))
    if missing:
        raise NCBError(f"stress_layers={list(cfg.stress_layers)}: layer(s) {missing} are not in {clean.path}; give "
                       "layers of the clean store")
    probs = probe.predict_proba(layer_features(clean, layer, probe.representation, probe.tokens))[rows]

    def score_stress(frame: pd.DataFrame) -> tuple[np.ndarray, dict]:
        layers = [layer, *cfg.stress_layers]
        stressed = extract_inputs(frame, input_store_name(cfg.data.name, "ncb-stress", split, layers),
                                  OmegaConf.to_container(cfg.model, resolve=True), cfg.store_dir, layers,
                                  clean.attrs["dtype"], bool(cfg.overwrite), OmegaConf.to_container(cfg.extract, resolve=True))
        check_same_model(probe.store, store_summary(stressed), str(stressed.path))
        differ = statement_tokens_differ(clean, stressed, frame["target_row"].to_numpy())
        if differ:
            log.warning("%d stress inputs tokenise their target statement differently from the clean store", differ)
        features = layer_features(stressed, layer, probe.representation, probe.tokens)
        return probe.predict_proba(features), {"store": str(stressed.path), "statement_tokens_differ": differ}

    info = {"kind": "probe", "cell": str(cfg.method), "task": task, "layer": layer,
            "representation": probe.representation, "tokens": probe.tokens}
    return Method(resolve(cfg)[0], table, split, task, rows, y, probs, score_stress, info)


def statement_tokens_differ(clean: ActivationStore, stressed: ActivationStore, targets: np.ndarray) -> int:
    """How many stressed inputs' statement tokens (kind 2: ids) differ from their target's in the clean
    store (targets int [P]: the clean row of each stressed row)."""
    def statement_ids(store: ActivationStore, rows) -> list[bytes]:
        ids, off, kind = store.token_ids, store.offsets, store.token_kind
        return [ids[off[r]:off[r + 1]][kind[off[r]:off[r + 1]] == KIND_STATEMENT].tobytes() for r in rows]

    clean_ids = dict(zip(np.unique(targets), statement_ids(clean, np.unique(targets))))
    return sum(a != clean_ids[t] for a, t in zip(statement_ids(stressed, range(len(targets))), targets))


def zero_shot_config(cfg: DictConfig, rows: str) -> DictConfig:
    """The options zero_shot.scoring.compute_scores reads, from ncb's (model, data, split, zero_shot)."""
    plain = OmegaConf.to_container(cfg, resolve=True)
    z = plain["zero_shot"]
    return literal_config({"model": plain["model"], "data": plain["data"], "split": plain["split"],
                             "results_dir": plain["results_dir"], "enumeration": z["enumeration"],
                             "batch_size": z["batch_size"], "save_every": z["save_every"],
                             "prefix_cache": z["prefix_cache"], "rows": rows, "limit": None, "overwrite": False})


def zero_shot_method(cfg: DictConfig, out_dir: Path) -> Method:
    """Zero-shot class probabilities of the datapack (clean score file) and of the stress prompts."""
    table = datapack_table(cfg.data)
    require_entities(table, cfg.data.name)
    enum = get_enumeration(cfg.zero_shot.enumeration)
    task = str(cfg.zero_shot.task)
    rows, y = task_targets(table["label"].to_numpy(), task)     # a task the labels refuse: before the scoring
    split = make_split(table, **cfg.split)
    zcfg = zero_shot_config(cfg, "all")
    if not scores_path(zcfg).exists():
        zcfg = zero_shot_config(cfg, "heldout")
    score_file = compute_scores(zcfg)
    scores = load_scores([score_file], table)
    probs = zero_shot_probs(scores[rows], task)

    def score_stress(frame: pd.DataFrame) -> tuple[np.ndarray, dict]:
        path = out_dir / f"{STRESS_SCORES}.npz"
        stress = score_prompts(cfg, enum, frame, path)
        return zero_shot_probs(stress, task), {"scores": str(path)}

    info = {"kind": "zero_shot", "enumeration": enum.name, "task": task, "scores": str(score_file),
            "context": "before the question line, same user turn"}
    return Method(resolve(cfg)[0], table, split, task, rows, y, probs, score_stress, info, scores[rows])


def zero_shot_probs(scores: np.ndarray, task: str) -> np.ndarray:
    """[M, 7] option probabilities (NaN rows: not scored) -> the task's class probabilities [M, K]."""
    scored = ~np.isnan(scores).any(1)
    probs = task_view(np.where(scored[:, None], scores, 0.0), task)[0].astype(np.float64)
    probs[~scored] = np.nan
    return probs


def prompt_text(renderer: PromptRenderer, statement: str, context: str,
                follow_up: tuple[str, str] | None = None) -> str:
    """The zero-shot prompt of `statement` (PromptRenderer.text, with its `follow_up` turn) with `context`
    put just before its (first) question line."""
    text = renderer.text(statement, follow_up)
    at = text.index(QUESTION)
    return text[:at] + context + text[at:]


def encode(renderer: PromptRenderer, text: str) -> np.ndarray:
    """Token ids int64 [n] of a prompt text (special tokens as PromptRenderer.ids)."""
    return np.asarray(renderer.tokenizer(text, add_special_tokens=not renderer.use_chat_template)["input_ids"],
                      dtype=np.int64)


def prompt_ids(renderer: PromptRenderer, statement: str, context: str) -> np.ndarray:
    """Token ids int64 [n] of the zero-shot prompt of `statement` with `context` before its question line."""
    return encode(renderer, prompt_text(renderer, statement, context))


def score_prompts(cfg: DictConfig, enum, frame: pd.DataFrame, path: Path) -> np.ndarray:
    """float32 [P, 7] zero-shot scores of the stress inputs, resumed from / saved to `path` (the
    extract.scorer checkpoint, kept: its `scores` are the output's)."""
    loaded = load_model(cfg.model)
    renderer = PromptRenderer(loaded.tokenizer, enum, loaded.use_chat_template)
    prompts = [prompt_ids(renderer, s, c) for s, c in zip(frame["statement"], frame["context"])]
    return score_options(cfg, loaded, option_token_ids(loaded.tokenizer, enum.labels), prompts, path)


def score_options(cfg: DictConfig, loaded, option_ids: list[list[int]], prompts: list[np.ndarray], path: Path,
                  temperature: float = 1.0) -> np.ndarray:
    """float32 [P, 7] option probabilities at temperature `temperature` (zero_shot.scoring.PromptScorer)
    of token-id prompts, batched as zero_shot.* says, resumed from / saved to the checkpoint `path`."""
    z = cfg.zero_shot
    # (temperature 1 leaves the signature as it was before temperatures: older stress_scores.npz still resume)
    signature = {"option_ids": option_ids, **({} if temperature == 1 else {"temperature": temperature})}
    checkpoint = Checkpoint(path, signature, int(z.save_every), atomic_write, resume=not cfg.overwrite)
    return score(loaded, prompts, PromptScorer(loaded.model, option_ids, loaded.device, temperature),
                 int(z.batch_size), prefix_cache=bool(z.prefix_cache), checkpoint=checkpoint,
                 desc=f"zero-shot {path.stem}").results
