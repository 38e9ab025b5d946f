"""Typed schema of `python -m truthfulqa`'s options, checked before any work (see extract/schema.py).

Types (booleans included) by the one typed parser, extract.schema.typed_options; then the ranges it
cannot express, the format and a writable results_dir, so that a bad option is one line before the
model is loaded, never a traceback after the scoring.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from extract.errors import check_count, check_name
from extract.schema import ModelSchema, check_writable, option, threads_option, typed_options

_HINTS = {"limit": "a whole number >= 1, or null for every question", "batch_size": "a whole number >= 1",
          "save_every": "a whole number >= 1", "prefix_cache": "true or false", "n_boot": "a whole number >= 1",
          "seed": "a whole number", "model.instruct": "true or false"}


@dataclass
class TruthfulQASchema:
    model: ModelSchema = field(default_factory=ModelSchema)
    format: str = option("lm_eval", "lm_eval (the harness's 6-shot primer) | chat (the model's chat template) | "
                         "plain (no primer)")
    limit: Optional[int] = option(None, "first N questions only")
    data_path: Optional[str] = option(None, "the TruthfulQA CSV; null = data/truthfulqa/TruthfulQA.csv")
    batch_size: int = option(16, "requests (question + choice) per forward pass, longest first")
    save_every: int = option(8, "batches between progress checkpoints (the unit of resumption)")
    prefix_cache: bool = option(True, "run the tokens shared by every request (the primer) once, reuse their cache")
    n_boot: int = option(1000, "bootstrap resamples (over questions) for the 95 % intervals")
    seed: int = option(0, "bootstrap seed")
    results_dir: str = option("results", "<results_dir>/<model.name>/truthfulqa/likelihood-<format>[-limit<N>].json")
    threads: Any = threads_option()


def validate(cfg: DictConfig) -> DictConfig:
    """The config with every option's type and range checked (a plain DictConfig)."""
    from truthfulqa.likelihood import check_format   # here, not at the top: --help imports this module (no torch)

    checked = typed_options(cfg, TruthfulQASchema, _HINTS)
    check_format(checked["format"])
    check_count(checked["limit"], "limit", none_ok=True)
    for key in ("batch_size", "save_every", "n_boot"):
        check_count(checked[key], key)
    check_name(checked["model"]["name"], "model.name")
    check_writable(checked["results_dir"])
    return OmegaConf.create(checked)
