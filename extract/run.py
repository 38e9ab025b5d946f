"""`python -m extract`: statements -> model -> every layer's token states -> the HDF5 store.

Resumable: the store is allocated (and its bytes reserved on disk) up front and filled window by
window (a window = consecutive statements, processed in length-sorted batches); `n_done` advances
only after a window is on disk, so a killed run rerun with the same command continues where it
stopped. Everything is validated before the first byte is written; one extraction at a time
writes a store (a lock file beside it).
"""
from __future__ import annotations

import logging
import queue
import threading
from pathlib import Path

import numpy as np
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from extract.capture import LayerCapture, plan_batches, plan_windows, render
from extract.disk import format_bytes, is_sparse, make_folders, remove_empty, reserve, writer_lock
from extract.models import load_model
from extract.schema import validate
from extract.statements import TRUTHFULQA, StatementsError, limit_statements, load_statements
from extract.store import (KIND_STATEMENT, StoreError, StoreWriter, build_store, check_compatible, estimate_bytes,
                           select_layers, store_path, torch_to_stored, STORED_DTYPES, TORCH_STORED)

log = logging.getLogger(__name__)


def extract(cfg: DictConfig) -> Path:
    """Run (or resume) one extraction; returns the store path. Every check (options, statements,
    model, layers, lengths, disk space) runs before anything is written."""
    cfg = validate(cfg)
    data = cfg.data
    path = store_path(cfg.store_dir, cfg.model.name, data.name)   # names checked before any work
    table = load_statements(data.name, source=data.source, path=data.path,
                            statement_column=data.statement_column, label_column=data.label_column)
    if cfg.limit is not None:   # a label-stratified subset of whole subjects (questions never cut)
        table = limit_statements(table, cfg.limit, whole_groups=data.name == TRUTHFULQA)
    loaded = load_model(cfg.model)
    layers = select_layers(cfg.layers, loaded.n_layers)
    rendered = [render(loaded.tokenizer, s, loaded.use_chat_template, loaded.system_prompt, context=c)
                for s, c in tqdm(zip(table["statement"], table["context"]), total=len(table), desc="tokenize",
                                 unit="stmt", leave=False, disable=None)]
    _check_inputs(table, rendered, loaded.max_positions, data.statement_column)
    token_ids = [ids for ids, _ in rendered]
    attrs = {
        "model_id": loaded.model_id, "model_label": loaded.label, "model_fingerprint": loaded.fingerprint,
        "tokenizer_id": loaded.model_id, "tokenizer_fingerprint": loaded.tokenizer_fingerprint,
        "compute_dtype": loaded.compute_dtype, "n_layers": loaded.n_layers, "datapack": data.name,
        "chat_template": loaded.use_chat_template,
        "chat_template_text": loaded.tokenizer.chat_template if loaded.use_chat_template else "",
        "system_prompt": loaded.system_prompt, "config": OmegaConf.to_container(cfg, resolve=True),
    }
    n_tokens = sum(len(t) for t in token_ids)
    need = estimate_bytes(n_tokens, len(layers), loaded.hidden_size, cfg.dtype)
    created = make_folders(path.parent)
    try:
        with writer_lock(path):
            if path.exists() and not cfg.overwrite:
                check_compatible(path, attrs, layers, cfg.dtype, token_ids)
            else:
                build_store(path, need, table, token_ids, [k for _, k in rendered], layers, loaded.hidden_size,
                            cfg.dtype, attrs, replace=cfg.overwrite)
                log.info("writing %d statements, %d tokens, %d layers: %s to %s", len(table), n_tokens,
                         len(layers), format_bytes(need), path)
            _fill(path, loaded, token_ids, layers, cfg)
    except BaseException:
        remove_empty(created)
        raise
    return path


