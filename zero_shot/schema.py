"""Typed schema of `python -m zero_shot`'s options, checked before any work (see toolkit/schema.py).

Types (booleans included: `overwrite=maybe` is refused, never read as true) by the one typed parser,
toolkit.schema.typed_options; then the ranges it cannot express, the enumeration, `rows` and a
writable results_dir, so that a bad option is one line before the model is loaded.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import DictConfig

from evaluation.metrics import resampling_groups
from toolkit.errors import ToolkitError, check_count, check_name, check_writable
from toolkit.schema import literal_config, ModelSchema, option, threads_option, typed_options
from zero_shot.prompts import get_enumeration

_HINTS = {"batch_size": "a whole number >= 1", "save_every": "a whole number >= 1", "limit": "a whole number >= 1, "
          "or null for every statement", "evaluate": "true or false", "prefix_cache": "true or false",
          "overwrite": "true or false", "mondrian": "true or false", "seed": "a whole number",
          "split_seed": "a whole number", "n_boot": "a whole number >= 1", "alpha": "a number in (0, 1), e.g. 0.1",
          "model.instruct": "true or false"}


@dataclass
class ZeroShotSchema:
    model: ModelSchema = field(default_factory=ModelSchema)
    enumeration: str = option("default", "default (1..6) | shuffled (2,6,1,5,3,4) | tf (true/false wording) | "
                              "abc (A..F)")
    modes: Any = option(["argmax", "conformal"], "argmax over false/true/neither/abstain groups; split-conformal sets")
    tasks: Any = option(["multiclass", "true_vs_all", "false_vs_all", "neither_vs_all", "true_vs_false"],
                        "the tasks whose cells are written")
    scores: Any = option(None, "evaluate saved N x 7 scores instead of running the model: a .npy, a list of .npy, "
                         "or a folder")
    evaluate: bool = option(True, "false: only compute the score file")
    batch_size: int = option(16, "statements per forward pass (right padding)")
    save_every: int = option(8, "batches between progress checkpoints (the unit of resumption)")
    limit: Optional[int] = option(None, "first N statements only (score file scores-<enumeration>-limit<N>.npy)")
    rows: str = option("all", "all | heldout: score only the calibration + test rows of split= (the others stay NaN)")
    prefix_cache: bool = option(True, "run the prompt's shared prefix once and reuse its key/value cache")
    overwrite: bool = option(False, "recompute a score file made with other settings")
    seed: int = option(0, "bootstrap seed")
    split_seed: int = option(0, "entity_disjoint split seed (apart from seed: a multi-seed sweep varies only the "
                             "probe)")
    bootstrap: str = option("cluster", "intervals resample subject entities (object_1) with all their statements | "
                            "iid: statements")
    alpha: float = option(0.1, "conformal miscoverage level")
    mondrian: bool = option(False, "class-conditional conformal thresholds")
    n_boot: int = option(1000, "bootstrap resamples for the 95 % intervals")
    results_dir: str = option("results", "scores and cells under <results_dir>/<model.name>/<data.name>/")
    threads: Any = threads_option()


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
    return literal_config(checked)
