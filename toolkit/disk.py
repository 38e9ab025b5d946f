"""The file-system side of writing a store: one writer per store (a lock file), free-space checks,
space reserved up front, folders made and removed again by a refused run. Every failure is a
one-line `DiskError` naming the path and the fix."""
from __future__ import annotations

import errno
import fcntl
import os
import shutil
import socket
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from typing import IO, Callable

from toolkit.errors import ToolkitError

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


class WrittenMeanwhile(DiskError):
    """A file written with ``replace=False`` that another process created first (nothing was replaced)."""


def atomic_write(path: Path, write: Callable[[IO[bytes]], None], replace: bool = True) -> None:
    """write(binary file) into a temporary file of path's folder, fsync, then rename it over path:
    a reader sees the old file or the new one, never a part. Permissions follow the umask. With
    ``replace=False`` the file is created only if absent, atomically (a hard link of the temporary file:
    of two writers started together one wins, the other gets WrittenMeanwhile)."""
    path = Path(path)
    try:
        _write_replace(path, write, replace)
    except FileExistsError:
        raise WrittenMeanwhile(f"{path} was written by another run meanwhile: nothing was replaced (give another "
                               "name, or overwrite=true to replace it)") from None
    except OSError as err:   # no space, no permission, a file where a folder should be
        fix = ("free space or choose another output folder" if err.errno in (errno.ENOSPC, errno.EDQUOT) else
               "choose a writable output folder")
        raise DiskError(f"cannot write {path} ({err.strerror or err}): {fix}") from None


def remove_stale_temps(folder: Path, prefix: str) -> None:
    """Delete `<prefix><pid>-*` temporary files or folders of folder whose writer (a process of this
    host: the prefix names the host) is gone, e.g. SIGKILLed mid-write; other hosts' temporaries (a
    shared file system) are left alone."""
    for tmp in folder.glob(f"{prefix}*"):
        pid = tmp.name[len(prefix):].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            if tmp.is_dir():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                tmp.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # someone else's process
        return True
    return True


def _write_replace(path: Path, write, replace: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".tmp-{socket.gethostname()}-"
    remove_stale_temps(path.parent, prefix)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f"{prefix}{os.getpid()}-", suffix=path.suffix)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        if replace:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)     # FileExistsError when another writer was first
    finally:
        Path(tmp).unlink(missing_ok=True)
