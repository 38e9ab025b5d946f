"""Sharded extraction: one datapack split over N jobs (SLURM array tasks), merged into one store.

    python -m extract model=... data=... shards=N -m shard='range(N)' hydra/launcher=slurm   # N jobs
    python -m extract model=... data=... shards=N                                           # the merge

`shards=N shard=i` extracts slice i of the datapack (`shard_rows`: every label's statements, in table
order, cut into N contiguous slices of sizes within one) into its own store, `shard_path`, as any
extraction: resumable, refused when made with other settings. `shards=N` without `shard` merges
the N complete shard stores into the datapack's store, rows in datapack order, as a single process
would have written it (the shared prefix once), with a manifest (attribute `shard_manifest`, JSON: each shard's
file, model fingerprint, creation time and datapack rows). A missing, incomplete or foreign shard
(another model, compute dtype, tokenizer, template, stored dtype, layers or statements) is refused
in one line; the merge itself is resumable like an extraction (windows, `n_done`).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pandas as pd
from omegaconf import DictConfig
from tqdm import tqdm

from extract.capture import plan_windows, split_prefix
from toolkit.disk import make_folders, remove_empty, writer_lock
from extract.store import STORED_DTYPES, ActivationStore, StoreError
from extract.store_writer import StoreWriter, build_store, check_compatible, estimate_bytes

log = logging.getLogger(__name__)

# what every shard of one merge must share (and the merged store records as its own)
SHARED_KEYS = ("model_fingerprint", "compute_dtype", "dtype", "tokenizer_fingerprint", "chat_template",
               "chat_template_text", "system_prompt", "datapack", "model_id", "model_label", "tokenizer_id",
               "n_layers", "hidden_size")


def shard_path(path: Path, shards: int, shard: int) -> Path:
    """Shard i of N of the store at `path`: <store_dir>/<model>/<datapack>.shards/<i>-of-<N>.h5."""
    return path.with_name(f"{path.stem}.shards") / f"{shard}-of-{shards}.h5"


def shard_rows(labels: np.ndarray, shards: int, shard: int) -> np.ndarray:
    """Rows (int64 [n_i], ascending) of shard `shard` of `shards`: each label's rows, in table order,
    cut into `shards` contiguous slices whose sizes differ by at most one."""
    picked = []
    for label in np.unique(labels):
        rows = np.flatnonzero(labels == label)
        picked.append(rows[shard * len(rows) // shards: (shard + 1) * len(rows) // shards])
    return np.sort(np.concatenate(picked)).astype(np.int64)


def merge_shards(cfg: DictConfig, path: Path, table: pd.DataFrame) -> Path:
    """Merge the `cfg.shards` shard stores of `path` into it (resuming a merge that was stopped)."""
    n = int(cfg.shards)
    stores = _open_shards(path, n, table, cfg.dtype)
    try:
        owner = np.empty(len(table), dtype=np.int64)       # [N] shard of each statement
        local = np.empty(len(table), dtype=np.int64)       # [N] its index in that shard
        for i in range(n):
            rows = shard_rows(table["label"].to_numpy(), n, i)
            owner[rows], local[rows] = i, np.arange(len(rows))
        inputs = split_prefix(*_whole_inputs(stores, owner, local), cfg.prefix_cache)
        p = inputs.p
        first = stores[0]
        layers, hidden = first.layers, first.hidden_size
        attrs = {k: first.attrs[k] for k in SHARED_KEYS if k in first.attrs}
        config = json.loads(first.attrs["config"])
        config.update(shard=None)
        attrs.update(config=config, shard_manifest=json.dumps(_manifest(stores, owner)))
        need = estimate_bytes(inputs.n_rows, len(layers), hidden, cfg.dtype, table)
        created = make_folders(path.parent)
        try:
            with writer_lock(path):
                if path.exists() and not cfg.overwrite:
                    check_compatible(path, attrs, layers, cfg.dtype, inputs.ids, inputs.prefix_ids if p else None,
                                     table)
                else:
                    build_store(path, need, table, inputs.ids, inputs.kinds, layers, hidden, cfg.dtype, attrs,
                                (inputs.prefix_ids, inputs.prefix_kinds) if p else None, replace=cfg.overwrite)
                _copy_rows(path, stores, owner, local, p, layers, int(cfg.window_mb))
        except BaseException:
            remove_empty(created)
            raise
    finally:
        for store in stores:
            store.close()
    return path


def _open_shards(path: Path, n: int, table: pd.DataFrame, dtype: str) -> list[ActivationStore]:
    """The N complete shard stores, each holding its slice of `table`, all made alike: else one line."""
    stores = []
    try:
        for i in range(n):
            part = shard_path(path, n, i)
            if not part.exists():
                raise StoreError(f"shard {i} of {n} is missing ({part}): run it first (shard={i} shards={n})")
            store = ActivationStore(part, allow_incomplete=True)
            stores.append(store)
            if store.n_done < store.n_statements:
                raise StoreError(f"shard {i} of {n} is incomplete ({store.n_done}/{store.n_statements} statements): "
                                 f"rerun it (shard={i} shards={n}) to finish it")
            _check_shard(store, i, n, stores[0], table, dtype)
    except BaseException:
        for store in stores:
            store.close()
        raise
    return stores


def _check_shard(store: ActivationStore, i: int, n: int, first: ActivationStore, table: pd.DataFrame,
                 dtype: str) -> None:
    """Refuse a shard made for another slice, datapack, model or settings than shard 0 and this merge."""
    fix = f"re-extract it with the settings of the others (shard={i} shards={n} overwrite=true)"
    if (store.attrs.get("shard"), store.attrs.get("shards")) != (i, n):
        raise StoreError(f"{store.path} is not shard {i} of {n}: {fix}")
    for key in (*SHARED_KEYS, "layers"):
        a, b = first.attrs.get(key), store.attrs.get(key)
        if not np.array_equal(a, b):
            shown = f" ({b!r}, shard 0: {a!r})" if len(repr(a)) + len(repr(b)) < 160 else ""
            raise StoreError(f"shard {i} of {n} was made with another {key}{shown} than shard 0: {fix}")
    if store.attrs["dtype"] != dtype:
        raise StoreError(f"shard {i} of {n} holds dtype={store.attrs['dtype']}, not {dtype}: merge with "
                         f"dtype={store.attrs['dtype']} or {fix}")
    expected = table.iloc[shard_rows(table["label"].to_numpy(), n, i)]
    got = store.table
    if len(got) != len(expected) or (got["statement"].to_numpy() != expected["statement"].to_numpy()).any():
        raise StoreError(f"shard {i} of {n} holds other statements than slice {i} of this datapack (another "
                         f"limit= or data?): {fix}")


def _whole_inputs(stores: list[ActivationStore], owner: np.ndarray, local: np.ndarray):
    """Every statement's whole input ids int64 and kinds int8 (lists of [n_i]), in datapack order."""
    per_shard = [(s.token_ids, s.token_kind, s.offsets) for s in stores]
    ids, kinds = [], []
    for i, j in zip(owner, local):
        t, k, off = per_shard[i]
        ids.append(t[off[j]:off[j + 1]])
        kinds.append(k[off[j]:off[j + 1]])
    return ids, kinds


