"""Typed schema of `python -m truthfulqa`'s options, checked before any work (see extract/schema.py).

Types (booleans included) by the one typed parser, extract.schema.typed_options; then the ranges it
cannot express, the format and a writable results_dir, so that a bad option is one line before the
model is loaded, never a traceback after the scoring.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from omegaconf import DictConfig, OmegaConf

from extract.errors import check_count, check_name
from extract.schema import ModelSchema, check_writable, typed_options
from truthfulqa.likelihood import check_format

_HINTS = {"limit": "a whole number >= 1, or null for every question", "batch_size": "a whole number >= 1",
          "save_every": "a whole number >= 1", "prefix_cache": "true or false", "n_boot": "a whole number >= 1",
          "seed": "a whole number", "model.instruct": "true or false"}


@dataclass
class TruthfulQASchema:
    model: ModelSchema = field(default_factory=ModelSchema)
    format: str = "lm_eval"
    limit: Optional[int] = None
    data_path: Optional[str] = None
    batch_size: int = 16
    save_every: int = 8
    prefix_cache: bool = True
    n_boot: int = 1000
    seed: int = 0
    results_dir: str = "results"


def validate(cfg: DictConfig) -> DictConfig:
    """The config with every option's type and range checked (a plain DictConfig)."""
    checked = typed_options(cfg, TruthfulQASchema, _HINTS)
    check_format(checked["format"])
    check_count(checked["limit"], "limit", none_ok=True)
    for key in ("batch_size", "save_every", "n_boot"):
        check_count(checked[key], key)
    check_name(checked["model"]["name"], "model.name")
    check_writable(checked["results_dir"])
    return OmegaConf.create(checked)
