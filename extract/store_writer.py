"""Writing the activation store (its layout: extract.store): sizing, safe creation under a temporary name,
the resume check, and `StoreWriter`, which appends windows of statements in datapack order."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

import h5py
import numpy as np
import pandas as pd

from toolkit.disk import NoSpace, check_space, fsync_path, os_reason, reserve
from toolkit.provenance import toolkit_version
from extract.store import (SCHEMA_VERSION, STORED_DTYPES, TEXT_COLUMNS, StoreError, open_store,
                           plain_value)

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20
TOKEN_ROW_BYTES = 9          # a token row's own arrays: its id (int64) and kind (int8)


def estimate_bytes(n_tokens: int, n_layers_stored: int, hidden_size: int, dtype: str,
                   table: pd.DataFrame | None = None) -> int:
    """Bytes the store will take on disk, for `n_tokens` token rows stored (a shared prefix counted
    once): its layers and token arrays, and with `table` its statements (HDF5's own bookkeeping, a
    few kB, excluded)."""
    rows = n_tokens * (n_layers_stored * hidden_size * np.dtype(STORED_DTYPES[dtype]).itemsize + TOKEN_ROW_BYTES)
    if table is None:
        return rows
    text = table.rename(columns={"statement": "text"})
    strings = sum(int(text[c].astype(str).str.encode("utf-8").str.len().add(7).floordiv(8).mul(8).sum()) + 32 * len(text)
                  for c in TEXT_COLUMNS if c in text)     # variable-length strings: 16-byte slot + heap object
    return rows + strings + len(table) * (8 + 1 + 1 + 8)   # + source_row, label, negation, offsets


def build_store(path: Path, need: int, *args, replace: bool = False) -> None:
    """`create_store(path, *args)` safely, for a store of about `need` bytes: refused if the disk
    lacks the room; written under a temporary name beside `path`, its bytes reserved on disk, and
    only then renamed to `path`. An old store there is replaced at that moment (`replace`), or
    deleted just before the reservation when the disk cannot hold both. A kill at any moment leaves
    either no store or a complete, empty one. The caller holds the store's writer lock (so a
    temporary file found here is a killed run's)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    check_space(path.parent, need, reclaimable=path.stat().st_size if replace and path.exists() else 0)
    try:
        try:
            create_store(tmp, *args)
        except OSError as err:
            raise StoreError(f"cannot write {path} ({os_reason(err)}): free space or choose another store_dir=") from None
        try:
            reserve(tmp)
        except NoSpace:
            if not (replace and path.exists()):
                raise
            log.info("deleting the old %s to make room for the new one", path)
            path.unlink()
            reserve(tmp)
        os.replace(tmp, path)
        fsync_path(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def statement_columns(table: pd.DataFrame) -> dict[str, np.ndarray]:
    """What a store keeps of each statement (its `statements/` group): the text columns (TEXT_COLUMNS,
    "" where the table has none), label, negation and source row, each [N]."""
    text = table.rename(columns={"statement": "text"})
    columns = {col: (text[col] if col in text else pd.Series("", index=text.index)).astype(str).to_numpy(dtype=object)
               for col in TEXT_COLUMNS}     # (a table without context)
    return {**columns, "label": table["label"].to_numpy(dtype=np.int8),
            "negation": table["negation"].to_numpy(dtype=bool), "source_row": table["source_row"].to_numpy(dtype=np.int64)}


def statements_digest(columns: dict[str, np.ndarray]) -> str:
    """sha256 of `statement_columns`: labels and metadata, which the token ids do not show, included."""
    digest = hashlib.sha256()
    for name, values in columns.items():
        data = json.dumps(values.tolist()).encode() if values.dtype == object else np.ascontiguousarray(values).tobytes()
        digest.update(f"{name}:{values.dtype.str}:{len(data)}:".encode() + data)
    return digest.hexdigest()


def create_store(path: Path, table: pd.DataFrame, token_ids: list[np.ndarray], token_kinds: list[np.ndarray],
                 layers: list[int], hidden_size: int, dtype: str, attrs: dict,
                 prefix: tuple[np.ndarray, np.ndarray] | None = None) -> None:
    """Write a new store with all metadata and tokens, and allocate (not fill) every layer.

    token_ids / token_kinds: one int array per statement, in table order (after the prefix, if any).
    attrs: file attributes (model_id, model_fingerprint, n_layers, ...); n_done starts at 0.
    prefix: the shared prefix's ids int64 [P] and kinds int8 [P] (P >= 1): a schema-2 store whose
    prefix layers [P, hidden] are allocated too (StoreWriter.write_prefix fills them).
    """
    offsets = np.zeros(len(table) + 1, dtype=np.int64)
    np.cumsum([len(t) for t in token_ids], out=offsets[1:])
    n_rows = int(offsets[-1])
    p = 0 if prefix is None else len(prefix[0])
    path.parent.mkdir(parents=True, exist_ok=True)
    with h5py.File(path, "w") as f:
        f.attrs.update({k: _attr(v) for k, v in attrs.items()})
        f.attrs.update(schema_version=SCHEMA_VERSION if p else 1, toolkit_version=toolkit_version() or "unknown",
                       created=time.strftime("%Y-%m-%dT%H:%M:%S%z"), hidden_size=hidden_size,
                       dtype=dtype, layers=np.asarray(layers, dtype=np.int64),
                       n_statements=len(table), n_tokens=n_rows + p * len(table), n_done=0)
        if p:
            f.attrs["prefix_len"] = p
            g = f.create_group("prefix")
            g.create_dataset("ids", data=np.asarray(prefix[0], dtype=np.int64))
            g.create_dataset("kind", data=np.asarray(prefix[1], dtype=np.int8))
            pl = g.create_group("layers")
            for k in layers:
                _allocate_layer(pl, str(k), p, hidden_size, dtype)
        s = f.create_group("statements")
        columns = statement_columns(table)
        for col, values in columns.items():
            s.create_dataset(col, data=values, dtype=h5py.string_dtype() if values.dtype == object else None)
        f.attrs["statements_sha256"] = statements_digest(columns)
        t = f.create_group("tokens")
        t.create_dataset("offsets", data=offsets)
        t.create_dataset("ids", data=np.concatenate(token_ids).astype(np.int64))
        t.create_dataset("kind", data=np.concatenate(token_kinds).astype(np.int8))
        g = f.create_group("layers")
        for k in layers:
            _allocate_layer(g, str(k), n_rows, hidden_size, dtype)


def _allocate_layer(group: h5py.Group, name: str, n_tokens: int, hidden_size: int, dtype: str) -> None:
    """Chunked along tokens, every chunk allocated now (a crash later never touches metadata)."""
    np_dtype = np.dtype(STORED_DTYPES[dtype])
    max_rows = max(1, CHUNK_BYTES // (hidden_size * np_dtype.itemsize))
    rows = max(1, -(-n_tokens // -(-n_tokens // max_rows)))  # equal chunks: at most a few rows past T
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_chunk((rows, hidden_size))
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
    space = h5py.h5s.create_simple((n_tokens, hidden_size))
    h5py.h5d.create(group.id, name.encode(), h5py.h5t.py_create(np_dtype), space, dcpl=dcpl)
    group[name].attrs["dtype"] = dtype


def _attr(value):
    return json.dumps(value) if isinstance(value, (dict, list)) else ("" if value is None else value)


# new attributes (absent from stores written before them: not compared there)
_OPTIONAL_KEYS = ("compute_dtype", "tokenizer_fingerprint")


def check_compatible(path: Path, attrs: dict, layers: list[int], dtype: str,
                     token_ids: list[np.ndarray], prefix_ids: np.ndarray | None, table: pd.DataFrame) -> None:
    """Refuse to resume into a store made for another model (weights, compute dtype, tokenizer,
    template), datapack, dtype, layers, input or shared prefix (`prefix_ids` [P]: what
    `token_ids`, each statement's ids after it, follow; None: a schema-1 store), or for statements whose
    labels or metadata (`table`) differ from the ones it keeps. An `attrs` value None is not compared (a dry
    run knows no weights: model_fingerprint, compute_dtype, tokenizer_fingerprint)."""
    p = 0 if prefix_ids is None else len(prefix_ids)
    with open_store(path, writer=True) as f:
        have = {k: plain_value(v) for k, v in f.attrs.items()}
        try:
            stored_ids = f["tokens/ids"][:]
            stored_prefix = f["prefix/ids"][:] if "prefix" in f else np.zeros(0, dtype=np.int64)
        except KeyError:
            raise StoreError(f"{path} is damaged (no tokens/ids); rerun with overwrite=true") from None
    wanted = {"model_fingerprint": attrs["model_fingerprint"], "compute_dtype": attrs["compute_dtype"],
              "tokenizer_fingerprint": attrs["tokenizer_fingerprint"], "datapack": attrs["datapack"],
              "chat_template": attrs["chat_template"], "chat_template_text": attrs["chat_template_text"],
              "system_prompt": _attr(attrs["system_prompt"]), "dtype": dtype, "n_statements": len(token_ids)}
    for key, value in wanted.items():
        if key in _OPTIONAL_KEYS and key not in have or value is None:   # (None: not known, a dry run's weights)
            continue
        if have.get(key) != value:
            shown = (f"{have.get(key)!r}, not {value!r}" if len(repr(have.get(key))) + len(repr(value)) < 160
                     else "other values")
            raise StoreError(f"{path} was made with {key}={shown}: rerun with overwrite=true to replace it "
                             "(or choose another store_dir=)")
    if bool(have.get("prefix_len", 0)) != bool(p):   # the other layout (another prefix: other token ids, below)
        made = (f"with a shared prefix of {have.get('prefix_len')} tokens (schema 2)" if have.get("prefix_len")
                else "without a shared prefix (schema 1)")
        raise StoreError(f"{path} was made {made}: rerun with prefix_cache={str(not p).lower()} to resume it, or "
                         "overwrite=true to replace it")
    if list(have["layers"]) != list(layers):
        raise StoreError(f"{path} holds layers {[int(k) for k in have['layers']]}, not {layers}: "
                         "rerun with overwrite=true to replace it")
    if not (np.array_equal(stored_ids, np.concatenate(token_ids))
            and np.array_equal(stored_prefix, np.zeros(0) if prefix_ids is None else prefix_ids)):
        raise StoreError(f"{path} holds other token ids (statements or tokenizer changed): "
                         "rerun with overwrite=true to replace it")
    if "statements_sha256" in have and have["statements_sha256"] != statements_digest(statement_columns(table)):
        raise StoreError(f"{path} keeps other labels or metadata for these statements (the datapack's CSV changed "
                         "since it was made): rerun with overwrite=true to replace it (or choose another store_dir=)")


class StoreWriter:
    """Appends whole windows of statements (in datapack order) to an existing store.

    Without a chunk cache every write reaches the file inside the call, so a failing write raises
    there (h5py reports errors met while flushing a cache only as ignored warnings)."""

    def __init__(self, path: Path):
        self.path = path
        self.file = open_store(path, "r+", writer=True, rdcc_nbytes=0)
        self.offsets = self.file["tokens/offsets"][:]
        self.dtype = self.file.attrs["dtype"]
        self.layers = {int(k): ds for k, ds in self.file["layers"].items()}
        self.prefix_layers = {int(k): ds for k, ds in self.file["prefix/layers"].items()} if "prefix" in self.file else {}
        self._fd = self.file.id.get_vfd_handle()
        self.n_done = int(self.file.attrs["n_done"])

    def write(self, start: int, stop: int, rows: dict[int, np.ndarray]) -> None:
        """Store statements start..stop-1; rows[k] is [offsets[stop]-offsets[start], hidden] for layer k,
        in the stored representation (see `extract.store.torch_to_stored`).

        n_done advances to `stop` only after every layer's rows are written, fsynced and read back.
        """
        if start != self.n_done:
            raise StoreError(f"write of statements {start}.. out of order (store has {self.n_done} done)")
        lo, hi = int(self.offsets[start]), int(self.offsets[stop])
        self._write(self.layers, lo, hi, rows, start)
        try:
            self.file.attrs.modify("n_done", stop)  # in place: no new metadata space needed
            self.file.flush()
            os.fsync(self._fd)
        except OSError as err:
            raise self._failed(err, start) from None
        self.n_done = stop

    def write_prefix(self, rows: dict[int, np.ndarray]) -> None:
        """Store the shared prefix's rows (rows[k]: [P, hidden], stored representation), before the first
        window: written, fsynced and read back (n_done == 0 until a window follows)."""
        if self.n_done:
            raise StoreError(f"the prefix of {self.path} is written before any statement (store has {self.n_done} done)")
        self._write(self.prefix_layers, 0, len(next(iter(rows.values()))), rows, 0)

    def _write(self, datasets: dict, lo: int, hi: int, rows: dict[int, np.ndarray], start: int) -> None:
        """Rows lo..hi-1 of every layer's dataset, written, fsynced and read back."""
        try:
            for k, x in rows.items():
                datasets[k][lo:hi] = x
            self.file.flush()
            os.fsync(self._fd)
            self._read_back(datasets, lo, hi, rows)
        except OSError as err:
            raise self._failed(err, start) from None

    def _failed(self, err: OSError, start: int) -> StoreError:
        return StoreError(f"writing {self.path} failed ({os_reason(err)}) at statement {start}: fix the disk "
                          f"(free space), then rerun the same command to resume from statement {start}")

    def _read_back(self, datasets: dict, lo: int, hi: int, rows: dict[int, np.ndarray]) -> None:
        """Read one row of every chunk the window touched (and its last row) back from the file."""
        for k, x in rows.items():
            ds = datasets[k]
            picks = np.unique(np.append(np.arange(0, hi - lo, ds.chunks[0]), hi - lo - 1))
            if not np.array_equal(ds[lo + picks].view(np.uint8), x[picks].view(np.uint8)):
                raise StoreError(f"{self.path}: layer {k} rows {lo}..{hi - 1} read back differ from what was "
                                 "written (the disk or file system lost the write): move the store to "
                                 "a healthy disk (store_dir=...) and rerun")

    def close(self) -> None:
        try:
            self.file.close()
        except OSError as err:
            raise StoreError(f"closing {self.path} failed ({os_reason(err)}): fix the disk, then rerun the "
                             "same command (it resumes after the last statement on disk)") from None
