"""The steps of a study (experiments.ncb_study, experiments.claims_study): each runs one of the toolkit's
entry points in a child process, so a study is the commands a user would type, and resumes as they do.
`run_step` runs one and waits; `run_steps` runs independent ones on several processes at once."""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from toolkit.errors import ToolkitError
from extract.store import ActivationStore

log = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parents[1]
PR_SET_PDEATHSIG = 1   # prctl(2): the signal a child gets when the process that started it dies


def _end_with_parent():
    """On Linux, a function for the child to run between fork and exec that asks the kernel to send it SIGTERM
    when its parent dies (a killed study leaves no step writing cells that a rerun would race); else None.
    prctl is looked up here, in the parent: the child only calls it (no library loading after the fork)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _start(module: str, args: tuple[str, ...], env: dict | None = None) -> subprocess.Popen:
    log.info("python -m %s %s", module, " ".join(args))
    return subprocess.Popen([sys.executable, "-m", module, *args], cwd=ROOT, env=env, preexec_fn=_end_with_parent())


def run_step(module: str, *args: str) -> None:
    """`python -m <module> <args>` from the repository root; a one-line ToolkitError when it fails."""
    run_steps([(module, *args)], workers=1)


def run_steps(commands: list[tuple[str, ...]], workers: int) -> None:
    """Each `(module, *args)` of `commands` as `python -m <module> <args>`, at most `workers` at once, in the
    order given (put the longest first); with several workers each child runs on one torch thread
    (OMP_NUM_THREADS=1). The commands must not depend on each other (each writes its own cells). A failure
    starts nothing new; when the running ones have ended, one ToolkitError names every command that failed."""
    env = None if workers == 1 else {**os.environ, "OMP_NUM_THREADS": "1"}
    waiting, running, failed = list(commands), [], []
    while waiting or running:
        while waiting and not failed and len(running) < workers:
            command = waiting.pop(0)
            running.append((command, _start(command[0], command[1:], env)))
        time.sleep(0.2)
        for command, child in [r for r in running if r[1].poll() is not None]:
            running.remove((command, child))
            if child.returncode:
                failed.append(command)
        if failed and not running:
            break
    if failed:
        shown = "; ".join(f"`python -m {' '.join(c)}`" for c in failed)
        raise ToolkitError(f"{shown} failed (the error is above); fix it and rerun the study: finished steps are kept")


def store_complete(path: Path) -> bool:
    """Whether the store at `path` exists and holds every statement (a stopped extraction does not)."""
    if not path.exists():
        return False
    store = ActivationStore(path, allow_incomplete=True)
    return store.n_done == store.n_statements
