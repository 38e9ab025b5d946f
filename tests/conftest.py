"""Shared fixtures: config composition and small stores built once per session."""
from __future__ import annotations

import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest

from extract.config import compose_config

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
extract_config = partial(compose_config, "extract")


@pytest.fixture(scope="session")
def tiny_store(tmp_path_factory) -> Path:
    """Tiny-model store of 40 city statements (several windows and batches of mixed lengths)."""
    from extract.run import extract

    store_dir = tmp_path_factory.mktemp("stores")
    return extract(extract_config("model=tiny", "data=city_locations", "limit=40",
                                  f"store_dir={store_dir}", "batch_tokens=300", "window_tokens=700"))


def run_module(module: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`python -m <module> args` from the repository root, its Hydra run folder under `cwd`."""
    root = Path(__file__).resolve().parent.parent
    return subprocess.run([sys.executable, "-m", module, *args, f"hydra.run.dir={cwd / 'logs'}"], cwd=root,
                          capture_output=True, text=True)


def assert_one_error_line(result: subprocess.CompletedProcess, needle: str) -> None:
    """Exit status 1 with exactly one ERROR line, containing `needle`, and no traceback."""
    errors = [line for line in result.stderr.splitlines() if "ERROR" in line]
    assert result.returncode == 1, result.stderr[-2000:]
    assert len(errors) == 1 and needle in errors[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr
