"""The activation store: one HDF5 file per (model, datapack). This module reads it and
extract.store_writer writes it: the only two that know its layout.

Layout (schema_version 1, or 2 with a shared prefix; readable with plain h5py, see docs/store.md):

    /                       attributes: schema_version, model_id, model_fingerprint, tokenizer_id,
                            tokenizer_fingerprint, compute_dtype, n_layers (L), hidden_size, dtype,
                            layers (stored layer numbers),
                            chat_template (bool), chat_template_text, system_prompt, datapack,
                            n_statements, n_tokens, n_done, toolkit_version, created, config (JSON)
    /statements/text        str    [N]
    /statements/label       int8   [N]   0 = false, 1 = true, 2 = neither
    /statements/object_1    str    [N]
    /statements/object_2    str    [N]
    /statements/negation    bool   [N]
    /statements/source_file str    [N]
    /statements/source_row  int64  [N]
    /statements/context     str    [N]   text before the statement in the same input ("" for none;
                                         absent in stores made before it: read as "")
    /tokens/offsets         int64  [N+1] statement i owns token rows offsets[i]:offsets[i+1]
    /tokens/ids             int64  [T]
    /tokens/kind            int8   [T]   0 = special token, 1 = chat-template text, 2 = statement text,
                                         3 = context text
    /layers/<k>             [T, hidden] float16 | float32 | uint16 (bfloat16 bits, attr dtype)

Schema 2 stores the token prefix every statement's input starts with (the chat template's system
turn and user-turn opening) once: attribute prefix_len = P, and

    /prefix/ids             int64  [P]
    /prefix/kind            int8   [P]
    /prefix/layers/<k>      [P, hidden]  as /layers/<k>

while /tokens/* and /layers/<k> hold each statement's own rows (its input after the prefix), and
n_tokens counts the tokens of the whole inputs (N x P more than the rows stored). Statement i's
sequence is the prefix's rows followed by its own: the readers below show every store as schema 1.

Layer k: 0 = embedding output, 1..L = residual stream after decoder block k (no final norm).
Rows are in datapack order. `n_done` counts statements, in datapack order, whose rows of every
layer are on disk (written, fsynced and read back); everything else (metadata, tokens, the space
of every layer, reserved on disk) is written when the file is created, under a temporary name
renamed into place once complete, so the only later writes are raw layer rows and `n_done`.
"""
from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pandas as pd
import torch

from toolkit.disk import os_reason, writer_pid
from toolkit.errors import ToolkitError, check_name

SCHEMA_VERSION = 2          # written when a shared prefix is stored; schema 1 otherwise
READABLE_SCHEMAS = (1, 2)
KIND_SPECIAL, KIND_TEMPLATE, KIND_STATEMENT, KIND_CONTEXT = 0, 1, 2, 3
STORED_DTYPES = {"float16": np.float16, "float32": np.float32, "bfloat16": np.uint16}
TORCH_STORED = {"float16": torch.float16, "float32": torch.float32, "bfloat16": torch.bfloat16}
TEXT_COLUMNS = ["text", "object_1", "object_2", "source_file", "context"]


class StoreError(ToolkitError):
    """A store that is missing, incomplete, damaged or does not match the request."""


def store_path(store_dir: str | Path, model: str, datapack: str) -> Path:
    """Where the store of (model, datapack) lives: <store_dir>/<model>/<datapack>.h5."""
    return Path(store_dir) / check_name(model, "model.name") / f"{check_name(datapack, 'data.name')}.h5"