def _manifest(stores: list[ActivationStore], owner: np.ndarray) -> list[dict]:
    """Each shard's file, fingerprint, creation time and datapack rows (as [start, stop) ranges)."""
    out = []
    for i, store in enumerate(stores):
        rows = np.flatnonzero(owner == i)
        breaks = np.flatnonzero(np.diff(rows) != 1) + 1
        ranges = [[int(r[0]), int(r[-1]) + 1] for r in np.split(rows, breaks) if len(r)]
        out.append({"file": store.path.name, "model_fingerprint": store.attrs["model_fingerprint"],
                    "created": store.attrs["created"], "n_statements": int(len(rows)), "rows": ranges})
    return out


def _copy_rows(path: Path, stores: list[ActivationStore], owner: np.ndarray, local: np.ndarray, p: int,
               layers: list[int], window_mb: int) -> None:
    """Fill the merged store window by window from the shards' rows (the prefix first); resumable."""
    writer = StoreWriter(path)
    try:
        if writer.n_done == len(owner):
            log.info("%s is already complete", path)
            return
        if p and writer.n_done == 0:
            writer.write_prefix({k: stores[int(owner[0])].stored_layer(k, np.arange(p) + stores[int(owner[0])].offsets[local[0]])
                                 for k in layers})
        offsets, hidden = writer.offsets, stores[0].hidden_size
        per_row = len(layers) * hidden * np.dtype(STORED_DTYPES[writer.dtype]).itemsize
        windows = plan_windows(offsets, max(1, window_mb * 2**20 // per_row), writer.n_done)
        for a, b in tqdm(windows, desc=f"merge {path.name}", unit="window"):
            rows = {k: np.empty((offsets[b] - offsets[a], hidden), dtype=STORED_DTYPES[writer.dtype]) for k in layers}
            for i, store in enumerate(stores):
                mine = np.flatnonzero(owner[a:b] == i) + a                       # merged statements of shard i
                if not len(mine):
                    continue
                src = np.concatenate([np.arange(store.offsets[j] + p, store.offsets[j + 1]) for j in local[mine]])
                dst = np.concatenate([np.arange(offsets[m], offsets[m + 1]) for m in mine]) - offsets[a]
                for k in layers:
                    rows[k][dst] = store.stored_layer(k, src)
            writer.write(a, b, rows)
    finally:
        writer.close()
