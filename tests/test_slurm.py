"""A real SLURM multirun (`hydra/launcher=slurm`, hydra-submitit-launcher) against a running cluster,
e.g. the one-node cluster of `scripts/slurm_local.sh up`: the cells the SLURM jobs write equal the
cells of the same sweep run locally (the same configs composed in-process, as the local launcher
would run them), and the launcher presets compose as documented.

Skipped when there is no `sinfo` or no reachable cluster with a usable node. The store and results
live under pytest's tmp dir, which the jobs must see: on a multi-node cluster point
TRUTHPROBE_SLURM_TEST_DIR at a shared folder."""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hydra import compose, initialize_config_dir

from toolkit.config import CONF_DIR, compose_config
from probes.pipeline import train_probes
from tests.helpers import make_synthetic_store

ROOT = Path(__file__).resolve().parent.parent
PROBES, LAYERS = ("mean_diff", "linear"), (0, 1)
USABLE = ("idle", "mixed", "allocated", "completing")
COMMON = ["model.name=synthetic", "task=true_vs_all", "n_boot=100"]
SWEEP = [*COMMON, f"probe={','.join(PROBES)}", f"layer={','.join(map(str, LAYERS))}"]
# fields that legitimately differ between the two runs (provenance: the command that wrote the cell)
IGNORED = {"fit_seconds", "provenance"}
IGNORED_CONFIG = {"results_dir"}


def cluster_problem() -> str | None:
    """Why no job could run on SLURM here, or None when a node is ready."""
    if shutil.which("sinfo") is None:
        return "no SLURM client (sinfo not found): start a local cluster with `scripts/slurm_local.sh up`"
    try:
        result = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return "sinfo timed out: is slurmctld up? (`scripts/slurm_local.sh up`)"
    if result.returncode != 0:
        return f"SLURM cluster not reachable ({result.stderr.strip()[:200]}): `scripts/slurm_local.sh up`"
    states = [s.rstrip("*~#!%$@^-") for s in result.stdout.split()]
    if not any(s in USABLE for s in states):
        return f"no usable SLURM node (node states: {states}): `scripts/slurm_local.sh up` resumes a drained node"
    return None


@pytest.fixture(scope="module")
def cluster():
    problem = cluster_problem()
    if problem:
        pytest.skip(problem)


@pytest.fixture
def workdir(tmp_path):
    shared = os.environ.get("TRUTHPROBE_SLURM_TEST_DIR")
    if not shared:
        yield tmp_path
        return
    path = Path(shared).resolve() / f"test_slurm-{os.getpid()}-{time.time_ns()}"
    path.mkdir(parents=True)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def hydra_config(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("train_probe", overrides=list(overrides), return_hydra_config=True)


def test_launcher_presets_compose():
    """No cluster needed: the presets exist, pick the intended launchers and take overrides."""
    local = hydra_config("hydra/launcher=local").hydra.launcher
    assert local._target_ == "hydra._internal.core_plugins.basic_launcher.BasicLauncher"
    slurm = hydra_config("hydra/launcher=slurm", "hydra.launcher.partition=gpu", "hydra.launcher.gpus_per_node=1",
                         "hydra.launcher.mem_gb=64").hydra.launcher
    assert slurm._target_.endswith("submitit_launcher.SlurmLauncher")
    assert (slurm.partition, slurm.gpus_per_node, slurm.mem_gb) == ("gpu", 1, 64)
    for key in ("cpus_per_task", "timeout_min", "array_parallelism"):
        assert key in slurm
    assert slurm._get_node("submitit_folder")._value().startswith("${hydra.sweep.dir}/")
    assert slurm.additional_parameters._get_node("chdir")._value() == "${hydra.runtime.cwd}"


def multirun(launcher: str, work: Path, name: str, *extra: str, timeout: int) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "train_probe", "-m", f"hydra/launcher={launcher}", *SWEEP,
               f"store_dir={work / 'activations'}", f"results_dir={work / name}",
               f"hydra.sweep.dir={work / ('sweep_' + name)}", *extra]
    started = time.perf_counter()
    try:
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        cancel_jobs(work / f"sweep_{name}")
        pytest.fail(f"{launcher} multirun still running after {timeout}s; its jobs were cancelled.\n"
                    f"stderr tail:\n{(err.stderr or b'')[-3000:]!r}")
    print(f"{launcher} multirun: {time.perf_counter() - started:.1f}s")
    assert result.returncode == 0, f"{launcher} multirun failed:\n{result.stderr[-4000:]}"
    return result


