"""Extraction benchmark: shared prefix, capture overhead, store size, and layer-read speed, as ratios
from one run.

    python -m experiments.bench.bench_extract [n_statements] [model]      (default 2000 smollm2)

1. extraction wall time (forward + capture + writes) with the shared prefix run once and stored once
   (prefix_cache=true, schema 2) / the same without it (prefix_cache=false: every input whole, schema 1,
   the code path before it; goal <= 0.5), and each / the bare forward passes over every input's
   tokens (the batches of prefix_cache=false through the same decoder blocks, without capture;
   measured before and after the extractions, averaged). Also shown: the bare passes against an HF
   forward with output_hidden_states=True (what the reference code runs).
2. store bytes with the shared prefix / without it (goal <= 0.45), and / (tokens x layers x hidden x
   bytes per value).
3. reading one whole layer: h5py (raw stored values, and our float32 API) vs numpy.fromfile of the
   same number of bytes (page cache warm for both); the API reads every statement's whole input.
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from toolkit.config import compose_config
from extract.capture import plan_batches, plan_windows
from extract.models import load_model
from extract.run import _fill, render_inputs, window_tokens
from extract.statements import load_statements
from extract.store import ActivationStore, STORED_DTYPES
from extract.store_writer import create_store


class Clock:
    """Wall and CPU seconds (this process, every thread) since it was made: `lap()` -> (wall, cpu)."""

    def __init__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def lap(self) -> np.ndarray:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return np.array([time.perf_counter() - self.wall, time.process_time() - self.cpu])


def bare_forward(model, batches: list[list[np.ndarray]], hidden_states: bool = False) -> np.ndarray:
    """(wall, CPU) seconds for the forward passes alone: right-padded batches through the decoder blocks
    (the LM's base model) or, with hidden_states=True, the full HF forward returning all states."""
    run = model if hidden_states else model.get_decoder()
    clock = Clock()
    with torch.inference_mode():
        for batch in batches:
            lengths = torch.tensor([len(x) for x in batch])
            ids = torch.zeros(len(batch), int(lengths.max()), dtype=torch.long)
            for row, x in enumerate(batch):
                ids[row, : len(x)] = torch.from_numpy(x)
            mask = (torch.arange(ids.shape[1])[None] < lengths[:, None]).long()
            run(input_ids=ids.to(next(model.parameters()).device), attention_mask=mask.to(ids.device),
                use_cache=False, output_hidden_states=hidden_states)
    return clock.lap()


def main(n: int = 2000, model_name: str = "smollm2") -> None:
    cfg = compose_config("extract", f"model={model_name}", "data=city_locations", f"limit={n}")
    table = load_statements("city_locations").iloc[:n].reset_index(drop=True)
    loaded = load_model(cfg.model)
    whole = render_inputs(loaded, table, "statement", shared_prefix=False)
    shared = render_inputs(loaded, table, "statement", shared_prefix=True)
    offsets = np.concatenate([[0], np.cumsum([len(t) for t in whole.ids])])
    layers = list(range(loaded.n_layers + 1))
    batches = [[whole.ids[a + i] for i in batch]
               for a, b in plan_windows(offsets, window_tokens(cfg, len(layers), loaded.hidden_size))
               for batch in plan_batches(np.diff(offsets)[a:b], int(cfg.batch_tokens))]
    print(f"device: {loaded.device} ({torch.cuda.get_device_name() if loaded.device.type == 'cuda' else os.cpu_count()} "
          f"{'GPU' if loaded.device.type == 'cuda' else 'CPU cores'}), torch threads {torch.get_num_threads()}, "
          f"model {loaded.model_id}, {n} statements, {offsets[-1]} tokens ({shared.p} a shared prefix), "
          f"{len(layers)} layers, d={loaded.hidden_size}")
    bare_forward(loaded.model, batches[:2])  # warm-up
    bare_before = bare_forward(loaded.model, batches)
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        times, sizes = {}, {}
        for name, inputs in (("today", whole), ("prefix", shared)):
            path = Path(tmp) / f"{name}.h5"
            clock = Clock()
            create_store(path, table, inputs.ids, inputs.kinds, layers, loaded.hidden_size, cfg.dtype,
                         {"model_id": loaded.model_id, "model_fingerprint": loaded.fingerprint,
                          "n_layers": loaded.n_layers, "datapack": "city_locations"},
                         (inputs.prefix_ids, inputs.prefix_kinds) if inputs.p else None)
            _fill(path, loaded, inputs, layers, cfg)
            times[name], sizes[name] = clock.lap(), path.stat().st_size
        bare_after = bare_forward(loaded.model, batches)
        hf_states = bare_forward(loaded.model, batches, hidden_states=True)
        bare = (bare_before + bare_after) / 2
        payload = offsets[-1] * len(layers) * loaded.hidden_size * np.dtype(STORED_DTYPES[cfg.dtype]).itemsize
        read = _read_speeds(Path(tmp) / "prefix.h5", layers[len(layers) // 2])
    print(f"bare forward: {bare_before[0]:.1f} s before, {bare_after[0]:.1f} s after; extract (store written): "
          f"{times['prefix'][0]:.1f} s with the shared prefix, {times['today'][0]:.1f} s without (wall; CPU: "
          f"{times['prefix'][1]:.1f} s and {times['today'][1]:.1f} s)")
    print(f"distinct tokens / tokens                   = {shared.n_rows / offsets[-1]:.3f}   (work that must be done)")
    print("ratios: wall, CPU seconds (the CPU ratio is the steadier one on a shared machine)")
    for what, ratio, goal in [("extract, shared prefix / without      ", times["prefix"] / times["today"], "goal <= 0.5"),
                              ("extract, shared prefix / bare forward ", times["prefix"] / bare, ""),
                              ("extract, without / bare forward       ", times["today"] / bare, "target <= 1.15"),
                              ("HF output_hidden_states / bare forward", hf_states / bare, "reference, no storage")]:
        print(f"{what} = {ratio[0]:.3f}, {ratio[1]:.3f}   {f'({goal})' if goal else ''}")
    print(f"store bytes, shared prefix / without       = {sizes['prefix'] / sizes['today']:.4f}   (goal <= 0.45; "
          f"{sizes['prefix'] / 1e9:.3f} GB vs {sizes['today'] / 1e9:.3f} GB)")
    print(f"store bytes without / payload bytes        = {sizes['today'] / payload:.4f}   (target <= 1.02)")
    print(f"layer read: h5py raw / fromfile speed      = {read['raw']:.2f}   (target >= 0.5)")
    print(f"            float32 API / fromfile speed   = {read['api']:.2f}   ({read['mb']:.0f} MB per layer stored, "
          "the API returns every whole input)")


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
