"""Fault injection on `python -m extract` (tiny model): real full disks (small tmpfs mounts, root),
SIGKILL at named moments, two processes at once, bad options. Each test shows that nothing was
lost or mixed: a refused run writes nothing, a failed run's `n_done` covers only rows on disk,
and a rerun ends bit-identical to an uninterrupted run."""
from __future__ import annotations

import ctypes
import itertools
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import h5py
import numpy as np
import pytest

from extract.store import ActivationStore, StoreError
from tests.helpers import fill_disk, tmpfs

ROOT = Path(__file__).resolve().parent.parent
N, WINDOW = 300, 600
STANDARD = ["model=tiny", "data=city_locations", f"limit={N}", "batch_tokens=1024", f"window_tokens={WINDOW}",
            "layers=[0,1,4]"]
STORE = Path("tiny") / "city_locations.h5"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}  # on a busy machine a second torch thread only spins
LOGS: list[Path] = []  # Hydra's run folders go here, never onto the small disks under test
_RUN_NUMBER = itertools.count()


@pytest.fixture(scope="module", autouse=True)
def _log_folder(tmp_path_factory):
    LOGS.append(tmp_path_factory.mktemp("logs"))


KILL_AFTER = """
import os, runpy, signal, sys
import extract.store_writer as writer
name = sys.argv.pop(1)
real = getattr(writer, name)
def kill_after(*args, **kwargs):
    real(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGKILL)
setattr(writer, name, kill_after)
runpy.run_module("extract", run_name="__main__", alter_sys=True)
"""


# ------------------------------------------------------------------------------------- helpers
def command(store_dir: Path, *extra: str, kill_after: str | None = None) -> list[str]:
    """`python -m extract` with the STANDARD options; `kill_after`: SIGKILL once that function of
    extract.store_writer has returned."""
    head = [sys.executable, "-c", KILL_AFTER, kill_after] if kill_after else [sys.executable, "-m", "extract"]
    return [*head, *STANDARD, f"store_dir={store_dir}", f"hydra.run.dir={LOGS[-1]}/{next(_RUN_NUMBER)}", *extra]


