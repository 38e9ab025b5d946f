"""A result cell and its saved heads are one pair (probes.saved_pair.write_probe_cell): whatever kills or
starves a writer, every cell on disk loads a probe that reproduces the cell's own test scores, and a
heads file that is not the cell's is refused in one line. Faults are real: SIGKILL at every rename of
an overwrite sweep, a full tmpfs, files swapped or damaged by hand."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from evaluation.cells import CellError, read_cell
from evaluation.tasks import task_targets
from extract.store import ActivationStore
from probes.artifacts import fit_probe, load_probe
from probes.saved_pair import SUFFIX, artifact_path
from probes.features import layer_features
from probes.pipeline import train_probes
from toolkit.disk import DiskError
from tests.helpers import make_synthetic_store, run_cfg, tmpfs

ROOT = Path(__file__).resolve().parent.parent
TASKS = "[true_vs_all,multiclass,true_vs_false,neither_vs_all]"
OLD, NEW = "probe.C=0.01", "probe.C=10.0"   # two linear fits with different heads, the same cell paths

# One process, fresh and single-threaded: fit the overwrite sweep once per kill point in a forked child
# that SIGKILLs itself just before or just after its k-th os.replace (every rename of heads and cells).
KILL_SWEEP = """
import os, shutil, signal, sys
import torch
torch.set_num_threads(1)
from tests.helpers import run_cfg
from probes.pipeline import train_probes
dirs, old, work, new, tasks, n_points = sys.argv[1:7]
for k in range(1, int(n_points) + 1):
    for when in ("before", "after"):
        target = os.path.join(work, f"{k}-{when}")
        shutil.copytree(old, os.path.join(target, "results"))
        pid = os.fork()
        if pid == 0:
            replace, calls = os.replace, [0]
            def killing_replace(src, dst):
                calls[0] += 1
                if calls[0] == k and when == "before":
                    os.kill(os.getpid(), signal.SIGKILL)
                replace(src, dst)
                if calls[0] == k:
                    os.kill(os.getpid(), signal.SIGKILL)
            os.replace = killing_replace
            train_probes(run_cfg(__import__("pathlib").Path(dirs), "probe=linear", new, f"tasks={tasks}",
                                 "layer=[0,1]", f"results_dir={target}/results", "overwrite=true", "n_boot=10"))
            os._exit(0)
        os.waitpid(pid, 0)