def select_layers(spec, n_layers: int, stored: list[int] | None = None, option: str = "layers") -> list[int]:
    """The one grammar for layer selections: `all`, one integer, or a non-empty list of integers,
    each in 0..n_layers (0 = embeddings) and, when `stored` is given, stored. Returns them sorted."""
    available = list(range(n_layers + 1)) if stored is None else list(stored)
    if spec == "all":
        return available
    values = [spec] if isinstance(spec, int) and not isinstance(spec, bool) else spec
    if isinstance(values, (str, bool, int)) or not hasattr(values, "__iter__") or len(values) == 0 or any(
            isinstance(k, bool) or not isinstance(k, int) for k in values):
        raise StoreError(f"{option}={spec!r}: use all, one layer number 0..{n_layers} or a list such as "
                         f"{option}=[0,8,16]")
    outside = [k for k in values if not 0 <= k <= n_layers]
    if outside:
        shown = outside[0] if len(outside) == 1 else outside
        raise StoreError(f"{option}={shown} is outside 0..{n_layers} for this model (0 = embeddings): choose "
                         f"{option}=0..{n_layers} or {option}=all")
    missing = [k for k in values if k not in available]
    if missing:
        raise StoreError(f"layer(s) {missing} were not extracted into this store (stored: {_ranges(available)}): "
                         f"extract them (layers=...) or choose {option}= among the stored layers")
    return sorted(set(values))


def plain_value(value):
    """An HDF5 attribute as a plain Python value (no np.int64(750) / np.True_ in messages)."""
    return value.item() if isinstance(value, np.generic) else value


def open_store(path: Path, mode: str = "r", writer: bool = False, **kwargs) -> h5py.File:
    """h5py.File(path, mode), with "in use by another process" told apart from damage; `writer`:
    the caller holds the store's writer lock."""
    pid = None if writer else writer_pid(path)
    if pid is not None:
        raise StoreError(f"{path} is in use by another process (being written by extraction pid {pid}): "
                         "wait for it to finish, or stop it, then rerun")
    try:
        return h5py.File(path, mode, **kwargs)
    except OSError as err:
        if "unable to lock file" in str(err) or err.errno == 11:
            raise StoreError(f"{path} is in use by another process (its HDF5 file lock is held): wait until "
                             "that process closes it, then rerun") from None
        raise StoreError(f"{path} is damaged or not an HDF5 store ({os_reason(err)}): "
                         "rerun extraction with overwrite=true") from None


