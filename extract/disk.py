"""The file-system side of writing a store: one writer per store (a lock file), free-space checks,
space reserved up front, folders made and removed again by a refused run. Every failure is a
one-line `DiskError` naming the path and the fix."""
from __future__ import annotations

import errno
import fcntl
import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

from typing import Callable

from extract.errors import ToolkitError

LOCK_WAIT_S = 2.0  # a reader's short shared lock must not make a starting writer fail


class DiskError(ToolkitError):
    """A folder that cannot be written, a full disk, or a store held by another process."""


class NoSpace(DiskError):
    """The disk cannot hold what is asked for."""


def format_bytes(n: float) -> str:
    """1.23 GB, 45.6 MB or 789 kB: never "0.0 GB"."""
    for unit, size in (("GB", 1e9), ("MB", 1e6)):
        if n >= size:
            return f"{n / size:.{2 if unit == 'GB' else 1}f} {unit}"
    return f"{n / 1e3:.0f} kB"


def os_reason(err: OSError) -> str:
    """The short reason of an OSError (h5py's are long): 'No space left on device'."""
    return os.strerror(err.errno) if err.errno else str(err).splitlines()[0][:200]


def _existing_ancestor(folder: Path) -> Path:
    folder = folder.absolute()
    while not folder.exists():
        folder = folder.parent
    return folder


def check_space(folder: Path, need: int, reclaimable: int = 0) -> None:
    """Refuse when the disk of `folder` (created or not) lacks `need` bytes (plus a small margin);
    `reclaimable` bytes (an old store that will be replaced) count as free."""
    free = shutil.disk_usage(_existing_ancestor(folder)).free + reclaimable
    wanted = int(need * 1.02) + (4 << 20)
    if free < wanted:
        old = f" (with the {format_bytes(reclaimable)} of the store it replaces)" if reclaimable else ""
        raise NoSpace(f"{folder} has {format_bytes(free)} free{old} but the store needs {format_bytes(wanted)} "
                      f"({format_bytes(need)} and a margin of 2 % + 4 MB): free space, choose store_dir=..., fewer "
                      "layers=..., or limit=...")


def make_folders(folder: Path) -> list[Path]:
    """mkdir -p `folder`; returns the folders it created (deepest first), for `remove_empty`."""
    created, f = [], folder.absolute()
    while not f.exists():
        created.append(f)
        f = f.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise DiskError(f"cannot create {folder} ({os_reason(err)}): choose a writable store_dir=...") from None
    return created


def remove_empty(folders: list[Path]) -> None:
    """Remove the folders a refused run created, if they are still empty (deepest first)."""
    for f in folders:
        try:
            f.rmdir()
        except OSError:
            return


def lock_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.lock")


@contextmanager
def writer_lock(path: Path):
    """Hold the one-writer lock of the store at `path` (a lock file beside it, removed on exit);
    another holder means another extraction is writing it: refused."""
    lock = lock_path(path)
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise DiskError(f"cannot write in {path.parent} ({os_reason(err)}): choose a writable store_dir=...") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            if time.monotonic() < deadline:
                time.sleep(0.1)
                continue
            raise DiskError(f"{path} is in use by another process (extraction pid {holder} holds {lock.name}): "
                            "wait for it to finish, or stop it, then rerun") from None
        try:  # the file we locked is still the lock file (a finishing holder may have removed it)
            if os.path.samestat(os.fstat(fd), os.stat(lock)):
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)
        os.close(fd)


def writer_pid(path: Path) -> str | None:
    """The pid of the extraction writing the store at `path`, None when none is."""
    try:
        fd = os.open(lock_path(path), os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None
    except BlockingIOError:
        return os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
    finally:
        os.close(fd)


def reserve(path: Path) -> None:
    """Allocate every byte of the (sparse) file at `path` now, so later writes cannot meet a full disk."""
    size = path.stat().st_size
    fd = os.open(path, os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as err:
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            free = shutil.disk_usage(path.parent).free
            raise NoSpace(f"{path.parent} has {format_bytes(free)} free but the store needs {format_bytes(size)}: "
                          "free space, choose store_dir=..., fewer layers=..., or limit=...") from None
        raise DiskError(f"cannot reserve space for {path} ({os_reason(err)}): choose another store_dir=...") from None
    finally:
        os.close(fd)


def is_sparse(path: Path) -> bool:
    """Some of the file's bytes are not allocated on disk (a hole a later write could fail to fill)."""
    st = path.stat()
    return st.st_blocks * 512 < st.st_size


def fsync_path(path: Path) -> None:
    """Make a file's data, or a rename inside a folder, durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def waiting_lock(lock: Path, cannot: Callable[[OSError], Exception]):
    """Hold an exclusive flock on the file `lock` (created if missing, kept afterwards: removing it
    would race with the next locker), waiting for its holder; a lock file that cannot be opened raises
    `cannot(err)`. The kernel releases it when the holder dies, SIGKILL included."""
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise cannot(err) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
