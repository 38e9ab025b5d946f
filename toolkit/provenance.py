"""Provenance of every output the toolkit writes: which code, which packages, which command and which
resolved config produced it. `evaluation.cells.write_record` attaches it to every result cell, transfer
cell, zero-shot cell, TruthfulQA result, NCB output and apply_probe record.

    {"git_commit": "9510b04...", "git_dirty": false,     # null when the code is not a git checkout
     "toolkit_version": "0.1.0", "python": "3.11.7",
     "packages": {"torch": "2.13.0", "transformers": ..., "scikit-learn": ..., "lightning": ..., "numpy": ...},
     "command": ["python", "-m", "train_probe", "probe=linear", ...],   # argv of the writing process
     "config_sha256": "..."}                               # of the resolved config (canonical JSON), or null

`git_dirty` is true when tracked files differ from the commit (untracked files are not counted). The
git state and versions are read once per process.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import subprocess
import sys
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

PACKAGES = ("torch", "transformers", "scikit-learn", "lightning", "numpy")
_ROOT = Path(__file__).resolve().parents[1]


def provenance(config: dict | None = None) -> dict:
    """The provenance block of an output produced from the resolved `config` (a plain dict or None)."""
    commit, dirty = _git_state()
    return {"git_commit": commit, "git_dirty": dirty, "toolkit_version": toolkit_version(),
            "python": platform.python_version(), "packages": {p: _version(p) for p in PACKAGES},
            "command": _command(), "config_sha256": config_hash(config)}


def config_hash(config: dict | None) -> str | None:
    """sha256 of the config as canonical JSON (sorted keys), None without a config."""
    if config is None:
        return None
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()


def _command() -> list[str]:
    """argv as typed: `python -m <module> ...` for a module run (argv[0] is then the module's file)."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    head = ["python", "-m", spec.name.removesuffix(".__main__")] if spec is not None and spec.name else sys.argv[:1]
    return [*head, *sys.argv[1:]]


@functools.cache
def _git_state() -> tuple[str | None, bool | None]:
    """(HEAD commit, tracked files modified) of the checkout holding this package, (None, None) if none."""
    def git(*args) -> str:
        return subprocess.run(["git", "-C", str(_ROOT), *args], capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()
    try:
        if Path(git("rev-parse", "--show-toplevel")).resolve() != _ROOT:   # installed inside another repo
            return None, None
        return git("rev-parse", "HEAD"), bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return None, None


def page_command() -> str:
    """The running command as a results page prints it (`shown_command`), so the page names no folder of the
    machine that wrote it."""
    return shown_command(provenance()["command"])


def shown_command(command: list[str]) -> str:
    """A recorded command (argv words) with every absolute path argument (`key=/abs/path`, `--key /abs/path` or a
    bare `/abs/path`) replaced by a placeholder (`key=<key>`, `--key <key>`, `<path>`)."""
    words: list[str] = []
    for word in command:
        key, sep, value = word.partition("=")
        if sep and value.startswith("/"):
            word = f"{key}=<{key.split('.')[-1]}>"
        elif word.startswith("/") and words:
            word = f"<{words[-1][2:]}>" if words[-1].startswith("--") else "<path>"
        words.append(word)
    return " ".join(words)


def page_stamp() -> str:
    """The provenance phrase of a generated page: `commit <short hash>[ (modified)], <UTC date and time> UTC`."""
    commit, dirty = _git_state()
    return (f"commit {(commit or 'outside a git checkout')[:7]}{' (modified)' if dirty else ''}, "
            f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC")


@functools.cache
def host() -> str:
    """This machine in words: operating system, architecture, CPU model and core count."""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{platform.system()} {platform.machine()}, {cpu or 'CPU'}, {os.cpu_count()} cores"


def toolkit_version() -> str | None:
    """This toolkit's version, from its installed package metadata (pyproject.toml's `version`)."""
    return _version("truthprobe")


@functools.cache
def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None
