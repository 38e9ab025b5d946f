"""Sharded extraction (extract.shards) on the tiny model: shards=N shard=i slices are a label-stratified
partition of the datapack; their merge reads like a single-process store, row for row (float16
rounding: other batches); a SIGKILLed shard resumes alone, bit-identical; a missing, incomplete or
foreign shard (another model or dtype) is refused in one line. With a SLURM cluster: the shards run
as a SLURM array (`-m shard='range(2)' hydra/launcher=slurm`) and merge to the same store."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from toolkit.errors import ToolkitError
from extract.run import extract
from extract.shards import shard_path, shard_rows
from extract.store import ActivationStore, StoreError
from tests.helpers import extract_config
from tests.test_extract import assert_fp16_close
from tests.test_slurm import cluster_problem, slurm_job_ids

ROOT = Path(__file__).resolve().parent.parent
COMMON = ["model=tiny", "data=city_locations", "layers=[0,1,4]", "batch_tokens=400"]
ARGS = [*COMMON, "limit=60", "window_tokens=300"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def store(root: Path) -> Path:
    return root / "tiny" / "city_locations.h5"


def assert_same_rows(merged: Path, single: Path) -> None:
    """Same table, tokens and offsets; every layer equal to float16 rounding; the manifest covers every row."""
    with ActivationStore(merged) as a, ActivationStore(single) as b:
        assert a.table.equals(b.table) and a.layers == b.layers
        for name in ("offsets", "token_ids", "token_kind"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
        for k in a.layers:
            assert_fp16_close(a.layer(k), b.layer(k))
        manifest = json.loads(a.attrs["shard_manifest"])
        covered = sorted(r for shard in manifest for lo, hi in shard["rows"] for r in range(lo, hi))
        assert covered == list(range(a.n_statements))


def test_shard_rows_are_a_label_stratified_partition():
    labels = np.random.default_rng(0).choice([0, 1, 2], size=1001, p=[0.5, 0.3, 0.2])
    parts = [shard_rows(labels, 4, i) for i in range(4)]
    assert sorted(np.concatenate(parts).tolist()) == list(range(1001))
    for label in (0, 1, 2):
        sizes = [int((labels[p] == label).sum()) for p in parts]
        assert max(sizes) - min(sizes) <= 1
    assert all(np.array_equal(p, shard_rows(labels, 4, i)) for i, p in enumerate(parts))


def test_merged_shards_read_as_a_single_process_store(tmp_path):
    for i in range(2):
        extract(extract_config(*ARGS, f"store_dir={tmp_path}", "shards=2", f"shard={i}"))
    merged = extract(extract_config(*ARGS, f"store_dir={tmp_path}", "shards=2"))
    single = extract(extract_config(*ARGS, f"store_dir={tmp_path / 'single'}"))
    assert merged == store(tmp_path)
    assert_same_rows(merged, single)
    assert extract(extract_config(*ARGS, f"store_dir={tmp_path}", "shards=2")) == merged   # complete: nothing to do


def test_missing_incomplete_or_foreign_shard_is_refused(tmp_path):
    root = tmp_path / "s"
    extract(extract_config(*ARGS, f"store_dir={root}", "shards=2", "shard=0"))
    for extra, message in [([], "shard 1 of 2 is missing"),
                           (["model.seed=1"], "shard 1 of 2 was made with another model_fingerprint"),
                           (["dtype=float32"], "shard 1 of 2 was made with another dtype ('float32', shard 0: 'float16')"),
                           (["model.dtype=bfloat16"], "shard 1 of 2 was made with another compute_dtype")]:
        if extra:
            extract(extract_config(*ARGS, f"store_dir={root}", "shards=2", "shard=1", "overwrite=true", *extra))
        with pytest.raises(StoreError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
            extract(extract_config(*ARGS, f"store_dir={root}", "shards=2"))
        assert "\n" not in str(err.value) and not store(root).exists()
    with h5py.File(shard_path(store(root), 2, 1), "r+") as f:
        f.attrs["n_done"] = 3
    with pytest.raises(StoreError, match=r"shard 1 of 2 is incomplete \(3/\d+ statements\): rerun it"):
        extract(extract_config(*ARGS, f"store_dir={root}", "shards=2"))
    with pytest.raises(ToolkitError, match="shard=2 is outside 0..1"):
        extract(extract_config(*ARGS, f"store_dir={root}", "shards=2", "shard=2"))


def shard_command(store_dir: Path, shard: int) -> list[str]:
    return [sys.executable, "-m", "extract", *COMMON, "limit=200", "window_tokens=200", f"store_dir={store_dir}",
            "shards=2", f"shard={shard}", f"hydra.run.dir={store_dir}/logs/{shard}-{time.time_ns()}"]


def test_killed_shard_resumes_alone_identical(tmp_path):
    """SIGKILL shard 1 after its first windows, rerun it: equal bit for bit to shard 1 run uninterrupted."""
    killed = shard_path(store(tmp_path / "a"), 2, 1)
    proc = subprocess.Popen(shard_command(tmp_path / "a", 1), cwd=ROOT, env=ENV, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        try:
            with h5py.File(killed, "r", locking=False) as f:
                if 0 < f.attrs["n_done"] < 60:
                    break
        except (OSError, KeyError):
            pass
        time.sleep(0.02)
    assert proc.poll() is None, "shard 1 finished before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    with ActivationStore(killed, allow_incomplete=True) as partial:
        assert 0 < partial.n_done < partial.n_statements
    for root in (tmp_path / "a", tmp_path / "b"):
        subprocess.run(shard_command(root, 1), cwd=ROOT, env=ENV, check=True, capture_output=True)
    with ActivationStore(killed) as a, ActivationStore(shard_path(store(tmp_path / "b"), 2, 1)) as b:
        np.testing.assert_array_equal(a.token_ids, b.token_ids)
        for k in a.layers:
            np.testing.assert_array_equal(a.layer(k), b.layer(k))


@pytest.mark.slurm
@pytest.mark.slow
def test_shards_as_a_slurm_array_merge_to_the_single_process_store(tmp_path):
    problem = cluster_problem()
    if problem:
        pytest.skip(problem)
    work = Path(os.environ.get("TRUTHPROBE_SLURM_TEST_DIR") or tmp_path).resolve() / f"shards-{time.time_ns()}"
    command = [sys.executable, "-m", "extract", "-m", *ARGS, f"store_dir={work}", "shards=2", "shard=range(2)",
               "hydra/launcher=slurm", "hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_gb=2",
               "hydra.launcher.timeout_min=15", f"hydra.sweep.dir={work / 'sweep'}"]
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=480)
        assert done.returncode == 0, done.stderr[-4000:]
        jobs = slurm_job_ids(work / "sweep")
        assert len(jobs) == 2, jobs
        for job in jobs:
            log = (work / "sweep" / ".submitit" / job / f"{job}_0_log.out").read_text()
            assert f"JobEnvironment(job_id={job}," in log, log
        merged = extract(extract_config(*ARGS, f"store_dir={work}", "shards=2"))
        single = extract(extract_config(*ARGS, f"store_dir={work / 'single'}"))
        assert_same_rows(merged, single)
    finally:
        if not os.environ.get("TRUTHPROBE_SLURM_TEST_DIR"):
            shutil.rmtree(work, ignore_errors=True)
