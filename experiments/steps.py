"""The steps of a study (experiments.ncb_study, experiments.claims_study): each runs one of the toolkit's
entry points in a child process, so a study is the commands a user would type, and resumes as they do."""
from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

from toolkit.errors import ToolkitError
from extract.store import ActivationStore

log = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parents[1]


def run_step(module: str, *args: str) -> None:
    """`python -m <module> <args>` from the repository root; a one-line ToolkitError when it fails."""
    log.info("python -m %s %s", module, " ".join(args))
    if subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT).returncode:
        raise ToolkitError(f"`python -m {module} {' '.join(args)}` failed (its error is above); fix it and rerun "
                           "the study: finished steps are kept")


def store_complete(path: Path) -> bool:
    """Whether the store at `path` exists and holds every statement (a stopped extraction does not)."""
    if not path.exists():
        return False
    store = ActivationStore(path, allow_incomplete=True)
    return store.n_done == store.n_statements
