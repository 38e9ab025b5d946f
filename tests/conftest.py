"""Shared fixtures: config composition and small stores built once per session."""
from __future__ import annotations

import os
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
