"""Typed schema of `python -m ncb`'s options, checked before any work (see toolkit/schema.py).

Types (booleans included: `overwrite=no` is refused, never read as true) by the one typed parser,
toolkit.schema.typed_options; then the ranges it cannot express, the zero-shot enumeration, the
stress templates (contexts.interference.check_templates) and a writable results_dir. Level keys of the
stress templates are text (`stress.interferences.peer.1='...'` replaces one level's template;
`+stress.interferences.peer.7='...'` adds one), so two levels can never be pooled under one name.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from omegaconf import MISSING, DictConfig

from evaluation.tasks import TASKS
from toolkit.errors import ToolkitError, check_count, check_name, check_writable
from toolkit.schema import literal_config, InputStoreOptions, ModelSchema, option, threads_option, typed_options
from contexts.interference import check_templates
from zero_shot.prompts import get_enumeration

Task = Enum("Task", {k: k for k in TASKS})
SETTINGS = ("direct", "cot", "reflection")        # ncb.settings
Setting = Enum("Setting", {k: k for k in SETTINGS})
_HINTS = {"fractions": "a list of numbers in (0, 0.5), e.g. fractions=[0.05,0.2,0.35]",
          "balance_by_py": "true or false", "overwrite": "true or false", "n_bins": "a whole number >= 1",
          "clip": "a number in (0, 1), e.g. 1e-10", "n_boot": "a whole number >= 1", "seed": "a whole number",
          "split_seed": "a whole number", "stress_layers": "a list of layers, e.g. stress_layers=[15,20]", "zero_shot.task": f"one of {', '.join(TASKS)}",
          "zero_shot.batch_size": "a whole number >= 1", "zero_shot.save_every": "a whole number >= 1",
          "zero_shot.prefix_cache": "true or false", "extract.batch_tokens": "a whole number >= 1",
          "zero_shot.settings": f"a list of {', '.join(SETTINGS)} holding direct, "
                                "e.g. zero_shot.settings=[direct,cot]",
          "zero_shot.rationale_tokens": "a whole number >= 1",
          "zero_shot.self_consistency.temperature": "a number > 0, e.g. 0.7",
          "zero_shot.self_consistency.n_samples": "a whole number >= 1",
          "zero_shot.self_consistency.seed": "a whole number",
          "extract.window_mb": "a whole number >= 1", "model.instruct": "true or false",
          "stress.interferences": "{interference: {level: template}} with text levels, "
                                  "e.g. stress.interferences.peer.1='...'"}
_MISSING_HINTS = {"method": "method=zero_shot or a probe's result cell, \"method='results/.../seed=<s>.json'\""}


@dataclass
class SelfConsistencyOptions:
    temperature: float = option(0.7, "sampling temperature of the answers (and cot rationales) compared")
    n_samples: int = option(30, "answers per target: unanimity of n (direct: exact, no sampling)")
    seed: int = option(0, "seed of the sampled cot rationales and reflection first answers")


@dataclass
class ZeroShotOptions:
    enumeration: str = option("default", "method=zero_shot: the prompt's enumeration (as python -m zero_shot)")
    task: Task = option(Task.multiclass, "class probabilities read (evaluation/tasks.py names)")
    batch_size: int = option(16, "prompts per forward pass")
    save_every: int = option(8, "batches between checkpoints of the stress scores")
    prefix_cache: bool = option(True, "run the prompt's shared prefix once and reuse its key/value cache")
    settings: list[Setting] = option([Setting.direct], "direct | cot (a rationale first) | reflection (a second "
                                     "turn); direct always")
    rationale_tokens: int = option(48, "cot: at most this many rationale tokens (greedy; stops at the turn's end)")
    self_consistency: SelfConsistencyOptions = field(default_factory=SelfConsistencyOptions)


@dataclass
class StressOptions:
    neutral: str = option(MISSING, "the neutral passage; control = it cut to the next template's word count "
                          "(text in conf/stress/)")
    interferences: dict[str, dict[str, str]] = option(MISSING, "{interference: {level: template}} with {false}, "
                                                      "{true}, {neighbour} (templates in conf/stress/)")


@dataclass
class NCBSchema:
    model: ModelSchema = field(default_factory=ModelSchema)
    method: str = option(MISSING, "a probe's result cell (results/.../layer=<k>/seed=<s>.json) or zero_shot")
    fractions: list[float] = option([0.05, 0.2, 0.35], "high / low groups: top / bottom fraction of the valid test "
                                    "targets by NCB")
    balance_by_py: bool = option(False, "true: equal-count P(y) bins, top / bottom fraction inside each")
    n_bins: int = option(5, "P(y) bins for balance_by_py")
    clip: float = option(1e-10, "every p is clipped at this from below before the logarithms")
    n_boot: int = option(1000, "cluster-bootstrap resamples (subject entities) for the 95 % intervals")
    seed: int = option(0, "bootstrap seed")
    split_seed: int = option(0, "entity_disjoint split seed of zero_shot (as python -m zero_shot)")
    store_dir: str = option("activations", "clean store <store_dir>/<model>/<datapack>.h5; stress stores beside it")
    stress_layers: list[int] = option([], "layers the stress store holds besides the probe's own: probes of the same "
                                      "task and split at any of them reuse its one extraction", empty_ok=True)
    threads: Any = threads_option()
    results_dir: str = option("results", "<results_dir>/<model.name>/<data.name>/ncb/<method>/{targets,stress}.json")
    overwrite: bool = option(False, "recompute existing outputs (and re-extract the stress store)")
    zero_shot: ZeroShotOptions = field(default_factory=ZeroShotOptions)
    extract: InputStoreOptions = field(default_factory=InputStoreOptions)
    stress: StressOptions = field(default_factory=StressOptions)


def validate(cfg: DictConfig) -> DictConfig:
    """The config with every option's type and range checked (a plain DictConfig, enums as strings)."""
    checked = typed_options(cfg, NCBSchema, _HINTS, _MISSING_HINTS)
    fractions = checked["fractions"]
    if not fractions or not all(0 < f < 0.5 for f in fractions):
        raise ToolkitError(f"fractions={fractions}: give {_HINTS['fractions']}")
    for key in ("n_bins", "n_boot"):
        check_count(checked[key], key)
    if not 0 < checked["clip"] < 1:
        raise ToolkitError(f"clip={checked['clip']:g}: give {_HINTS['clip']} (the floor of every p before the "
                           "logarithms)")
    z = checked["zero_shot"]
    for key in ("batch_size", "save_every", "rationale_tokens"):
        check_count(z[key], f"zero_shot.{key}")
    check_count(z["self_consistency"]["n_samples"], "zero_shot.self_consistency.n_samples")
    if not z["self_consistency"]["temperature"] > 0:
        raise ToolkitError(f"zero_shot.self_consistency.temperature={z['self_consistency']['temperature']}: give "
                           f"{_HINTS['zero_shot.self_consistency.temperature']}")
    settings = z["settings"]
    if "direct" not in settings or len(set(settings)) < len(settings):
        raise ToolkitError(f"zero_shot.settings={settings}: give {_HINTS['zero_shot.settings']} (direct is the "
                           "baseline the others are compared with), each once")
    if settings != ["direct"] and checked["method"] != "zero_shot":
        raise ToolkitError(f"zero_shot.settings={settings} is for method=zero_shot: a probe reads the statement "
                           "directly; drop the option")
    z["settings"] = [s for s in SETTINGS if s in settings]
    if checked["stress_layers"] and checked["method"] == "zero_shot":
        raise ToolkitError(f"stress_layers={checked['stress_layers']} is for a probe method: the zero-shot prompt "
                           "stores no activations; drop the option")
    for key in ("batch_tokens", "window_mb"):
        check_count(checked["extract"][key], f"extract.{key}")
    if checked["extract"]["window_tokens"] != "auto":
        check_count(checked["extract"]["window_tokens"], "extract.window_tokens")
    get_enumeration(checked["zero_shot"]["enumeration"])
    check_templates(checked["stress"]["interferences"])
    check_name(checked["model"]["name"], "model.name")
    check_name(cfg.data.name, "data.name")
    check_writable(checked["results_dir"])
    return literal_config(checked)
