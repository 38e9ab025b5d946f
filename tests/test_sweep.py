"""`python -m experiments.sweep`: one train_probe job per (probe, layer) over a shared queue, longest first;
its cells equal those of plain train_probe runs; bad options are one line before any job; its workers end with
a killed sweep."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from experiments.sweep import COST, plan, replay, shared_gpu_warning
from toolkit.errors import ToolkitError
from probes.pipeline import train_probes
from tests.helpers import comparable, make_synthetic_store, run_cfg

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sweep")
    make_synthetic_store(root / "activations", n_real=300, n_neither=150)
    return root


def _args(dirs: Path, results: Path) -> list[str]:
    return ["model.name=synthetic", f"store_dir={dirs / 'activations'}", f"results_dir={results}", "n_boot=20",
            "tasks=[true_vs_all,multiclass]"]


def test_jobs_cover_every_stored_layer_longest_first(dirs):
    jobs = plan(_args(dirs, dirs / "r"), ["mean_diff", "linear", "samil"])
    assert sorted(j[:2] for j in jobs) == sorted((p, k) for p in ("mean_diff", "linear", "samil") for k in (0, 1))
    costs = [COST[p] for p, _, _ in jobs]
    assert costs == sorted(costs, reverse=True) and jobs[0][0] == "samil"
    assert [j[:2] for j in plan([*_args(dirs, dirs / "r"), "layer=[1]"], ["linear"])] == [("linear", 1)]
    only = plan([*_args(dirs, dirs / "r"), "samil.layer=[1]", "samil.C=100"], ["linear", "samil"])
    assert [j[:2] for j in only] == [("samil", 1), ("linear", 0), ("linear", 1)]
    assert "probe.C=100" in only[0][2] and not any("probe.C" in o for o in only[1][2])


def test_replay_is_the_workers_schedule():
    # 2 workers: 5 | 4, then 3 on the one free at 4 (-> 7), 3 on the one free at 5 (-> 8), 3 at 7 (-> 10)
    assert replay([5.0, 4.0, 3.0, 3.0, 3.0], 2) == 10.0
    assert replay([5.0, 4.0, 3.0, 3.0, 3.0], 1) == 18.0
    assert replay([5.0, 4.0, 3.0], 8) == 5.0 and replay([], 2) == 0.0


def test_sweep_cells_equal_plain_train_probe_runs(dirs, tmp_path):
    results = tmp_path / "swept"
    done = subprocess.run([sys.executable, "-m", "experiments.sweep", *_args(dirs, results),
                           "probes=[mean_diff,linear]", "workers=2", "trainer.accelerator=cpu"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count(" done in ") == 4
    swept = sorted(results.rglob("seed=*.json"))
    assert len(swept) == 2 * 2 * 2   # probes x layers x tasks
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # as the sweep's workers (threads=1): float sums in the same order
    try:
        for probe in ("mean_diff", "linear"):
            train_probes(run_cfg(dirs, f"probe={probe}", "tasks=[true_vs_all,multiclass]", "layer=[0,1]",
                                 "n_boot=20", "trainer.accelerator=cpu", f"results_dir={tmp_path / 'plain'}"))
    finally:
        torch.set_num_threads(threads)
    for path in swept:
        plain = tmp_path / "plain" / path.relative_to(results)
        a, b = comparable(path), comparable(plain)
        for cell in (a, b):
            cell["config"].pop("layer")   # a job names its one layer, a plain run the list
        assert a == b, path


@pytest.mark.parametrize("args, needle", [(["probes=[linear,bogus]"], "probes="), (["workers=0"], "workers="),
                                          (["workers=two"], "workers="), (["data=bogus"], "data"),
                                          (["probes=[linear]", "linear.bogus=1"], "bogus")])
def test_bad_options_are_one_line_before_any_job(dirs, tmp_path, args, needle):
    done = subprocess.run([sys.executable, "-m", "experiments.sweep", *_args(dirs, tmp_path / "r"), *args], cwd=ROOT,
                          capture_output=True, text=True)
    errors = [line for line in done.stderr.splitlines() if "ERROR" in line]
    assert done.returncode == 1 and len(errors) == 1 and needle in errors[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr and not (tmp_path / "r").exists()
    with pytest.raises(ToolkitError):
        plan(_args(dirs, tmp_path / "r"), [])


def test_several_workers_on_one_gpu_are_warned_about(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert "all fit on cuda:0" in shared_gpu_warning("auto", 16)
    assert "all fit on cuda:0" in shared_gpu_warning("gpu", 2)
    assert shared_gpu_warning("cpu", 16) is None and shared_gpu_warning("auto", 1) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert shared_gpu_warning("auto", 16) is None


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_workers_end_with_a_killed_sweep(dirs, tmp_path):
    """SIGKILL of the sweep's main process: its workers are gone within seconds (they wrote whole cells or none)."""
    sweep = subprocess.Popen([sys.executable, "-m", "experiments.sweep", *_args(dirs, tmp_path / "r"),
                              "probes=[mlp,linear]", "workers=2", "trainer.accelerator=cpu"], cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    workers: list[int] = []
    while len(workers) < 2 and time.monotonic() < deadline:
        workers = [p for p in _children(sweep.pid) if "spawn_main" in Path(f"/proc/{p}/cmdline").read_text()]
        time.sleep(0.2)
    assert len(workers) == 2, "the sweep started no workers"
    sweep.kill()
    sweep.wait()
    deadline = time.monotonic() + 60   # (a second each when idle; a worker still importing torch on a loaded
    while any(_alive(p) for p in workers) and time.monotonic() < deadline:   # machine starts its watchdog later)
        time.sleep(0.2)
    assert not any(_alive(p) for p in workers), [p for p in workers if _alive(p)]
    assert not list((tmp_path / "r").rglob("*.tmp*"))


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_killed_worker_fails_its_job_in_one_line_and_the_others_go_on(dirs, tmp_path):
    """SIGKILL of one worker (as the out-of-memory killer does) used to end the whole sweep in a
    BrokenProcessPool traceback naming no job; now its job is one FAILED line and new workers take the rest."""
    import tempfile

    command = [sys.executable, "-m", "experiments.sweep", *_args(dirs, tmp_path / "r"), "probes=[mlp,linear]",
               "workers=2", "trainer.accelerator=cpu", f"hydra.run.dir={tmp_path / 'logs'}"]
    sweep = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline, held = time.monotonic() + 120, None
    while held is None and time.monotonic() < deadline:
        workers = set(_children(sweep.pid))
        for mark in Path(tempfile.gettempdir()).glob("sweep-running-*/*"):
            if mark.name.isdigit() and int(mark.name) in workers:
                try:
                    held = int(mark.name), mark.read_text().split()
                except OSError:
                    continue
                break
        time.sleep(0.05)
    assert held is not None, "no worker held a job"
    os.kill(held[0], 9)
    _, err = sweep.communicate(timeout=300)
    probe, layer = held[1]
    assert sweep.returncode == 1 and "Traceback" not in err and "BrokenProcessPool" not in err, err[-3000:]
    failed = [line for line in err.splitlines() if "FAILED" in line]
    assert len(failed) == 1 and f"{probe} layer {layer}: FAILED: its worker died" in failed[0], err[-3000:]
    cells = sorted((tmp_path / "r").rglob("seed=*.json"))
    assert len(cells) == 3 * 2 and not any(f"/{probe}/" in str(c) and f"layer={layer}/" in str(c) for c in cells)
    again = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)   # the rerun finishes it
    assert again.returncode == 0 and len(list((tmp_path / "r").rglob("seed=*.json"))) == 4 * 2, again.stderr[-3000:]
