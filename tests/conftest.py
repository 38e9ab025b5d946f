"""Shared fixtures: small stores built once per session (the shared helpers are in tests/helpers.py)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")   # set before any module imports transformers
if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs one pytest worker per core: each worker, and every process its tests start, on one
    # thread (several OpenMP teams per core spin-wait on each other: a 46 s test took 213 s)
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["MKL_NUM_THREADS"] = "1"

from tests.helpers import extract_config  # noqa: E402


@pytest.fixture(scope="session")
def tiny_store(tmp_path_factory) -> Path:
    """Tiny-model store of 40 city statements (several windows and batches of mixed lengths)."""
    from extract.run import extract

    store_dir = tmp_path_factory.mktemp("stores")
    return extract(extract_config("model=tiny", "data=city_locations", "limit=40",
                                  f"store_dir={store_dir}", "batch_tokens=300", "window_tokens=700"))