def slurm_job_ids(sweep_dir: Path) -> list[str]:
    """<array job id>_<task> of each submitted task, from submitit's folders (named after %j)."""
    folder = sweep_dir / ".submitit"
    return sorted(p.name for p in folder.iterdir() if re.fullmatch(r"\d+_\d+", p.name)) if folder.is_dir() else []


def cancel_jobs(sweep_dir: Path) -> None:
    ids = sorted({job.split("_")[0] for job in slurm_job_ids(sweep_dir)})
    if ids:
        subprocess.run(["scancel", *ids], capture_output=True)


def assert_jobs_completed(array_id: str, wait_s: float = 60) -> None:
    deadline = time.monotonic() + wait_s
    while True:
        shown = subprocess.run(["scontrol", "-o", "show", "job", array_id], capture_output=True, text=True)
        states = re.findall(r"JobState=(\S+)", shown.stdout)
        if not states or set(states) == {"COMPLETED"}:
            return
        unfinished = set(states) & {"PENDING", "RUNNING", "COMPLETING", "CONFIGURING"}
        assert unfinished, f"SLURM reports {states}:\n{shown.stdout}"
        assert time.monotonic() < deadline, f"still {states} after {wait_s}s:\n{shown.stdout}"
        time.sleep(1)


def assert_same(a, b, where: str = "cell") -> None:
    """Equal structure and values: integers, strings, predictions exactly, floats to 1e-9 relative
    (the same code on the same data; a different BLAS thread count may move the last bits)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) or isinstance(b, float):
        assert math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12), f"{where}: {a} != {b}"
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def comparable(path: Path) -> dict:
    cell = json.loads(path.read_text())
    for key in IGNORED:
        cell.pop(key)
    for key in IGNORED_CONFIG:
        cell["config"].pop(key)
    return cell


def cell_relpath(probe: str, layer: int) -> Path:
    return Path("synthetic", "city_locations", probe, "true_vs_all", "entity_disjoint", f"layer={layer}", "seed=0.json")


@pytest.mark.slurm
@pytest.mark.slow
def test_slurm_sweep_equals_local_sweep(cluster, workdir):
    make_synthetic_store(workdir / "activations")

    # on SLURM: one array task per (probe, layer), 1 core and 1 GB each so the two run side by side
    slurm = multirun("slurm", workdir, "slurm", "hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_gb=1",
                     "hydra.launcher.timeout_min=15", timeout=480)
    jobs = slurm_job_ids(workdir / "sweep_slurm")
    assert len(jobs) == len(PROBES) * len(LAYERS), (jobs, slurm.stderr[-3000:])
    for job in jobs:  # each ran under SLURM, through srun, with the submitting interpreter
        log = (workdir / "sweep_slurm" / ".submitit" / job / f"{job}_0_log.out").read_text()
        assert f"JobEnvironment(job_id={job}," in log and "Job completed successfully" in log, log
    submission = next((workdir / "sweep_slurm" / ".submitit").glob("*/*_submission.sh")).read_text()
    assert "srun --unbuffered" in submission and sys.executable in submission, submission
    assert f"--chdir={ROOT}" in submission, submission

    # the same sweep locally: each job's config composed as `-m hydra/launcher=local` would, run
    # in this process (a CLI multirun would spend its time re-importing torch / lightning)
    for probe in PROBES:
        for layer in LAYERS:
            train_probes(compose_config("train_probe", *COMMON, f"probe={probe}", f"layer={layer}",
                                        f"store_dir={workdir / 'activations'}", f"results_dir={workdir / 'local'}"))

    # SLURM's own record: every array task COMPLETED (a task may still be exiting when its result
    # file appears; slurmctld forgets finished jobs after MinJobAge, 300 s on the local cluster)
    assert_jobs_completed(jobs[0].split("_")[0])

    for probe in PROBES:
        for layer in LAYERS:
            on_slurm, local = workdir / "slurm" / cell_relpath(probe, layer), workdir / "local" / cell_relpath(probe, layer)
            assert on_slurm.exists(), f"SLURM job wrote no {on_slurm}"
            assert local.exists(), f"local run wrote no {local}"
            a, b = comparable(on_slurm), comparable(local)
            assert a["config"]["probe"]["name"] == probe and a["layer"] == layer
            assert a["test"]["pred"] == b["test"]["pred"] and a["test"]["sets"] == b["test"]["sets"]
            assert_same(a, b, f"{probe}/layer={layer}")
    # the planted direction is found at layer 1 (the jobs did real work)
    assert json.loads((workdir / "slurm" / cell_relpath("linear", 1)).read_text())["metrics"]["mcc_all"] >= 0.9