def _check_inputs(table, rendered: list[tuple[np.ndarray, np.ndarray]], max_positions: int | None,
                  column: str) -> None:
    """Refuse a statement longer than the model's context, or one without a token of its own text."""
    if len(table) == 0:
        raise StatementsError("no statement to extract: give a datapack or CSV with rows (and limit >= 1)")
    for i, (ids, kinds) in enumerate(rendered):
        where = f"{table['source_file'].iat[i]}, row {table['source_row'].iat[i]}, column {column!r}"
        if max_positions and len(ids) > max_positions:
            raise StatementsError(f"{where}: the statement is {len(ids)} tokens with its template, more than the "
                                  f"model's {max_positions} positions: shorten or remove it")
        if not (kinds == KIND_STATEMENT).any():
            raise StatementsError(f"{where}: {table['statement'].iat[i][:80]!r} has no text token (only special "
                                  "tokens such as <s>): write it as plain text or remove the row")


def _fill(path: Path, loaded, token_ids: list[np.ndarray], layers: list[int], cfg: DictConfig) -> None:
    """Forward every window not yet done; a writer thread stores window i while window i+1 runs."""
    writer = StoreWriter(path)
    offsets, start = writer.offsets, writer.n_done
    if start == len(token_ids):
        log.info("%s is already complete", path)
        writer.close()
        return
    if is_sparse(path):  # resuming a store whose space is not all reserved (copied, or made before)
        try:
            reserve(path)
        except BaseException:
            writer.close()
            raise
    lengths = np.diff(offsets)
    pending: queue.Queue = queue.Queue(maxsize=1)
    errors: list[BaseException] = []

    def write_loop():
        while (item := pending.get()) is not None:
            try:
                if not errors:
                    writer.write(*item)
            except BaseException as err:  # reported by the main thread
                errors.append(err)

    thread = threading.Thread(target=write_loop, daemon=True)
    thread.start()
    hidden = loaded.hidden_size
    capture = LayerCapture(loaded.model, layers, TORCH_STORED[cfg.dtype],
                           pad_id=loaded.tokenizer.pad_token_id or 0)
    bar = tqdm(total=len(token_ids), initial=start, unit="stmt", desc=f"extract {path.name}", smoothing=0.1)
    failed = True
    try:
        with capture:
            for a, b in plan_windows(offsets, window_tokens(cfg, len(layers), hidden), start):
                base = offsets[a]
                buffers = {k: np.empty((offsets[b] - base, hidden), dtype=STORED_DTYPES[cfg.dtype])
                           for k in layers}
                previous = None
                for batch in plan_batches(lengths[a:b], int(cfg.batch_tokens)):
                    stmts = batch + a
                    out = capture.run([token_ids[i] for i in stmts])
                    if previous is not None:
                        _scatter(buffers, *previous, offsets, base)
                    previous = (out, stmts)
                    bar.update(len(stmts))
                _scatter(buffers, *previous, offsets, base)
                if errors:
                    raise errors[0]
                pending.put((a, b, buffers))
        failed = False
    finally:
        pending.put(None)
        thread.join()
        bar.close()
        try:
            writer.close()
        except StoreError:
            if not (failed or errors):  # else the first error is the one to report
                raise
    if errors:
        raise errors[0]


def window_tokens(cfg: DictConfig, n_layers: int, hidden: int) -> int:
    """Tokens per window: `window_tokens`, or (auto) as many as fit `window_mb` of buffers per
    window (three windows are in memory at once: filling, queued, being written)."""
    if cfg.window_tokens != "auto":
        return int(cfg.window_tokens)
    per_token = n_layers * hidden * np.dtype(STORED_DTYPES[cfg.dtype]).itemsize
    return max(int(cfg.batch_tokens), int(cfg.window_mb) * 2**20 // per_token)


def _scatter(buffers: dict[int, np.ndarray], out, stmts: np.ndarray, offsets: np.ndarray, base: int) -> None:
    """Copy a batch's token rows (statement by statement) to their rows in the window buffers."""
    rows = np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in stmts]) - base
    for k, t in out.wait().items():
        values = torch_to_stored(t)
        if values.dtype != np.uint16 and not np.isfinite(values).all():
            raise StoreError(f"layer {k} has values beyond the range of {values.dtype} (statements {stmts.min()}.."
                             f"{stmts.max()} of this window): rerun with dtype=bfloat16 or dtype=float32 "
                             "and overwrite=true")
        buffers[k][rows] = values
