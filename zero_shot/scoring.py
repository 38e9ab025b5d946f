"""Zero-shot scoring: one forward pass per statement -> an N x 7 option-probability file (resumable).

Scores
------
For every statement of the datapack the prompt of :mod:`zero_shot.prompts` is run once and the
next-token distribution (softmax in float32) at the prompt's last token is reduced to 7 columns:
the probability of each of the six options (summed over that option's label ids, see
:func:`zero_shot.prompts.option_token_ids`), in option order whatever the enumeration's labels,
and the remaining mass. The float32 array [len(datapack), 7], rows in datapack order, is stored
at::

    <results_dir>/<model>/<datapack>/zero_shot/scores-<enumeration><suffix>.npy
    <results_dir>/<model>/<datapack>/zero_shot/scores-<enumeration><suffix>.json   (how it was made)

``<suffix>`` is empty for a full run, ``-limit<N>`` with ``limit=N`` (first N statements) and
``-heldout-<split>-seed<s>`` with ``rows=heldout`` (only the calibration and test rows of
``split=``, all that the evaluation needs); rows not scored are NaN.

Batches are consecutive statements, right-padded with an attention mask; the LM head sees only
each row's last real token. The tokens every prompt starts with (system turn, question opening)
are run once and their key/value cache is reused by every batch (``prefix_cache=false`` runs
whole prompts; the two agree to float32 rounding). The batches run in extract.scorer: every
``save_every`` batches the rows done so far are written atomically to
``scores-<enumeration><suffix>.partial.npz``; a rerun continues from it with the same batches, so
the final file is bit-identical to an uninterrupted run. A partial or final file made with another
model, prompt, option ids, statements or rows is refused unless ``overwrite=true``; a matching final
file is reused. A partial file that cannot be read (garbage, truncated, other arrays) is discarded
with one warning and its statements scored again.
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from toolkit.disk import atomic_write
from evaluation.splits import make_split
from toolkit.errors import ToolkitError, check_count, check_name
from extract.models import load_model
from extract.scorer import Checkpoint, partial_path, score
from extract.statements import datapack_table
from zero_shot.prompts import PromptRenderer, get_enumeration, option_token_ids

log = logging.getLogger(__name__)

N_COLUMNS = 7


class ZeroShotError(ToolkitError):
    """Bad input or settings; the message is one line naming the fix."""


def scored_rows(cfg: DictConfig, table) -> tuple[np.ndarray, str]:
    """Rows (ascending positions) this run scores, and the suffix naming its score file.

    rows=all: every statement (the first `limit` with limit=N); rows=heldout: only the
    calibration and test rows of `split=` (all the evaluation needs; about 35-45 % of a
    datapack), the other rows stay NaN in the file.
    """
    limit = check_count(cfg.get("limit"), "limit", none_ok=True)
    n = len(table) if limit is None else min(len(table), limit)
    suffix = f"-limit{n}" if limit is not None else ""
    rows = np.arange(n)
    if cfg.rows == "heldout":
        split = make_split(table, **cfg.split)
        held = np.union1d(split.calibration, split.test)
        rows = held[held < n]
        suffix += f"-heldout-{split.kind}-seed{split.seed}"
    elif cfg.rows != "all":
        raise ZeroShotError(f"rows={cfg.rows!r}: use all or heldout")
    if len(rows) == 0:
        raise ZeroShotError(f"no statement to score with rows={cfg.rows} and limit={cfg.get('limit')}: "
                            "raise the limit")
    return rows.astype(np.int64), suffix


def scores_path(cfg: DictConfig, suffix: str = "") -> Path:
    return (Path(cfg.results_dir) / check_name(cfg.model.name, "model.name") / check_name(cfg.data.name, "data.name")
            / "zero_shot" / f"scores-{check_name(cfg.enumeration, 'enumeration')}{suffix}.npy")


class LastTokenLogits:
    """Context manager: the LM head sees only each row's last real token (logits [B, 1, V]).

    A forward pre-hook on the output embedding replaces its input [B, T, d] by the rows'
    states at `last` [B]; whatever the model does after the head (e.g. Gemma's soft-capping)
    still applies. Saves the [B, T, V] logits of every position.
    """

    def __init__(self, model):
        self.head = model.get_output_embeddings()
        if self.head is None:
            raise ZeroShotError(f"{type(model).__name__} has no output embedding (LM head)")
        self.last: torch.Tensor | None = None
        self._handle = None

    def _hook(self, module, args):
        hidden = args[0]
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        return (hidden[rows, self.last.to(hidden.device)].unsqueeze(1),) + tuple(args[1:])

    def __enter__(self):
        self._handle = self.head.register_forward_pre_hook(self._hook)
        return self

    def __exit__(self, *exc):
        self._handle.remove()


def option_matrix(option_ids: list[list[int]], vocab_size: int) -> torch.Tensor:
    """float32 [V, 7]: column j sums the probabilities of option j's ids, column 6 all other ids."""
    m = torch.zeros(vocab_size, N_COLUMNS, dtype=torch.float32)
    for j, ids in enumerate(option_ids):
        m[ids, j] = 1.0
    m[:, N_COLUMNS - 1] = 1.0 - m[:, : N_COLUMNS - 1].sum(1)
    if (m[:, N_COLUMNS - 1] < 0).any():
        raise ZeroShotError("an id belongs to two options")
    return m


class PromptScorer:
    """The reduction of extract.scorer.score for prompts (token ids): a batch -> float32 [B, 7] option
    probabilities at each prompt's last token (the LM head sees only that one), of softmax(logits /
    temperature): at temperature T, the probability that an answer sampled at T is each option."""
    shape, dtype, keep = (N_COLUMNS,), np.float32, 1     # the prefix leaves each prompt's last token

    def __init__(self, model, option_ids, device: torch.device, temperature: float = 1.0):
        self.model, self.temperature = model, float(temperature)
        self.reduce = option_matrix(option_ids, model.get_output_embeddings().weight.shape[0]).to(device)

    def __call__(self, forward, batch_ids: list[np.ndarray], index: np.ndarray) -> np.ndarray:
        p = forward.prefix_len
        with LastTokenLogits(self.model) as head:
            head.last = torch.tensor([len(x) - p - 1 for x in batch_ids])
            logits = forward.forward([x[p:] for x in batch_ids])
        probs = torch.softmax(logits[:, -1, :].float() / self.temperature, dim=-1)
        if probs.shape[-1] != self.reduce.shape[0]:
            raise ZeroShotError(f"logits have {probs.shape[-1]} entries, the LM head {self.reduce.shape[0]} rows")
        return (probs @ self.reduce).cpu().numpy()


def _sha16(*arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        if isinstance(a, np.ndarray):
            h.update(np.ascontiguousarray(a).tobytes())
        else:
            for s in a:
                h.update(str(s).encode())
                h.update(b"\0")
        h.update(b"|")
    return h.hexdigest()[:16]


def compute_scores(cfg: DictConfig, on_batch=None) -> Path:
    """Score the statements of `rows=` (or resume, or reuse a matching file); returns the .npy path.

    The file is float32 [len(datapack), 7]; rows not scored (limit, rows=heldout) are NaN.
    on_batch(i): called after batch i (tests use it to simulate an interruption).
    """
    if cfg.batch_size < 1 or cfg.save_every < 1:
        raise ZeroShotError("batch_size and save_every must be >= 1")
    enum = get_enumeration(cfg.enumeration)
    table = datapack_table(cfg.data)
    rows, suffix = scored_rows(cfg, table)
    final = scores_path(cfg, suffix)
    meta_path = final.with_suffix(".json")
    partial = partial_path(final)
    loaded = load_model(cfg.model)
    tok = loaded.tokenizer
    renderer = PromptRenderer(tok, enum, loaded.use_chat_template)
    option_ids = option_token_ids(tok, enum.labels)
    prompt = renderer.describe()
    statements = table["statement"].tolist()
    signature = {
        "model_id": loaded.model_id, "model_fingerprint": loaded.fingerprint,
        "dtype": loaded.compute_dtype,
        "prompt_sha256": prompt["sha256"], "option_ids": option_ids, "n_statements": len(statements),
        "statements_sha256": _sha16(statements), "rows_sha256": _sha16(rows), "n_scored": int(len(rows)),
        "prefix_cache": bool(cfg.prefix_cache),
    }
    if final.exists() and not cfg.overwrite:
        old = json.loads(meta_path.read_text()).get("signature") if meta_path.exists() else None
        if old == signature:
            log.info("scores exist: %s (overwrite=true recomputes them)", final)
            return final
        raise ZeroShotError(f"{final} was made with other settings (model, prompt, statements, rows): "
                            "set overwrite=true to replace it")
    log.info("zero-shot prompt (%s, %s):\n%s", enum.name,
             "chat template" if renderer.use_chat_template else "base", prompt["example"])
    log.info("option ids: %s", [[tok.decode([i]) for i in ids] for ids in option_ids])

    prompts = [renderer.ids(statements[i]) for i in tqdm(rows, desc="tokenize", unit="stmt", leave=False)]
    checkpoint = Checkpoint(partial, signature, int(cfg.save_every), atomic_write, resume=not cfg.overwrite,
                            refuse=ZeroShotError)
    started = time.perf_counter()
    scored = score(loaded, prompts, PromptScorer(loaded.model, option_ids, loaded.device), int(cfg.batch_size),
                   prefix_cache=bool(cfg.prefix_cache), checkpoint=checkpoint, desc=f"zero-shot {enum.name}",
                   on_batch=on_batch)
    scores = np.full((len(statements), N_COLUMNS), np.nan, dtype=np.float32)
    scores[rows] = scored.results
    meta = {
        "signature": signature, "batch_size": scored.batch_size, "prompt": prompt,
        "option_tokens": [[tok.decode([i]) for i in ids] for ids in option_ids],
        "columns": [f"option {i + 1} ({a})" for i, a in enumerate(enum.answers)] + ["remaining mass"],
        "rows": cfg.rows, "limit": cfg.get("limit"), "prefix_tokens": scored.prefix_len,
        "model": OmegaConf.to_container(cfg.model, resolve=True), "model_label": loaded.label,
        "datapack": cfg.data.name,
        "seconds": time.perf_counter() - started, "resumed_after": scored.resumed_after,
        "torch": torch.__version__, "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    atomic_write(meta_path, lambda f: f.write(json.dumps(meta, indent=1).encode()))
    atomic_write(final, lambda f: np.save(f, scores))
    partial.unlink(missing_ok=True)
    log.info("scores: %s (%d statements scored, %.0f s)", final, len(rows), meta["seconds"])
    return final
