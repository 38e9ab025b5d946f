"""Benchmark: `layer=all` for the four probes on one store (default: SmolLM2 city_locations).

For each probe, one `train_probes` call trains every stored layer in this process (one read of each
layer) for one task; prints the total wall time, the time per layer and the fitting share (the rest is
reading the layer, the calibration map, conformal sets and bootstrap intervals).

Usage: python -m experiments.bench.bench_layers [model=smollm2 data=city_locations task=true_vs_all]
       [samil_C=100]   (samil_C=null: samil chooses C by grouped CV, ~10 fits per layer)
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import torch

from toolkit.config import compose_config, layer_sweep_probes
from probes.pipeline import train_probes
from toolkit.markdown import markdown_table


def main(argv: list[str]) -> None:
    options = dict(a.split("=", 1) for a in argv)
    samil_C = options.pop("samil_C", "100")
    overrides = [f"{k}={v}" for k, v in options.items()]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} CPUs")
    rows = []
    with tempfile.TemporaryDirectory() as results:
        for probe in layer_sweep_probes():
            extra = [f"probe.C={samil_C}"] if probe == "samil" else []
            cfg = compose_config("train_probe", f"probe={probe}", "layer=all", f"results_dir={results}",
                                 *overrides, *extra)
            started = time.perf_counter()
            paths = train_probes(cfg)
            total = time.perf_counter() - started
            fitting = sum(json.loads(p.read_text())["fit_seconds"] for p in paths)
            rows.append([f"{probe}{' C=' + samil_C if extra else ''}", len(paths), f"{total:.0f} s",
                         f"{total / len(paths):.1f} s", f"{fitting / total:.0%}"])
            print(f"{probe}: {total:.0f} s", file=sys.stderr, flush=True)
    print(markdown_table(["probe", "layers", "total", "per layer", "fitting share"], rows), end="")


if __name__ == "__main__":
    main(sys.argv[1:])
