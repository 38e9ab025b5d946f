"""`python -m extract`: statements -> model -> every layer's token states -> the HDF5 store.

With `prefix_cache` (the default) the token prefix every input starts with (the chat template's
system turn and user-turn opening) runs once, its key/value cache extended by every batch, and is
stored once (a schema-2 store); `prefix_cache=false` runs and stores every input whole (schema 1).

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

from extract.capture import Inputs, LayerCapture, plan_batches, plan_windows, render, split_prefix
from toolkit.disk import format_bytes, is_sparse, make_folders, remove_empty, reserve, writer_lock
from extract.models import load_model, load_spec, resolve_device
from extract.plan import MEASURED_TOKENS_PER_S, Plan, check_plan, free_space
from extract.shards import merge_shards, shard_path, shard_rows
from toolkit.schema import validate
from extract.statements import TRUTHFULQA, StatementsError, limit_statements, load_statements
from extract.store import (KIND_STATEMENT, StoreError, select_layers, store_path, torch_to_stored, STORED_DTYPES,
                           TORCH_STORED)
from extract.store_writer import TOKEN_ROW_BYTES, StoreWriter, build_store, check_compatible, estimate_bytes

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
    shard = {}
    if cfg.shards > 1 and cfg.shard is None and not cfg.dry_run:
        return merge_shards(cfg, path, table)
    if cfg.shard is not None:   # a label-stratified slice into its own store (extract.shards)
        table = table.iloc[shard_rows(table["label"].to_numpy(), cfg.shards, cfg.shard)].reset_index(drop=True)
        path, shard = shard_path(path, cfg.shards, cfg.shard), {"shard": cfg.shard, "shards": cfg.shards}
    if cfg.dry_run:
        return plan(cfg, path, table)
    loaded = load_model(cfg.model)
    layers = select_layers(cfg.layers, loaded.n_layers)
    inputs = render_inputs(loaded, table, data.statement_column, cfg.prefix_cache)
    attrs = {
        "model_id": loaded.model_id, "model_label": loaded.label, "model_fingerprint": loaded.fingerprint,
        "tokenizer_id": loaded.model_id, "tokenizer_fingerprint": loaded.tokenizer_fingerprint,
        "compute_dtype": loaded.compute_dtype, "n_layers": loaded.n_layers, "datapack": data.name,
        "chat_template": loaded.use_chat_template,
        "chat_template_text": loaded.tokenizer.chat_template if loaded.use_chat_template else "",
        "system_prompt": loaded.system_prompt, "config": OmegaConf.to_container(cfg, resolve=True), **shard,
    }
    need = estimate_bytes(inputs.n_rows, len(layers), loaded.hidden_size, cfg.dtype, table)
    created = make_folders(path.parent)
    try:
        with writer_lock(path):
            if path.exists() and not cfg.overwrite:
                check_compatible(path, attrs, layers, cfg.dtype, inputs.ids, inputs.prefix_ids if inputs.p else None,
                                 table)
            else:
                build_store(path, need, table, inputs.ids, inputs.kinds, layers, loaded.hidden_size, cfg.dtype,
                            attrs, (inputs.prefix_ids, inputs.prefix_kinds) if inputs.p else None,
                            replace=cfg.overwrite)
                log.info("writing %d statements, %d tokens (%d of them a shared prefix stored once), %d layers: "
                         "%s to %s", len(table), inputs.n_tokens, inputs.p, len(layers), format_bytes(need), path)
            _fill(path, loaded, inputs, layers, cfg)
    except BaseException:
        remove_empty(created)
        raise
    return path


def plan(cfg: DictConfig, path: Path, table) -> Plan:
    """dry_run=true: print the extraction's plan (extract.plan) from the model's config and tokenizer;
    refuse it, as the run would, when the disk cannot hold the store. Nothing is written."""
    spec = load_spec(cfg.model)
    layers = select_layers(cfg.layers, spec.n_layers)
    inputs = render_inputs(spec, table, cfg.data.statement_column, cfg.prefix_cache)
    device = resolve_device(cfg.model.device).type
    result = Plan(path, len(table), inputs.n_tokens, inputs.n_rows, inputs.p, len(layers),
                  layer_bytes=estimate_bytes(inputs.n_rows, 1, spec.hidden_size, cfg.dtype) - TOKEN_ROW_BYTES * inputs.n_rows,
                  total_bytes=estimate_bytes(inputs.n_rows, len(layers), spec.hidden_size, cfg.dtype, table),
                  total_without_prefix=estimate_bytes(inputs.n_tokens, len(layers), spec.hidden_size, cfg.dtype, table),
                  free_bytes=free_space(path.parent),
                  tokens_per_s=cfg.tokens_per_s or MEASURED_TOKENS_PER_S.get((cfg.model.name, device)), device=device)
    print("\n".join(result.lines()), flush=True)
    check_plan(result, reclaimable=path.stat().st_size if cfg.overwrite and path.exists() else 0)
    if path.exists() and not cfg.overwrite:   # what the run would refuse, as far as the tokenizer tells
        known = {"model_fingerprint": None, "compute_dtype": None, "tokenizer_fingerprint": None,
                 "datapack": cfg.data.name, "chat_template": spec.use_chat_template,
                 "chat_template_text": spec.tokenizer.chat_template if spec.use_chat_template else "",
                 "system_prompt": spec.system_prompt}
        try:
            check_compatible(path, known, layers, cfg.dtype, inputs.ids, inputs.prefix_ids if inputs.p else None, table)
        except StoreError as err:
            log.warning("the run would refuse the existing store: %s", err)
    return result


def render_inputs(loaded, table, column: str, shared_prefix: bool) -> Inputs:
    """Each statement's model input (extract.capture.render), checked (`_check_inputs`), and split after
    the longest prefix of ids and kinds they all share (`shared_prefix`; at least one token of each
    statement's own is left after it)."""
    rendered = [render(loaded.tokenizer, s, loaded.use_chat_template, loaded.system_prompt, context=c)
                for s, c in tqdm(zip(table["statement"], table["context"]), total=len(table), desc="tokenize",
                                 unit="stmt", leave=False, disable=None)]
    _check_inputs(table, rendered, loaded.max_positions, column)
    return split_prefix([i for i, _ in rendered], [k for _, k in rendered], shared_prefix)


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


def _fill(path: Path, loaded, inputs: Inputs, layers: list[int], cfg: DictConfig) -> None:
    """Forward every window not yet done (the shared prefix first, once, stored before the first window);
    a writer thread stores window i while window i+1 runs."""
    writer = StoreWriter(path)
    offsets, start, token_ids = writer.offsets, writer.n_done, inputs.ids
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
    capture = LayerCapture(loaded.model, layers, TORCH_STORED[cfg.dtype], pad_id=loaded.tokenizer.pad_token_id or 0,
                           prefix=inputs.prefix_ids if inputs.p else None)
    bar = tqdm(total=len(token_ids), initial=start, unit="stmt", desc=f"extract {path.name}", smoothing=0.1)
    failed = True
    try:
        with capture:
            if inputs.p and start == 0:
                writer.write_prefix({k: _checked(t, k, "the shared prefix") for k, t in capture.prefix_states.items()})
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
        buffers[k][rows] = _checked(t, k, f"statements {stmts.min()}..{stmts.max()} of this window")


def _checked(t, k: int, where: str) -> np.ndarray:
    """Captured states (CPU tensor, stored torch dtype) -> stored representation; an overflow is refused."""
    values = torch_to_stored(t)
    if values.dtype != np.uint16 and not np.isfinite(values).all():
        raise StoreError(f"layer {k} has values beyond the range of {values.dtype} ({where}): rerun with "
                         "dtype=bfloat16 or dtype=float32 and overwrite=true")
    return values
