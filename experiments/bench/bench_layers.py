"""Benchmark: one `make run` layer job per probe (every layer of the store, default SmolLM2 city_locations).

A job is what `experiments.sweep` runs for one probe at one layer: the five tasks of `make run` in one
`train_probes` call (the tasks share the layer's heads), samil and linear with C by grouped CV over their
bracketing grids. For each probe: the wall time per layer, the fitting share (the rest is reading the layer,
the calibration map, conformal sets and bootstrap intervals), and the targets of the jobs a make run waits
on (samil, mlp). Torch runs on `threads` (default 1, as each sweep worker does).

Usage: python -m experiments.bench.bench_layers [model=smollm2 data=city_locations store_dir=...]
       [tasks=[...]] [threads=1] [samil_C=null]   (samil_C=100: a fixed C instead of C by CV)
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

MAKE_RUN_TASKS = "[true_vs_all,false_vs_all,neither_vs_all,multiclass,true_vs_false]"
TARGET_SECONDS = {"samil": 20, "mlp": 8}   # a layer job at one thread (issue "The whole study in an afternoon")


def main(argv: list[str]) -> None:
    options = dict(a.split("=", 1) for a in argv)
    samil_C = options.pop("samil_C", "null")
    threads = int(options.pop("threads", "1"))
    options.setdefault("tasks", MAKE_RUN_TASKS)
    torch.set_num_threads(threads)
    overrides = [f"{k}={v}" for k, v in options.items()]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), load average {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} CPUs; tasks={options['tasks']}")
    rows, lines = [], []
    with tempfile.TemporaryDirectory() as results:
        for probe in layer_sweep_probes():
            extra = [f"probe.C={samil_C}"] if probe == "samil" and samil_C != "null" else []
            cfg = compose_config("train_probe", f"probe={probe}", "layer=all", f"results_dir={results}",
                                 f"threads={threads}", *overrides, *extra)
            started = time.perf_counter()
            paths = train_probes(cfg)
            total = time.perf_counter() - started
            written = [json.loads(p.read_text()) for p in paths]
            layers = len({cell["layer"] for cell in written})
            fitting = sum(cell["fit_seconds"] for cell in written)
            name = f"{probe}{' C=' + samil_C if extra else ''}"
            rows.append([name, layers, f"{total:.0f} s", f"{total / layers:.1f} s", f"{fitting / total:.0%}"])
            if probe in TARGET_SECONDS and not extra:
                lines.append(f"  {probe} layer job (five tasks) = {total / layers:.1f} s per layer "
                             f"(target <= {TARGET_SECONDS[probe]} s at one thread)")
            print(f"{probe}: {total:.0f} s", file=sys.stderr, flush=True)
    print(markdown_table(["probe", "layers", "total", "per layer job", "fitting share"], rows), end="")
    print("\n".join(lines))
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main(sys.argv[1:])
