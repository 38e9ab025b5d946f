"""Helpers shared by several test modules (conftest.py holds the shared fixtures): config composition,
entry points run as subprocesses, synthetic stores with planted directions, CSV datapacks of the tiny
model, tmpfs mounts and full disks, result cells compared without what differs between runs."""
from __future__ import annotations

import json
import subprocess
import sys
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Callable, Sequence

import h5py
import numpy as np
import pandas as pd
import pytest

from toolkit.config import compose_config
from extract.statements import DATA_DIR, load_statements
from extract.store import KIND_SPECIAL, KIND_STATEMENT
from extract.store_writer import create_store

ROOT = Path(__file__).resolve().parent.parent
extract_config = partial(compose_config, "extract")
probe_config = partial(compose_config, "train_probe")


# ------------------------------------------------------------------------ entry points, configs
def whole_cities_csv(path: Path, n_real: int, n_synthetic: int) -> Path:
    """A city_locations CSV datapack at `path`: every statement about the first `n_real` real and `n_synthetic`
    synthetic cities (whole subjects, table order)."""
    parts = []
    for name, n in (("city_locations.csv", n_real), ("city_locations_synthetic.csv", n_synthetic)):
        table = pd.read_csv(DATA_DIR / name, dtype=str, keep_default_na=False)
        parts.append(table[table["object_1"].isin(table["object_1"].drop_duplicates().iloc[:n])])
    pd.concat(parts).to_csv(path, index=False)
    return path


def run_module(module: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`python -m <module> args` from the repository root, its Hydra run folder under `cwd`."""
    return subprocess.run([sys.executable, "-m", module, *args, f"hydra.run.dir={cwd / 'logs'}"], cwd=ROOT,
                          capture_output=True, text=True)


def assert_one_error_line(result: subprocess.CompletedProcess, needle: str) -> None:
    """Exit status 1 with exactly one ERROR line, containing `needle`, and no traceback."""
    errors = [line for line in result.stderr.splitlines() if "ERROR" in line]
    assert result.returncode == 1, result.stderr[-2000:]
    assert len(errors) == 1 and needle in errors[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr


def run_cfg(dirs: Path, *overrides: str):
    """The train_probe config of model `synthetic` (make_synthetic_store) under `dirs`, 100 bootstrap resamples."""
    return probe_config("model.name=synthetic", f"store_dir={dirs / 'activations'}",
                        f"results_dir={dirs / 'results'}", "n_boot=100", *overrides)


def compose_apply(*args: str):
    """The config `python -m apply_probe args` runs with (probe= / text= / csv= quoted as the CLI does)."""
    from probes.apply import hydra_arguments

    return compose_config("apply_probe", *hydra_arguments(list(args)))


def comparable(path: Path) -> dict:
    """A cell without its timing and provenance (which differ between two runs: the command, the hash of
    a config with another results_dir)."""
    cell = json.loads(path.read_text())
    cell.pop("fit_seconds")
    cell.pop("provenance")
    cell["config"].pop("results_dir")
    return cell


# ------------------------------------------------------------------------------------- stores
def make_synthetic_store(store_dir: Path, n_real: int = 900, n_neither: int = 400, seed: int = 0, *,
                         model: str = "synthetic", layers: Sequence[int] = (0, 1), n_layers: int = 1,
                         strength: Callable[[int], float] = lambda k: 5.0 * k, dim: int = 24,
                         max_length: int = 10, table: pd.DataFrame | None = None,
                         datapack: str = "city_locations") -> Path:
    """A store for `model` (`n_layers` deep), datapack `datapack`: the statements of `table`, by default real
    city_locations statements and entities (the first `n_real` rows and the last `n_neither`), random token
    vectors (4 to max_length - 1 tokens); at each stored layer k the last two statement tokens carry their
    class's direction (axis 0, 1 or 2) with strength `strength(k)`. By default layer 1 has strength 5, layer 0
    is pure noise."""
    if table is None:
        table = load_statements("city_locations")
        table = table.iloc[np.r_[0:n_real, len(table) - n_neither:len(table)]].reset_index(drop=True)
    rng = np.random.default_rng(seed)
    lengths = rng.integers(4, max_length, size=len(table))
    ids = [rng.integers(10, 500, size=n) for n in lengths]
    kinds = [np.r_[KIND_SPECIAL, np.full(n - 1, KIND_STATEMENT)].astype(np.int8) for n in lengths]
    path = store_dir / model / f"{datapack}.h5"
    create_store(path, table, ids, kinds, list(layers), dim, "float32",
                 {"model_id": model, "model_fingerprint": "0", "n_layers": n_layers, "datapack": datapack})
    ends = np.cumsum(lengths)
    with h5py.File(path, "r+") as f:
        for k in layers:
            x = rng.standard_normal((ends[-1], dim)).astype(np.float32)
            signal = strength(k)
            if signal:
                for end, label in zip(ends, table["label"]):
                    x[end - 2:end, label] += signal
            f[f"layers/{k}"][:] = x
        f.attrs["n_done"] = len(table)
    return path


def make_depth_store(store_dir: Path, model: str, layers: list[int], n_layers: int, peak: int,
                     n_real: int = 200, n_neither: int = 100, seed: int = 0) -> Path:
    """make_synthetic_store with more layers: a store for `model` (n_layers deep) whose class direction
    has strength 3 / (1 + |layer - peak|) (16 dimensions, 4 to 7 tokens a statement)."""
    return make_synthetic_store(store_dir, n_real, n_neither, seed, model=model, layers=layers, n_layers=n_layers,
                                strength=lambda k: 3.0 / (1 + abs(k - peak)), dim=16, max_length=8)


def datapack_csv(path: Path, real: slice, neither: slice) -> Path:
    """A CSV datapack of city statements: the vendored rows `real` and synthetic (neither) rows `neither`."""
    table = load_statements("city_locations")
    synthetic = table[table["label"] == 2]
    rows = np.r_[np.arange(len(table))[real], synthetic.index.to_numpy()[neither]]
    table.iloc[rows][["statement", "label", "object_1", "object_2", "negation"]].to_csv(path, index=False)
    return path


def extract_csv(root: Path, name: str, csv: Path, store_dir: Path, *overrides: str) -> Path:
    """The tiny model's store of the CSV datapack `csv`, named `name`, under `store_dir`."""
    from extract.run import extract

    return extract(compose_config("extract", "model=tiny", "data=csv", f"data.path={csv}", f"data.name={name}",
                                  "data.label_column=label", f"store_dir={store_dir}", *overrides))


# --------------------------------------------------------------------------------------- disks
@contextmanager
def tmpfs(target: Path, size: str, *options: str):
    """A tmpfs of `size` mounted at `target` (needs root; CI runs as root), unmounted afterwards."""
    target.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join([f"size={size}", *options]), "tmpfs",
                           str(target)], capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs (needs root): {done.stderr.strip()}")
    try:
        yield target
    finally:
        if subprocess.run(["umount", str(target)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(target)], capture_output=True)


def fill_disk(folder: Path) -> Path:
    """`folder`'s file system filled up (with one file, returned)."""
    filler = folder / "filler"
    with filler.open("wb") as f:
        try:
            while True:
                f.write(b"\1" * (1 << 20))
                f.flush()
        except OSError:
            pass
    return filler
