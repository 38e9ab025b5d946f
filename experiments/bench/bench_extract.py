"""Extraction benchmark: capture overhead, store size, and layer-read speed, as ratios from one run.

    python -m experiments.bench.bench_extract [n_statements] [model]      (default 2000 smollm2)

1. overhead = wall time of filling the store (forward + capture + writes) / wall time of the bare
   forward passes over the same batches through the same decoder blocks, without capture
   (measured before and after the extraction, averaged). Also shown: the bare passes against an
   HF forward with output_hidden_states=True (what the reference code runs).
2. store bytes / (tokens x layers x hidden x bytes per value).
3. reading one whole layer: h5py (raw stored values, and our float32 API) vs numpy.fromfile of the
   same number of bytes (page cache warm for both).
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from extract.config import compose_config
from extract.capture import plan_batches, plan_windows, render
from extract.models import load_model
from extract.run import _fill, window_tokens
from extract.statements import load_statements
from extract.store import ActivationStore, STORED_DTYPES, create_store


def bare_forward(model, batches: list[list[np.ndarray]], hidden_states: bool = False) -> float:
    """Seconds for the forward passes alone: right-padded batches through the decoder blocks
    (the LM's base model) or, with hidden_states=True, the full HF forward returning all states."""
    run = model if hidden_states else model.get_decoder()
    start = time.perf_counter()
    with torch.inference_mode():
        for batch in batches:
            lengths = torch.tensor([len(x) for x in batch])
            ids = torch.zeros(len(batch), int(lengths.max()), dtype=torch.long)
            for row, x in enumerate(batch):
                ids[row, : len(x)] = torch.from_numpy(x)
            mask = (torch.arange(ids.shape[1])[None] < lengths[:, None]).long()
            run(input_ids=ids.to(next(model.parameters()).device), attention_mask=mask.to(ids.device),
                use_cache=False, output_hidden_states=hidden_states)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main(n: int = 2000, model_name: str = "smollm2") -> None:
    cfg = compose_config("extract", f"model={model_name}", "data=city_locations", f"limit={n}")
    table = load_statements("city_locations").iloc[:n].reset_index(drop=True)
    loaded = load_model(cfg.model)
    rendered = [render(loaded.tokenizer, s, loaded.use_chat_template) for s in table["statement"]]
    token_ids = [ids for ids, _ in rendered]
    offsets = np.concatenate([[0], np.cumsum([len(t) for t in token_ids])])
    layers = list(range(loaded.n_layers + 1))
    batches = [[token_ids[a + i] for i in batch]
               for a, b in plan_windows(offsets, window_tokens(cfg, len(layers), loaded.hidden_size))
               for batch in plan_batches(np.diff(offsets)[a:b], int(cfg.batch_tokens))]
    print(f"device: {loaded.device} ({torch.cuda.get_device_name() if loaded.device.type == 'cuda' else os.cpu_count()} "
          f"{'GPU' if loaded.device.type == 'cuda' else 'CPU cores'}), torch threads {torch.get_num_threads()}, "
          f"model {loaded.model_id}, {n} statements, {offsets[-1]} tokens, {len(layers)} layers, d={loaded.hidden_size}")
    bare_forward(loaded.model, batches[:2])  # warm-up
    bare_before = bare_forward(loaded.model, batches)
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        path = Path(tmp) / "bench.h5"
        start = time.perf_counter()
        create_store(path, table, token_ids, [k for _, k in rendered], layers, loaded.hidden_size,
                     cfg.dtype, {"model_id": loaded.model_id, "model_fingerprint": loaded.fingerprint,
                                 "n_layers": loaded.n_layers, "datapack": "city_locations"})
        _fill(path, loaded, token_ids, layers, cfg)
        extract_time = time.perf_counter() - start
        bare_after = bare_forward(loaded.model, batches)
        hf_states = bare_forward(loaded.model, batches, hidden_states=True)
        bare = (bare_before + bare_after) / 2
        payload = offsets[-1] * len(layers) * loaded.hidden_size * np.dtype(STORED_DTYPES[cfg.dtype]).itemsize
        size = path.stat().st_size
        read = _read_speeds(path, layers[len(layers) // 2])
    print(f"bare forward: {bare_before:.1f} s before, {bare_after:.1f} s after; extract (store written): {extract_time:.1f} s")
    print(f"overhead extract / bare forward          = {extract_time / bare:.3f}   (target <= 1.15)")
    print(f"         HF output_hidden_states / bare  = {hf_states / bare:.3f}   (for reference, no storage)")
    print(f"store bytes / payload bytes              = {size / payload:.4f}   ({size / 1e9:.3f} GB; target <= 1.02)")
    print(f"layer read: h5py raw / fromfile speed    = {read['raw']:.2f}   (target >= 0.5)")
    print(f"            float32 API / fromfile speed = {read['api']:.2f}   ({read['mb']:.0f} MB per layer)")


def _read_speeds(path: Path, k: int, repeats: int = 5) -> dict[str, float]:
    """Best-of-`repeats` read speeds of one layer relative to numpy.fromfile of the same bytes."""
    with ActivationStore(path) as store:
        ds = store.file["layers"][str(k)]
        raw = path.with_suffix(".raw")
        ds[:].tofile(raw)
        timings = {"raw": lambda: ds[:], "api": lambda: store.layer(k),
                   "fromfile": lambda: np.fromfile(raw, dtype=ds.dtype)}
        best = {name: min(_timed(fn) for _ in range(repeats)) for name, fn in timings.items()}
        return {"raw": best["fromfile"] / best["raw"], "api": best["fromfile"] / best["api"],
                "mb": raw.stat().st_size / 1e6}


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


if __name__ == "__main__":
    main(*(int(a) if a.isdigit() else a for a in sys.argv[1:]))