def run(store_dir: Path, *extra: str, kill_after: str | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run(command(store_dir, *extra, kill_after=kill_after), cwd=ROOT, env=ENV, capture_output=True)
    return subprocess.CompletedProcess(done.args, done.returncode, None, done.stderr.decode())


def start(store_dir: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(command(store_dir, *extra), cwd=ROOT, env=ENV, stderr=subprocess.PIPE)


def finish(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    stderr = proc.communicate(timeout=600)[1]
    return subprocess.CompletedProcess(proc.args, proc.returncode, None, stderr.decode())


def lines(stderr: str) -> list[str]:
    """What a terminal shows of stderr (a progress bar overwrites itself with \\r)."""
    return [seg for line in stderr.split("\n") if (seg := line.split("\r")[-1].strip())]


def assert_one_error_line(done: subprocess.CompletedProcess, pattern: str, before_work: bool = True) -> str:
    """Exit 1 with one error line containing `pattern`, the last line; `before_work`: the only line (besides
    the entry point's note of its torch threads)."""
    shown = [line for line in lines(done.stderr) if "torch CPU threads:" not in line]
    errors = [line for line in shown if " ERROR] " in line]
    assert done.returncode == 1 and errors == shown[-1:], done.stderr[-3000:]
    assert len(shown) == 1 or not before_work, done.stderr[-3000:]
    assert pattern in errors[0], errors[0]
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr
    return errors[0]


def n_done(path: Path) -> int | None:
    """n_done of a store another process may be writing (read without HDF5's lock)."""
    try:
        with h5py.File(path, "r", locking=False) as f:
            return int(f.attrs["n_done"])
    except (OSError, KeyError):
        return None


def wait_for_progress(proc: subprocess.Popen, path: Path, timeout: float = 120) -> int:
    """Wait until the running extraction has at least one window on disk, then SIGSTOP it."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if (done := n_done(path)) and done < N // 3:
            os.kill(proc.pid, signal.SIGSTOP)
            return n_done(path)
        time.sleep(0.02)
    raise AssertionError(f"no progress to catch (rc={proc.poll()}): {finish(proc).stderr[-2000:]}")


def assert_equal_stores(path: Path, reference: Path, rows: int | None = None) -> None:
    """Every layer equal bit for bit (only the first `rows` token rows when given), tokens and table too."""
    with ActivationStore(path, allow_incomplete=rows is not None) as a, ActivationStore(reference) as b:
        assert a.layers == b.layers and a.n_statements == b.n_statements
        np.testing.assert_array_equal(a.token_ids, b.token_ids)
        assert a.table.equals(b.table)
        for k in a.layers:
            np.testing.assert_array_equal(a.layer(k)[:rows], b.layer(k)[:rows])
        if rows is None:
            assert a.n_done == a.n_statements


def assert_only_store(folder: Path) -> None:
    """No temporary file, lock file or anything else beside the store."""
    assert sorted(p.name for p in folder.iterdir()) == ["city_locations.h5"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted run every faulty run is compared with (a subprocess like them: same threads)."""
    store_dir = tmp_path_factory.mktemp("reference")
    done = run(store_dir)
    assert done.returncode == 0, done.stderr[-2000:]
    return store_dir / STORE


@pytest.fixture(scope="module")
def reference_whole(tmp_path_factory) -> Path:
    """The uninterrupted run without the shared prefix (prefix_cache=false, schema 1: larger)."""
    store_dir = tmp_path_factory.mktemp("reference_whole")
    done = run(store_dir, "prefix_cache=false")
    assert done.returncode == 0, done.stderr[-2000:]
    return store_dir / STORE


# ------------------------------------------------------------------------- 1: full disk
def test_concurrent_runs_on_a_small_disk_refuse_before_work(tmp_path, reference):
    """Three extractions share a disk that holds two stores: the third is refused with one line
    before any forward pass (its space is reserved up front, not found missing later); the two
    others are complete and right; after space is freed, its rerun completes to the same values."""
    size = reference.stat().st_size  # the disk: room for the check and reservation of one store
    disk_size = int((size + 1.02 * size + (4 << 20)) + 3 * size) // 2  # after another, not after two
    with tmpfs(tmp_path / "disk", f"{disk_size // 1024}k") as disk:
        procs = {name: start(disk / name) for name in "abc"}
        results = {name: finish(proc) for name, proc in procs.items()}
        refused = [name for name, done in results.items() if done.returncode != 0]
        assert len(refused) == 1, {name: done.stderr[-1500:] for name, done in results.items()}
        bad = refused[0]
        message = assert_one_error_line(results[bad], "free but the store needs")
        assert " MB" in message and "0.0 GB" not in message
        assert "extract city_locations.h5" not in results[bad].stderr  # no forward pass ran
        assert not (disk / bad).exists()                          # nothing left behind
        for name in set("abc") - {bad}:
            assert_equal_stores(disk / name / STORE, reference)
            assert_only_store(disk / name / "tiny")
        (disk / min(set("abc") - {bad}) / STORE).unlink()
        assert run(disk / bad).returncode == 0
        assert_equal_stores(disk / bad / STORE, reference)


FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 0x01, 0x02


def punch_unwritten_chunks(path: Path, first_row: int) -> int:
    """Give back to the disk the bytes of every layer chunk that starts at or after `first_row`
    (rows not written yet): a later write there needs new space. Returns the number of chunks."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    with h5py.File(path, "r", locking=False) as f:
        spans = [(info.byte_offset, info.size) for ds in f["layers"].values()
                 for info in map(ds.id.get_chunk_info, range(ds.id.get_num_chunks()))
                 if info.chunk_offset[0] >= first_row]
    fd = os.open(path, os.O_RDWR)
    try:
        for offset, size in spans:
            assert libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, size) == 0
    finally:
        os.close(fd)
    return len(spans)


def test_write_failure_mid_run_stops_with_one_line_and_rerun_completes(tmp_path, reference):
    """The disk fills up while a window is written (the space of rows not yet written is taken away
    from the running extraction and the disk filled): one line, exit 1, n_done covers only rows that
    are on disk and right; once space is freed the rerun ends identical to an uninterrupted run."""
    with tmpfs(tmp_path / "disk", "40m") as disk:
        path = disk / "s" / STORE
        proc = start(disk / "s")
        try:
            before = wait_for_progress(proc, path)
            with h5py.File(path, "r", locking=False) as f:
                offsets = f["tokens/offsets"][:]
            assert punch_unwritten_chunks(path, offsets[before] + 3 * WINDOW) > 0  # past the windows in flight
            filler = fill_disk(disk)
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        failed = finish(proc)
        assert_one_error_line(failed, "No space left on device", before_work=False)
        after = n_done(path)
        assert before <= after < N
        assert_equal_stores(path, reference, rows=offsets[after])
        filler.unlink()
        done = run(disk / "s")
        assert done.returncode == 0, done.stderr[-2000:]
        assert_equal_stores(path, reference)
        assert_only_store(path.parent)


# ------------------------------------------------------------------ 3: kill during creation


def test_kill_during_store_creation_then_rerun_completes(tmp_path, reference):
    """SIGKILL while the store's layout is written (after its first layer), then again in the
    rerun right after its space is reserved: no store a rerun cannot open is left behind (the
    killed runs' temporary files are cleaned up); the next rerun completes it, identical."""
    for moment in ("_allocate_layer", "reserve"):
        killed = run(tmp_path, kill_after=moment)
        assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
        assert not (tmp_path / STORE).exists()
        with pytest.raises(StoreError, match="no activation store"):
            ActivationStore(tmp_path / STORE)
    done = run(tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert_equal_stores(tmp_path / STORE, reference)
    assert_only_store(tmp_path / "tiny")


# ------------------------------------------------------------------------- 4: two writers
def test_store_being_written_is_in_use_not_damaged(tmp_path, reference):
    """While one extraction writes the store, a second one (with or without overwrite=true) and a
    reader are told it is in use by another process; the first then completes, identical."""
    path = tmp_path / STORE
    first = start(tmp_path)
    try:
        wait_for_progress(first, path)  # stopped mid-run, holding the store
        for extra in ([], ["overwrite=true"]):
            assert_one_error_line(run(tmp_path, *extra), "is in use by another process")
        with pytest.raises(StoreError, match="in use by another process") as err:
            ActivationStore(path)
        assert "damaged" not in str(err.value) and "overwrite" not in str(err.value)
    finally:
        os.kill(first.pid, signal.SIGCONT)
    assert finish(first).returncode == 0
    assert_equal_stores(path, reference)
    assert_only_store(path.parent)
    holder = subprocess.Popen([sys.executable, "-c", "import h5py, sys, time; f = h5py.File(sys.argv[1], 'r+'); "
                               "print('open', flush=True); time.sleep(60)", str(path)], stdout=subprocess.PIPE, text=True)
    try:  # another program holding the file for writing (HDF5's own lock)
        assert holder.stdout.readline().strip() == "open"
        with pytest.raises(StoreError, match="in use by another process .its HDF5 file lock"):
            ActivationStore(path)
    finally:
        holder.kill()
        holder.wait()


# --------------------------------------------------------------------------- 5: overwrite
def test_refused_overwrite_keeps_the_old_store(tmp_path, reference_whole):
    """overwrite=true refused by a bad option, by a disk too small for the new store, or killed
    while the new store is created: the old store is intact. Accepted on a disk that cannot hold
    both: it replaces the old one and is right. (Schema-1 stores: those of the shared prefix are
    too small beside the space check's 4 MB margin.)"""
    reference = reference_whole
    old_size = reference.stat().st_size
    with ActivationStore(reference) as ref:
        layer_bytes = len(ref.token_ids) * ref.hidden_size * 2
    new_size = old_size + layer_bytes  # four layers instead of three
    disk_size = max(old_size + new_size - (1 << 20), int(1.02 * new_size) + (9 << 19))
    assert disk_size < old_size + new_size  # the new store passes the space check, but not beside the old
    with tmpfs(tmp_path / "disk", f"{disk_size // 1024}k") as disk:
        path = disk / "s" / STORE
        path.parent.mkdir(parents=True)
        path.write_bytes(reference.read_bytes())
        old = path.read_bytes()
        whole = ["prefix_cache=false", "overwrite=true"]
        assert_one_error_line(run(disk / "s", *whole, "layers=[0,99]"), "layers=99")
        assert_one_error_line(run(disk / "s", *whole, "limit=2000"), "but the store needs")
        assert path.read_bytes() == old
        killed = run(disk / "s", *whole, kill_after="_allocate_layer")
        assert killed.returncode == -signal.SIGKILL
        assert path.read_bytes() == old
        done = run(disk / "s", *whole, "layers=[0,1,2,4]")  # 4 layers: both stores do not fit
        assert done.returncode == 0, done.stderr[-2000:]
        assert_only_store(path.parent)
        with ActivationStore(path) as new, ActivationStore(reference) as ref:
            assert new.layers == [0, 1, 2, 4] and new.n_done == N
            for k in ref.layers:
                np.testing.assert_array_equal(new.layer(k), ref.layer(k))


# --------------------------------------------------------------------- 11: bad options
BAD_OPTIONS = {  # case -> (overrides, text the one line must contain)
    "layers=1.5": (["layers=1.5"], "layers=1.5"),
    "layers=true": (["layers=true"], "layers=True"),
    "limit=abc": (["limit=abc"], "limit: Value 'abc'"),
    "model.device=tpu": (["model.device=tpu"], "model.device='tpu'"),
    "batch_tokens=0": (["batch_tokens=0"], "batch_tokens=0"),
    "window_tokens=-5": (["window_tokens=-5"], "window_tokens=-5"),
    "dtype=bogus": (["dtype=bogus"], "dtype: Invalid value 'bogus'"),
    "data=csv without data.name": (["data=csv", "data.path=x.csv"], "data.name is not set"),
    "unwritable store_dir": ([], "Read-only file system"),
    "full store_dir": ([], "free but the store needs"),
}
DISKS = {"unwritable store_dir": ("100m", "ro"), "full store_dir": ("2m",)}  # tmpfs size, options


@pytest.fixture(scope="module")
def bad_option_runs(tmp_path_factory):
    """Every case of BAD_OPTIONS run as `python -m extract ...`, four at a time -> (result, store_dir)."""
    base = tmp_path_factory.mktemp("bad")
    with ExitStack() as mounts:
        folders = {case: base / f"case{i}" for i, case in enumerate(BAD_OPTIONS) if case not in DISKS}
        if os.geteuid() == 0:  # else those cases are skipped
            folders.update({case: mounts.enter_context(tmpfs(base / f"disk{i}", *disk)) / "s"
                            for i, (case, disk) in enumerate(DISKS.items())})
        with ThreadPoolExecutor(4) as pool:
            runs = {case: pool.submit(run, folder, *BAD_OPTIONS[case][0]) for case, folder in folders.items()}
            yield {case: (future.result(), folders[case]) for case, future in runs.items()}


@pytest.mark.parametrize("case", list(BAD_OPTIONS))
def test_bad_option_is_one_line_and_writes_nothing(bad_option_runs, case):
    if case not in bad_option_runs:
        pytest.skip("needs root to mount a tmpfs")
    done, store_dir = bad_option_runs[case]
    message = assert_one_error_line(done, BAD_OPTIONS[case][1])
    assert "np." not in message and "0.0 GB" not in message
    assert not store_dir.exists()


# ------------------------------------------------------------- 8: first GGUF conversion
@pytest.mark.slow
def test_first_gguf_conversion_by_two_jobs_at_once(tmp_path):
    """Two SmolLM2 extractions start together on a fresh model cache (a SLURM multirun on a new
    machine): one converts the GGUF file, the other waits for its lock and reuses the result; both
    succeed with equal stores and no temporary folder is left in the cache."""
    env = {**ENV, "TRUTHPROBE_CACHE": str(tmp_path / "cache")}
    procs = {name: subprocess.Popen(
        [sys.executable, "-m", "extract", "model=smollm2", "data=city_locations", "limit=4", "layers=[0,30]",
         f"store_dir={tmp_path / name}", f"hydra.run.dir={LOGS[-1]}/{next(_RUN_NUMBER)}"],
        cwd=ROOT, env=env, stderr=subprocess.PIPE) for name in "ab"}
    results = {name: finish(proc) for name, proc in procs.items()}
    assert all(done.returncode == 0 for done in results.values()), {n: d.stderr[-2000:] for n, d in results.items()}
    assert sum(done.stderr.count("converting ") for done in results.values()) == 1
    converted = [p for p in (tmp_path / "cache" / "hf").iterdir() if not p.name.endswith(".lock")]
    assert len(converted) == 1 and (converted[0] / "config.json").is_file(), converted
    with ActivationStore(tmp_path / "a" / "smollm2" / "city_locations.h5") as a, \
            ActivationStore(tmp_path / "b" / "smollm2" / "city_locations.h5") as b:
        assert a.attrs["model_fingerprint"] == b.attrs["model_fingerprint"]
        for k in (0, 30):
            np.testing.assert_array_equal(a.layer(k), b.layer(k))
