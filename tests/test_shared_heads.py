"""One job, several tasks (probes/fitting.py HeadBank): the three one-vs-all cells and the multiclass
cell of a layer derived from the same fitted heads equal the cells of separate one-task runs, and a
sweep killed mid-way resumes cell by cell."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from probes.saved_pair import artifact_path
from probes.pipeline import train_probes
from tests.helpers import comparable, make_synthetic_store, run_cfg

ROOT = Path(__file__).resolve().parent.parent
TASKS = ["true_vs_all", "false_vs_all", "neither_vs_all", "multiclass", "true_vs_false"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("shared")
    make_synthetic_store(root / "activations", n_real=300, n_neither=150)
    return root


@pytest.mark.parametrize("probe", ["mlp", "linear"])   # mlp: random initialisation; linear: CV inside each head
def test_derived_cells_equal_separate_runs(dirs, probe):
    shared = train_probes(run_cfg(dirs, f"probe={probe}", f"tasks=[{','.join(TASKS)}]", "layer=[0,1]",
                                  f"results_dir={dirs / 'shared'}"))
    assert len(shared) == 2 * len(TASKS)
    for task in TASKS:
        alone = train_probes(run_cfg(dirs, f"probe={probe}", f"task={task}", "layer=[0,1]",
                                     f"results_dir={dirs / 'alone'}"))
        for a in alone:
            s = dirs / "shared" / a.relative_to(dirs / "alone")
            assert comparable(s) == comparable(a), (task, a)
            assert artifact_path(s).read_bytes() == artifact_path(a).read_bytes()   # the same fitted heads


def test_killed_sweep_resumes_cell_by_cell(dirs, tmp_path):
    """SIGKILL a five-task sweep once some cells exist: the cells written are complete, the rerun
    writes only the missing ones (existing ones untouched) and the result equals an uninterrupted run."""
    results = tmp_path / "results"
    args = [sys.executable, "-m", "train_probe", "model.name=synthetic", f"store_dir={dirs / 'activations'}",
            f"results_dir={results}", "n_boot=100", "probe=mlp", f"tasks=[{','.join(TASKS)}]", "layer=[0,1]",
            "hydra.run.dir=" + str(tmp_path / "logs")]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 300
    while time.time() < deadline and len(list(results.rglob("*.json"))) < 3:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    first = {p: p.stat().st_mtime_ns for p in results.rglob("*.json")
             if not p.name.startswith(".tmp")}        # (a temporary the kill left mid-write is no cell)
    assert 3 <= len(first) < 2 * len(TASKS), len(first)
    for p in first:
        json.loads(p.read_text())                      # every cell on disk is whole
        assert artifact_path(p).is_file()
    subprocess.run(args, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert not list(results.rglob(".tmp*"))      # a temporary the kill left mid-write is removed by the rerun
    after = list(results.rglob("*.json"))
    assert len(after) == 2 * len(TASKS)
    assert all(p.stat().st_mtime_ns == t for p, t in first.items())   # existing cells were skipped
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # as the killed run (OMP_NUM_THREADS=1): float sums in the same order
    try:
        uninterrupted = train_probes(run_cfg(dirs, "probe=mlp", f"tasks=[{','.join(TASKS)}]", "layer=[0,1]",
                                             f"results_dir={tmp_path / 'straight'}"))
    finally:
        torch.set_num_threads(threads)
    for p in uninterrupted:
        q = results / p.relative_to(tmp_path / "straight")
        assert comparable(q) == comparable(p)
