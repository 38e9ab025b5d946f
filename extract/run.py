"""`python -m extract`: statements -> model -> every layer's token states -> the HDF5 store.

Resumable: the store is allocated up front and filled window by window (a window = consecutive
statements, processed in length-sorted batches); `n_done` advances only after a window is on disk,
so a killed run rerun with the same command continues where it stopped.
"""
from __future__ import annotations

import logging
import queue
import shutil
import threading
from pathlib import Path

import numpy as np
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from extract.capture import LayerCapture, plan_batches, plan_windows, render
from extract.models import load_model
from extract.statements import load_statements
from extract.store import (StoreError, StoreWriter, check_compatible, create_store, estimate_bytes,
                           select_layers, store_path, torch_to_stored, STORED_DTYPES, TORCH_STORED)

log = logging.getLogger(__name__)


def extract(cfg: DictConfig) -> Path:
    """Run (or resume) one extraction; returns the store path."""
    if cfg.dtype not in TORCH_STORED:
        raise StoreError(f"dtype={cfg.dtype!r}: use one of {sorted(TORCH_STORED)}")
    data = cfg.data
    path = store_path(cfg.store_dir, cfg.model.name, data.name)   # names checked before any work
    table = load_statements(data.name, source=data.get("source", "csv"), path=data.get("path"),
                            statement_column=data.get("statement_column", "statement"),
                            label_column=data.get("label_column"))
    if cfg.get("limit"):
        table = table.iloc[: int(cfg.limit)].reset_index(drop=True)
    loaded = load_model(cfg.model)
    layers = select_layers(cfg.layers, loaded.n_layers)
    rendered = [render(loaded.tokenizer, s, loaded.use_chat_template, loaded.system_prompt)
                for s in tqdm(table["statement"], desc="tokenize", unit="stmt", leave=False)]
    token_ids = [ids for ids, _ in rendered]
    attrs = {
        "model_id": loaded.model_id, "model_fingerprint": loaded.fingerprint,
        "tokenizer_id": loaded.model_id, "n_layers": loaded.n_layers, "datapack": data.name,
        "chat_template": loaded.use_chat_template,
        "chat_template_text": loaded.tokenizer.chat_template if loaded.use_chat_template else "",
        "system_prompt": loaded.system_prompt, "config": OmegaConf.to_container(cfg, resolve=True),
    }
    if path.exists() and cfg.get("overwrite"):
        path.unlink()
    if path.exists():
        check_compatible(path, attrs, layers, cfg.dtype, token_ids)
    else:
        n_tokens = sum(len(t) for t in token_ids)
        need = estimate_bytes(n_tokens, len(layers), loaded.hidden_size, cfg.dtype)
        _check_disk(path, need)
        log.info("writing %d statements, %d tokens, %d layers: %.2f GB to %s", len(table), n_tokens,
                 len(layers), need / 1e9, path)
        create_store(path, table, token_ids, [k for _, k in rendered], layers, loaded.hidden_size,
                     cfg.dtype, attrs)
    _fill(path, loaded, token_ids, layers, cfg)
    return path


def _check_disk(path: Path, need: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(path.parent).free
    if free < need * 1.05 + (64 << 20):
        raise StoreError(f"{path.parent} has {free / 1e9:.1f} GB free but the store needs {need / 1e9:.1f} GB: "
                         "free space, choose store_dir=..., fewer layers=..., or limit=...")


def _fill(path: Path, loaded, token_ids: list[np.ndarray], layers: list[int], cfg: DictConfig) -> None:
    """Forward every window not yet done; a writer thread stores window i while window i+1 runs."""
    writer = StoreWriter(path)
    offsets, start = writer.offsets, writer.n_done
    if start == len(token_ids):
        log.info("%s is already complete", path)
        writer.close()
        return
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
    finally:
        pending.put(None)
        thread.join()
        bar.close()
        writer.close()
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
