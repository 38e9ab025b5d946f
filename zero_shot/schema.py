"""Typed schema of `python -m zero_shot`'s options, checked before any work (see extract/schema.py).

Types (booleans included: `overwrite=maybe` is refused, never read as true) by the one typed parser,
extract.schema.typed_options; then the ranges it cannot express, the enumeration, `rows` and a
writable results_dir, so that a bad option is one line before the model is loaded.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from evaluation.metrics import resampling_groups
from extract.errors import ToolkitError, check_count, check_name
from extract.schema import ModelSchema, check_writable, typed_options
from zero_shot.prompts import get_enumeration

_HINTS = {"batch_size": "a whole number >= 1", "save_every": "a whole number >= 1", "limit": "a whole number >= 1, "
          "or null for every statement", "evaluate": "true or false", "prefix_cache": "true or false",
          "overwrite": "true or false", "mondrian": "true or false", "seed": "a whole number",
          "split_seed": "a whole number", "n_boot": "a whole number >= 1", "alpha": "a number in (0, 1), e.g. 0.1",
          "model.instruct": "true or false"}


@dataclass
class ZeroShotSchema:
    model: ModelSchema = field(default_factory=ModelSchema)
    enumeration: str = "default"
    modes: Any = field(default_factory=lambda: ["argmax", "conformal"])
    tasks: Any = field(default_factory=list)
    scores: Any = None
    evaluate: bool = True
    batch_size: int = 16
    save_every: int = 8
    limit: Optional[int] = None
    rows: str = "all"
    prefix_cache: bool = True
    overwrite: bool = False
    seed: int = 0
    split_seed: int = 0
    bootstrap: str = "cluster"
    alpha: float = 0.1
    mondrian: bool = False
    n_boot: int = 1000
    results_dir: str = "results"


def validate(cfg: DictConfig) -> DictConfig:
    """The config with every option's type and range checked (a plain DictConfig)."""
    checked = typed_options(cfg, ZeroShotSchema, _HINTS)
    for key in ("batch_size", "save_every", "n_boot"):
        check_count(checked[key], key)
    check_count(checked["limit"], "limit", none_ok=True)
    if not 0 < checked["alpha"] < 1:
        raise ToolkitError(f"alpha={checked['alpha']:g}: give {_HINTS['alpha']}")
    if checked["rows"] not in ("all", "heldout"):
        raise ToolkitError(f"rows={checked['rows']!r}: use all (every statement) or heldout (calibration + test)")
    resampling_groups(checked["bootstrap"], [])   # the one check of bootstrap=
    get_enumeration(checked["enumeration"])
    check_name(checked["model"]["name"], "model.name")
    check_writable(checked["results_dir"])
    return OmegaConf.create(checked)