def torch_to_stored(t: "torch.Tensor") -> np.ndarray:
    """A CPU tensor already in the stored torch dtype -> its numpy representation (bfloat16 as uint16 bits)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def from_stored(x: np.ndarray, dtype: str) -> np.ndarray:
    """Stored representation -> float32."""
    if dtype == "bfloat16":
        return (x.astype(np.uint32) << 16).view(np.float32)
    return x.astype(np.float32, copy=False)


class ActivationStore:
    """Read-only view of a complete store. Each call reads only the layer it is asked for.

    Every schema reads as schema 1: `offsets` [N+1], `token_ids` / `token_kind` [T] and `layer(k)`
    [T, d] hold each statement's whole input, a schema-2 store's shared prefix repeated in each.

    >>> store = ActivationStore("activations/smollm2/city_locations.h5")
    >>> X, offsets = store.bags(16)          # X [T', d] statement tokens, offsets [N+1]
    >>> last = store.last_token(16)          # [N, d]
    """

    prefix_len = 0   # tokens of the shared prefix (schema 2)

    def __init__(self, path: str | Path, allow_incomplete: bool = False):
        self.path = Path(path)
        if not self.path.is_file() and writer_pid(self.path) is None:
            raise StoreError(f"no activation store at {self.path}: run `python -m extract` first "
                             "(or point store_dir= at the folder that holds it)")
        self.file = open_store(self.path)
        self.attrs = {k: plain_value(v) for k, v in self.file.attrs.items()}
        if self.attrs.get("schema_version") not in READABLE_SCHEMAS:
            raise StoreError(f"{self.path}: schema_version {self.attrs.get('schema_version')} is not one of "
                             f"{list(READABLE_SCHEMAS)}; re-extract it with this version (overwrite=true)")
        if not allow_incomplete and self.n_done < self.n_statements:
            raise StoreError(f"{self.path} is incomplete ({self.n_done}/{self.n_statements} statements): "
                             "rerun the same `python -m extract` command to finish it")
        self.prefix_len = int(self.attrs.get("prefix_len", 0))
        self._own_offsets = self.file["tokens/offsets"][:]           # [N+1] into the stored rows
        self.offsets = self._own_offsets + self.prefix_len * np.arange(len(self._own_offsets))
        self.token_kind = self._with_prefix(self.file["tokens/kind"][:], "prefix/kind")
        self._source = None

    n_statements = property(lambda self: int(self.attrs["n_statements"]))
    n_done = property(lambda self: int(self.attrs["n_done"]))
    n_layers = property(lambda self: int(self.attrs["n_layers"]))
    hidden_size = property(lambda self: int(self.attrs["hidden_size"]))
    layers = property(lambda self: [int(k) for k in self.attrs["layers"]])

    @property
    def token_ids(self) -> np.ndarray:
        """int64 [T]."""
        return self._with_prefix(self.file["tokens/ids"][:], "prefix/ids")

    def _with_prefix(self, own: np.ndarray, prefix_name: str) -> np.ndarray:
        """Per-token values of the stored rows [T'] -> of every statement's whole input [T]: the prefix's
        values (dataset `prefix_name`, [P]) inserted before each statement's own."""
        if not self.prefix_len:
            return own
        n = len(self._own_offsets) - 1
        return np.insert(own, np.repeat(self._own_offsets[:-1], self.prefix_len), np.tile(self.file[prefix_name][:], n))

    def source_rows(self) -> np.ndarray:
        """int64 [T]: where each token row is stored, in the prefix's rows followed by the statements'
        own (row r < P: prefix row r; else own row r - P)."""
        if self._source is None:
            p = self.prefix_len
            own = np.arange(int(self._own_offsets[-1]), dtype=np.int64) + p
            self._source = own if not p else np.insert(
                own, np.repeat(self._own_offsets[:-1], p), np.tile(np.arange(p, dtype=np.int64), len(self._own_offsets) - 1))
        return self._source

    @property
    def table(self) -> pd.DataFrame:
        """Per-statement metadata, one row per statement (columns as in extract.statements)."""
        s = self.file["statements"]
        n = len(s["label"])  # stores written before the context column have none: ""
        data = {col: s[col].asstr()[:] if col in s else np.full(n, "", dtype=object) for col in TEXT_COLUMNS}
        data.update(label=s["label"][:].astype(np.int64), negation=s["negation"][:],
                    source_row=s["source_row"][:])
        return pd.DataFrame(data).rename(columns={"text": "statement"})

    def layer(self, k: int, rows: np.ndarray | None = None) -> np.ndarray:
        """Token rows of layer k as float32: all of them [T, d], or `rows` (bool [T] or int [M]).

        The layer is read in one contiguous pass (faster than scattered HDF5 reads); rows are
        selected before the conversion to float32."""
        if k not in self.layers:
            raise StoreError(f"layer {k} is not in {self.path} (stored layers: "
                             f"{_ranges(self.layers)}; the model has layers 0..{self.n_layers})")
        return from_stored(self.stored_layer(k, rows), self.file["layers"][str(k)].attrs["dtype"])

    def stored_layer(self, k: int, rows: np.ndarray | None = None) -> np.ndarray:
        """`layer(k, rows)` in the stored representation (float16, float32, or uint16 bfloat16 bits),
        reading only the span of stored rows that `rows` covers, in one contiguous pass."""
        ds, p = self.file["layers"][str(k)], self.prefix_len
        if rows is None and not p:
            return ds[:]
        source = self.source_rows() if rows is None else self.source_rows()[rows]   # int [M]
        own = source >= p
        index = source[own] - p                       # into the stored rows
        lo, hi = (0, ds.shape[0]) if rows is None else (int(index.min()), int(index.max()) + 1) if index.size else (0, 0)
        picked = np.empty((len(source), ds.shape[1]), dtype=ds.dtype)
        picked[own] = ds[lo:hi][index - lo]
        if not own.all():     # rows of the shared prefix (schema 2)
            picked[~own] = self.file["prefix/layers"][str(k)][:][source[~own]]
        return picked

    def token_mask(self, kinds: tuple[int, ...] = (KIND_STATEMENT,)) -> np.ndarray:
        """bool [T]: tokens whose kind is in `kinds`."""
        return np.isin(self.token_kind, kinds)

    def bag_rows(self, kinds: tuple[int, ...] = (KIND_STATEMENT,)) -> tuple[np.ndarray, np.ndarray]:
        """Token rows of the given kinds, statement by statement: int64 [T'], and offsets int64 [N+1]
        into them."""
        mask = self.token_mask(kinds)
        counts = np.add.reduceat(mask.astype(np.int64), self.offsets[:-1])
        if (counts == 0).any():
            raise StoreError(f"{self.path}: statement {int(np.argmax(counts == 0))} has no token of kinds {kinds}")
        return np.flatnonzero(mask), np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)

    def bags(self, k: int, kinds: tuple[int, ...] = (KIND_STATEMENT,)) -> tuple[np.ndarray, np.ndarray]:
        """Tokens of the given kinds per statement: X float32 [T', d], offsets int64 [N+1]."""
        rows, offsets = self.bag_rows(kinds)
        return self.layer(k, rows), offsets

    def last_token(self, k: int, kinds: tuple[int, ...] = (KIND_STATEMENT,)) -> np.ndarray:
        """The last token of the given kinds of every statement: float32 [N, d]."""
        rows, offsets = self.bag_rows(kinds)
        return self.layer(k, rows[offsets[1:] - 1])

    def mean(self, k: int, kinds: tuple[int, ...] = (KIND_STATEMENT,)) -> np.ndarray:
        """Mean over the tokens of the given kinds of every statement: float32 [N, d]."""
        X, offsets = self.bags(k, kinds)
        sums = np.add.reduceat(X.astype(np.float64), offsets[:-1], axis=0)
        return (sums / np.diff(offsets)[:, None]).astype(np.float32)

    def close(self) -> None:
        self.file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# the store attributes a cell records; MODEL_KEYS of them must agree wherever the probe is applied
