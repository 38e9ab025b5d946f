"""Refactors change no result: a small sweep (every probe and task on a synthetic store, the tiny model's
zero-shot baseline, applied probes, the report) gives the same cells, tables and figures as the
recorded fingerprints in tests/golden/small_sweep.json.

What differs between two runs is left out of a fingerprint: timings, dates, provenance (command, git
commit), the temporary folder (replaced by `<root>`) and a cell's `heads` record (its file is named by
the sha256 of the float weights, so the last bit of a weight renames it; the weights' effect is in the
cell's scores), and the sha256 of a cell's score files (a zero-shot cell's `scores_source`: the scores are
fingerprinted as floats in their own .npy). Floats are compared through three fixed
random projections, within 1e-6 of their scale (1e-4 for tables and pixels), so the last bits of a
reduction on another machine do not count; any real change does. The probe applied to statements the tiny model
reads on the fly (results/tiny/apply/text.*) keeps its float32 activations unrounded, so another CPU's matrix
kernels move its scores by ~5e-6 of their scale (seen between an Intel and an AMD EPYC machine): 1e-4 there.
A deliberate change of results rewrites the fingerprints:
    TRUTHPROBE_WRITE_GOLDEN=1 python -m pytest tests/test_same_cells.py
and the diff of tests/golden/small_sweep.json shows which files changed.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
import torch
from threadpoolctl import threadpool_limits

from toolkit.config import compose_config
from tests.helpers import ROOT, datapack_csv, extract_csv, make_synthetic_store

GOLDEN = ROOT / "tests" / "golden" / "small_sweep.json"
TASKS = "[true_vs_all,false_vs_all,neither_vs_all,multiclass,true_vs_false]"
VOLATILE = {"fit_seconds", "seconds", "created", "provenance", "heads"}   # heads: file named by its weights' sha256
FLOAT = re.compile(r"-?\d+\.\d*(?:e[-+]?\d+)?|-?\d+e[-+]?\d+|nan|inf")
WEIGHTS = np.random.default_rng(0).uniform(0.5, 1.5, size=(3, 1 << 16))
RTOL = {".json": 1e-6, ".npy": 1e-6, ".csv": 1e-4, ".md": 1e-4, ".png": 1e-4}


def _split(value, root: str, floats: list) -> object:
    """`value` with volatile keys dropped, `root` replaced by <root> and every float moved to `floats`."""
    if isinstance(value, dict):
        return {k: _split(v, root, floats) for k, v in sorted(value.items())
                if k not in VOLATILE and not (k == "sha256" and "files" in value)}   # hashes of float files
    if isinstance(value, list):
        return [_split(v, root, floats) for v in value]
    if isinstance(value, float):
        floats.append(value)
        return "#"
    return value.replace(root, "<root>") if isinstance(value, str) else value


def fingerprint(path: Path, root: Path) -> dict:
    """A file's comparable content: `exact`, the sha256 (16 hex digits) of everything but its floats
    (keys, strings, integers, booleans; a table's text with its decimals blanked), and `floats`, three
    fixed random projections of its float values [n] (with `n`), compared within RTOL[suffix]."""
    floats: list[float] = []
    if path.suffix == ".json":
        exact = json.dumps(_split(json.loads(path.read_text()), str(root), floats), sort_keys=True)
    elif path.suffix == ".png":
        pixels = matplotlib.image.imread(path)
        exact, floats = str(pixels.shape), pixels.ravel().tolist()
    elif path.suffix == ".npy":
        values = np.load(path)
        exact, floats = f"{values.shape} {values.dtype}", values.ravel().tolist()
    else:
        text = path.read_text().replace(str(root), "<root>")
        floats = [float(m) for m in FLOAT.findall(text)]
        exact = FLOAT.sub("#", text)
    v = np.nan_to_num(np.asarray(floats, dtype=np.float64), nan=7.0, posinf=11.0, neginf=-11.0)
    w = WEIGHTS[:, np.arange(len(v)) % WEIGHTS.shape[1]]
    return {"exact": hashlib.sha256(exact.encode()).hexdigest()[:16], "n": len(v),
            "floats": (w @ v).tolist(), "scale": float(np.abs(w[0]) @ np.abs(v))}


ON_THE_FLY = "results/tiny/apply/text."   # scores of a float32 forward, not of a stored (rounded) activation


def same(recorded: dict, found: dict, name: str) -> bool:
    """Equal exact parts and float projections within RTOL of the floats' scale (the file `name`'s)."""
    rtol = 1e-4 if name.startswith(ON_THE_FLY) else RTOL[Path(name).suffix]
    return (recorded["exact"] == found["exact"] and recorded["n"] == found["n"] and
            np.allclose(recorded["floats"], found["floats"], rtol=0, atol=rtol * max(found["scale"], 1e-12)))


@contextmanager
def torch_threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def small_sweep(root: Path) -> dict[str, str]:
    """Run the sweep under `root`; {path relative to root: fingerprint} of every result it wrote."""
    from probes.apply import apply_to_statements, apply_to_store
    from experiments.report import write_report
    from probes.pipeline import train_probes
    from zero_shot.run import run as run_zero_shot

    store_dir, results, reports = root / "activations", root / "results", root / "reports"
    make_synthetic_store(store_dir, n_real=300, n_neither=150)
    train = partial(compose_config, "train_probe", "model.name=synthetic", f"store_dir={store_dir}",
                    f"results_dir={results}", "n_boot=50", "layer=all", f"tasks={TASKS}")
    for probe in ("linear", "mean_diff", "mlp", "samil"):
        train_probes(train(f"probe={probe}"))
    train_probes(train("probe=linear", "calibration=in_sample", "conformal=reference"))
    write_report(results, reports, "synthetic", "city_locations")
    run_zero_shot(compose_config("zero_shot", "model=tiny", "limit=120", "batch_size=16", f"results_dir={results}",
                                 "n_boot=50"))
    extract_csv(root, "cities_a", datapack_csv(root / "a.csv", slice(0, 90), slice(0, 40)), store_dir, "layers=[1,2]")
    extract_csv(root, "cities_b", datapack_csv(root / "b.csv", slice(90, 150), slice(40, 70)), store_dir,
                "layers=[1,2]")
    cell = train_probes(compose_config("train_probe", "model.name=tiny", "data.name=cities_a", "probe=linear",
                                       f"store_dir={store_dir}", f"results_dir={results}", "n_boot=50", "layer=2",
                                       "task=multiclass"))[0]
    apply_to_store(cell, "cities_b", store_dir, results)
    apply_to_statements(cell, ["Paris is a city in France.", "Paris is a city in Peru."], store_dir, results)
    return {str(p.relative_to(root)): fingerprint(p, root) for p in sorted(root.rglob("*"))
            if p.is_file() and p.suffix in (".json", ".png", ".csv", ".md", ".npy") and "activations" not in p.parts
            and ".hydra" not in p.parts and p.name != "cells.md"}   # (cells.md names the commit the cells were made at)


@pytest.mark.slow
def test_small_sweep_gives_the_recorded_results(tmp_path):
    with threadpool_limits(1), torch_threads(1):   # one thread: the reductions' order of the recording
        found = small_sweep(tmp_path)
    if os.environ.get("TRUTHPROBE_WRITE_GOLDEN"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(found, indent=1, sort_keys=True) + "\n")
    recorded = json.loads(GOLDEN.read_text())
    changed = sorted(k for k in recorded.keys() & found.keys() if not same(recorded[k], found[k], k))
    assert not changed, f"{len(changed)} result(s) changed: {changed[:10]}"
    assert found.keys() == recorded.keys(), (f"missing: {sorted(recorded.keys() - found.keys())[:10]}, "
                                             f"new: {sorted(found.keys() - recorded.keys())[:10]}")