"""


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pairs")
    make_synthetic_store(root / "activations", n_real=300, n_neither=150)
    return root


def sweep(dirs: Path, results: Path, *extra: str) -> list[Path]:
    return train_probes(run_cfg(dirs, "probe=linear", f"tasks={TASKS}", "layer=[0,1]", f"results_dir={results}",
                                "n_boot=10", *extra))


def assert_pairs_reproduce(dirs: Path, results: Path) -> int:
    """Every cell under `results` loads a probe whose scores on the cell's test rows are the cell's (a
    killed writer may leave heads that no cell names: never read). Returns the number of cells checked."""
    store = ActivationStore(dirs / "activations" / "synthetic" / "city_locations.h5")
    labels = store.table["label"].to_numpy()
    cells = sorted(results.rglob("seed=*.json"))
    for path in cells:
        cell = read_cell(path)
        probe = load_probe(path)
        rows, _ = task_targets(labels, cell["config"]["task"]["name"])
        data = layer_features(store, cell["layer"], probe.representation, probe.tokens).subset(
            rows[cell["test"]["rows"]])
        np.testing.assert_allclose(probe.decision_function(data), cell["test"]["scores"], rtol=1e-5, atol=1e-5,
                                   err_msg=str(path))   # float32 noise; a mixed pair differs by O(1)
    return len(cells)


def test_sigkill_at_every_rename_of_an_overwrite_leaves_old_or_new_pairs(dirs, tmp_path):
    old = tmp_path / "old"
    cells = sweep(dirs, old, OLD)
    n_renames = 2 * len(cells)   # each cell: its heads file, then the cell itself
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", KILL_SWEEP, str(dirs), str(old), str(tmp_path / "killed"), NEW, TASKS,
                           str(n_renames)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = sorted((tmp_path / "killed").iterdir())
    assert len(runs) == 2 * n_renames >= 30
    new_seen = 0
    for run in runs:
        assert assert_pairs_reproduce(dirs, run / "results") == len(cells), run
        new_seen += sum(read_cell(c)["config"]["probe"]["C"] == 10.0 for c in (run / "results").rglob("seed=*.json"))
    assert 0 < new_seen < len(runs) * len(cells)   # the kills fell before, between and after the new pairs
    rerun = runs[len(runs) // 2] / "results"
    sweep(dirs, rerun, NEW, "overwrite=true")        # a rerun completes the overwrite and removes orphans
    assert assert_pairs_reproduce(dirs, rerun) == len(cells)
    for cell in rerun.rglob("seed=*.json"):
        assert sorted(f.name for f in cell.parent.glob(f"*{SUFFIX}")) == [artifact_path(cell).name]


def test_overwrite_on_a_full_disk_keeps_the_old_pair(dirs, tmp_path):
    with tmpfs(tmp_path / "disk", "2m") as disk:
        results = disk / "results"
        [cell] = train_probes(run_cfg(dirs, "probe=linear", OLD, "task=true_vs_all", "layer=1",
                                      f"results_dir={results}", "n_boot=10"))
        before = cell.read_bytes(), artifact_path(cell).read_bytes()
        filler = disk / "filler"
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT)   # fill the disk, then give back two pages:
        for chunk in (1 << 20, 4096):                    # room for the new heads, not for the new cell
            try:
                while True:
                    os.write(fd, b"\1" * chunk)
            except OSError:
                pass
        os.close(fd)
        os.truncate(filler, filler.stat().st_size - 8192)
        with pytest.raises(DiskError, match="cannot write") as err:
            train_probes(run_cfg(dirs, "probe=linear", NEW, "task=true_vs_all", "layer=1", f"results_dir={results}",
                                 "n_boot=10", "overwrite=true"))
        assert "\n" not in str(err.value)
        assert (cell.read_bytes(), artifact_path(cell).read_bytes()) == before
        assert sorted(f.name for f in cell.parent.glob(f"*{SUFFIX}")) == [artifact_path(cell).name]
        assert assert_pairs_reproduce(dirs, results) == 1


def test_heads_that_are_not_the_cells_are_refused_in_one_line(dirs, tmp_path):
    a, b = (train_probes(run_cfg(dirs, "probe=linear", c, "task=true_vs_all", "layer=1",
                                 f"results_dir={tmp_path / name}", "n_boot=10"))[0] for c, name in ((OLD, "a"), (NEW, "b")))
    heads = artifact_path(a)
    original = heads.read_bytes()
    other = artifact_path(b).read_bytes()
    for damage, needle in [(other, "does not match the sha256"),            # another probe's heads, same shape
                           (other[:len(original)], "does not match"),       # same size, other bytes
                           (original[:-10], "bytes"), (b"", "bytes"),       # truncated, empty
                           ((2**62).to_bytes(8, "little") + original[8:], "does not match"),   # header length 2^62
                           ]:
        if len(damage) != len(original) and needle == "does not match":
            continue
        heads.write_bytes(damage)
        with pytest.raises(CellError, match=needle) as err:
            load_probe(a)
        assert "\n" not in str(err.value) and heads.name in str(err.value) and a.name in str(err.value)
    heads.unlink()
    with pytest.raises(CellError, match="no saved probe"):
        load_probe(a)


def test_a_cell_whose_layer_was_edited_is_refused(dirs, tmp_path):
    """The heads of layer 1 were applied to layer-0 vectors after someone edited the cell's `layer`."""
    import json

    cell = train_probes(run_cfg(dirs, "probe=linear", "task=true_vs_all", "layer=1", f"results_dir={tmp_path}",
                                "n_boot=10"))[0]
    load_probe(cell)
    edited = {**json.loads(cell.read_text()), "layer": 0}
    cell.write_text(json.dumps(edited))
    with pytest.raises(CellError, match="says layer 0, but its heads were fitted at layer 1") as err:
        load_probe(cell)
    assert "\n" not in str(err.value)


def test_saving_a_fitted_probe_by_either_name(dirs, tmp_path):
    store = ActivationStore(dirs / "activations" / "synthetic" / "city_locations.h5")
    X = store.last_token(1, (2,))
    y = (store.table["label"].to_numpy() == 1).astype(int)
    rows = np.arange(len(y))
    probe = fit_probe("linear", X, y, rows[::2], rows[1::2], groups=np.arange(len(y)) // 2, layer=1)   # Cs: a list
    saved = probe.save(tmp_path / "mine.probe.safetensors")
    assert saved == tmp_path / "mine.json"
    assert [f.name for f in tmp_path.glob(f"*{SUFFIX}")] == [artifact_path(saved).name]
    np.testing.assert_array_equal(load_probe(saved).decision_function(X), probe.decision_function(X))
    again = probe.save(saved)                                       # saving twice keeps one heads file
    assert again == saved and len(list(tmp_path.glob(f"*{SUFFIX}"))) == 1