STORE_KEYS = ("model_id", "model_label", "model_fingerprint", "tokenizer_fingerprint", "compute_dtype", "n_layers",
              "hidden_size", "dtype", "chat_template", "chat_template_text", "system_prompt", "datapack",
              "layers")
MODEL_KEYS = ("model_fingerprint", "tokenizer_fingerprint", "compute_dtype", "dtype", "chat_template",
              "chat_template_text", "system_prompt")


class ModelMismatch(StoreError):
    """A store or model whose inputs differ from those a probe was fitted on."""


def store_summary(store) -> dict:
    """The attributes of an ActivationStore that a cell records (STORE_KEYS), as plain values."""
    return {k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in store.attrs.items() if k in STORE_KEYS}


def check_same_model(recorded: dict, found: dict, where: str) -> None:
    """Refuse `found` (a store's attributes, or those of a loaded model) unless it agrees with the
    probe's `recorded` store on every MODEL_KEYS entry both hold (cells written before a key was
    recorded are not compared on it); the model fingerprint must be recorded."""
    if "model_fingerprint" not in recorded:
        raise ModelMismatch("the probe's cell records no model fingerprint: retrain it (overwrite=true)")
    for key in MODEL_KEYS:
        if key in recorded and key in found and recorded[key] != found[key]:
            a, b = recorded[key], found[key]
            shown = f" ({b!r}, the probe's {a!r})" if len(repr(a)) + len(repr(b)) < 160 else ""
            raise ModelMismatch(f"{where} has another {key}{shown} than the store the probe was fitted on: apply "
                                "it to activations of the same model, extracted with the same settings")


def _ranges(values: list[int]) -> str:
    return f"{values[0]}..{values[-1]}" if values == list(range(values[0], values[-1] + 1)) else str(values)
