"""Shared fixtures: config composition and small stores built once per session."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def extract_config(*overrides: str):
    """The resolved `python -m extract` config for the given command-line overrides."""
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(config_name="extract", overrides=list(overrides))


@pytest.fixture(scope="session")
def tiny_store(tmp_path_factory) -> Path:
    """Tiny-model store of 40 city statements (several windows and batches of mixed lengths)."""
    from extract.run import extract

    store_dir = tmp_path_factory.mktemp("stores")
    return extract(extract_config("model=tiny", "data=city_locations", "limit=40",
                                  f"store_dir={store_dir}", "batch_tokens=300", "window_tokens=700"))
