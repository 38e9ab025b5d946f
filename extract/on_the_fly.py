"""Statements extracted now, in memory, with the model and settings a store was extracted with.

    loaded = store_model(store.attrs)                        # the store's model, template, compute dtype
    memory = extract_statements(loaded, ["Paris is in France."], layers=16, dtype=store.attrs["dtype"])
    memory.last_token(16)                                    # [n, d], as ActivationStore.last_token

`extract_statements` renders each statement as extraction does (extract.capture.render), runs
length-sorted batches through LayerCapture, rounds the states to the store's dtype and returns a
`MemoryStore`: the ActivationStore readers (`last_token`, `mean`, `bags`, `layer`) over those
statements, so what a probe reads is computed by the same code as from a store.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from extract.capture import LayerCapture, plan_batches, render
from extract.models import LoadedModel, load_model
from extract.run import _check_inputs
from extract.store import TORCH_STORED, ActivationStore, StoreError, from_stored, torch_to_stored
from toolkit.schema import literal_config


def store_model(attrs: dict, device: str = "auto") -> LoadedModel:
    """The model a store was extracted with: its recorded `model:` config, at its compute dtype, on
    `device`."""
    try:
        model_cfg = literal_config(json.loads(attrs["config"])["model"])
    except (KeyError, TypeError, ValueError):
        raise StoreError("the store records no model config (made by an older version): re-extract it with "
                         "overwrite=true") from None
    model_cfg.device = device
    if attrs.get("compute_dtype"):
        model_cfg.dtype = attrs["compute_dtype"]
    return load_model(model_cfg)


def model_attrs(loaded: LoadedModel) -> dict:
    """The store attributes that identify a loaded model's inputs, as extraction records them."""
    return {"model_id": loaded.model_id, "model_label": loaded.label, "model_fingerprint": loaded.fingerprint,
            "tokenizer_fingerprint": loaded.tokenizer_fingerprint, "compute_dtype": loaded.compute_dtype,
            "n_layers": loaded.n_layers, "hidden_size": loaded.hidden_size,
            "chat_template": loaded.use_chat_template,
            "chat_template_text": loaded.tokenizer.chat_template if loaded.use_chat_template else "",
            "system_prompt": "" if loaded.system_prompt is None else loaded.system_prompt}


class MemoryStore(ActivationStore):
    """An ActivationStore's readers over some layers of statements held in memory.

    stored {layer: [T, d]} (the stored dtype's numpy representation), offsets int64 [n+1], token_kind int8 [T],
    token_ids int64 [T]."""

    def __init__(self, attrs: dict, stored: dict[int, np.ndarray], offsets: np.ndarray, token_kind: np.ndarray,
                 token_ids: np.ndarray):
        self.path = Path("<statements extracted on the fly>")
        self.attrs = {**attrs, "layers": sorted(stored), "n_statements": len(offsets) - 1, "n_done": len(offsets) - 1}
        self.offsets, self.token_kind, self._stored, self._token_ids = offsets, token_kind, stored, token_ids

    token_ids = property(lambda self: self._token_ids)

    def layer(self, k: int, rows: np.ndarray | None = None) -> np.ndarray:
        if k not in self._stored:
            raise StoreError(f"layer {k} was not extracted on the fly (only layers {self.layers})")
        return from_stored(self._stored[k] if rows is None else self._stored[k][rows], self.attrs["dtype"])

    def close(self) -> None:
        pass


def extract_statements(loaded: LoadedModel, statements: list[str], layers: int | list[int], dtype: str,
                       batch_tokens: int = 4096) -> MemoryStore:
    """Layer(s) `layers` of every token of `statements` (stored dtype `dtype`), as extraction computes them.
    A statement longer than the model's context, or without a token of its own text, is refused."""
    layers = [layers] if isinstance(layers, int) else sorted(set(layers))
    rendered = [render(loaded.tokenizer, s, loaded.use_chat_template, loaded.system_prompt) for s in statements]
    table = pd.DataFrame({"statement": statements, "source_file": "the given statements",
                          "source_row": np.arange(len(statements))})
    _check_inputs(table, rendered, loaded.max_positions, "statement")
    ids = [i for i, _ in rendered]
    lengths = np.array([len(i) for i in ids])
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    stored: dict[int, np.ndarray] = {}
    with LayerCapture(loaded.model, layers, TORCH_STORED[dtype], pad_id=loaded.tokenizer.pad_token_id or 0) as cap:
        for batch in plan_batches(lengths, batch_tokens):
            out = cap.run([ids[i] for i in batch]).wait()
            rows = np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in batch])
            for k in layers:
                values = torch_to_stored(out[k].cpu())      # [batch tokens, d]
                if k not in stored:
                    stored[k] = np.empty((offsets[-1], values.shape[1]), dtype=values.dtype)
                stored[k][rows] = values
    attrs = {**model_attrs(loaded), "dtype": dtype}
    return MemoryStore(attrs, stored, offsets, np.concatenate([k for _, k in rendered]),
                       np.concatenate([np.asarray(i, dtype=np.int64) for i in ids]))
