"""Typed schema of `python -m intervene`'s options, checked before any work (toolkit.schema.typed_options, then
the ranges it cannot express), so that a bad option is one line before a model is loaded."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING, DictConfig

from toolkit.errors import ToolkitError, check_count, check_name, check_writable
from toolkit.schema import literal_config, ModelSchema, option, threads_option, typed_options
from zero_shot.prompts import get_enumeration

READOUTS = ("zero_shot", "likelihood")
_HINTS = {"alphas": "a list of numbers holding 0, e.g. alphas=[-8,-4,0,4,8]", "n_random": "a whole number >= 1",
          "n_statements": "a whole number >= 1", "batch_size": "a whole number >= 1", "n_boot": "a whole number >= 1",
          "seed": "a whole number", "overwrite": "true or false", "readouts": "a list, e.g. [zero_shot,likelihood]"}
_MISSING_HINTS = {"cell": "a probe's result cell, \"cell='results/.../layer=<k>/seed=<s>.json'\""}


@dataclass
class InterveneSchema:
    model: ModelSchema = field(default_factory=ModelSchema)
    cell: str = option(MISSING, "a binary task's probe cell (results/.../layer=<k>/seed=<s>.json) of this model and "
                       "datapack")
    at: str = option("statement", "steered positions: statement (every token of the statement) | last (its last "
                     "token)")
    alphas: list[float] = option([-8.0, -4.0, -2.0, 0.0, 2.0, 4.0, 8.0], "push sizes in standard deviations of the "
                                 "probe's projection on the training tokens (0 required: the unsteered run)")
    n_random: int = option(10, "random directions of the same push norm (the control)")
    n_statements: int = option(200, "test statements steered (label-stratified, whole subjects)")
    readouts: list[str] = option(list(READOUTS), "zero_shot (the paper's prompt: log-odds of the task's class) | "
                                 "likelihood (log P(true object) - log P(false object))")
    enumeration: str = option("default", "the zero-shot prompt's enumeration (zero_shot.prompts)")
    batch_size: int = option(16, "sequences per forward pass")
    n_boot: int = option(1000, "cluster-bootstrap resamples (subject entities) of the 95 % intervals")
    seed: int = option(0, "random directions and bootstrap seed")
    store_dir: str = option("activations", "the store <store_dir>/<model>/<datapack>.h5 the probe was fitted on")
    results_dir: str = option("results", "<results_dir>/<model>/<datapack>/interventions/<probe>/<task>/<split>/"
                              "layer=<k>/seed=<s>.json")
    overwrite: bool = option(False, "recompute an existing intervention file")
    threads: Any = threads_option()


def validate(cfg: DictConfig) -> DictConfig:
    """The config with every option's type and range checked (a plain DictConfig)."""
    checked = typed_options(cfg, InterveneSchema, _HINTS, _MISSING_HINTS)
    for key in ("n_random", "n_statements", "batch_size", "n_boot"):
        check_count(checked[key], key)
    alphas = [float(a) for a in checked["alphas"]]
    if 0.0 not in alphas or len(set(alphas)) != len(alphas) or len(alphas) < 2:
        raise ToolkitError(f"alphas={checked['alphas']}: give {_HINTS['alphas']} (distinct values; 0 is the "
                           "unsteered run every effect is measured from)")
    if checked["at"] not in ("statement", "last"):
        raise ToolkitError(f"at={checked['at']!r}: use statement or last")
    if not checked["readouts"] or any(r not in READOUTS for r in checked["readouts"]):
        raise ToolkitError(f"readouts={checked['readouts']}: give one or more of {list(READOUTS)}")
    get_enumeration(checked["enumeration"])
    check_name(checked["model"]["name"], "model.name")
    check_writable(checked["results_dir"])
    return literal_config({**checked, "alphas": alphas})
