"""Typed schema of `python -m extract`'s options, checked before any work.

OmegaConf checks each option's type against these dataclasses (an int where an int belongs, one of
the listed dtypes, ...); the ranges it cannot express (>= 1, `auto` or a number) are checked here.
Every failure is one ToolkitError line naming the option. The YAML files stay the defaults; the
schema is applied in `validate` (inside the entry point, so its errors reach `run_entry`: Hydra
reports errors of its own composition on several lines). Keys a schema does not list (options of
other entry points sharing a config group) pass through unchecked.

Every entry point's schema declares each of its own options (not its config groups' keys) with
`option(default, help)`: the YAML's default (tests/test_schemas.py checks they agree) and the
one-line description `--help` prints (toolkit.config.answer_help).
"""
from __future__ import annotations

import copy
import json
import re
from dataclasses import Field, dataclass, field, fields, is_dataclass
from enum import Enum
from typing import Any, Optional

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from toolkit.errors import ToolkitError, check_count, config_error

StoredDtype = Enum("StoredDtype", {k: k for k in ("float16", "bfloat16", "float32")})
ComputeDtype = Enum("ComputeDtype", {k: k for k in ("float32", "bfloat16", "float16", "auto")})
ModelSource = Enum("ModelSource", {k: k for k in ("hub", "gguf_package", "gguf_parts", "tiny")})
DataSource = Enum("DataSource", {k: k for k in ("csv", "hf")})
_HINTS = {"limit": "a whole number >= 1, or null for every statement", "batch_tokens": "a whole number >= 1",
          "window_mb": "a whole number >= 1", "overwrite": "true or false",
          "prefix_cache": "true or false", "dry_run": "true or false", "shards": "a whole number >= 1",
          "shard": "a whole number 0..shards-1, or null", "tokens_per_s": "a number > 0, or null", "model.seed": "a whole number",
          "model.hidden_size": "a whole number", "model.n_layers": "a whole number", "model.instruct": "true or false"}
_MISSING_HINTS = {"data.name": "the store's file name, e.g. data.name=mine",
                  "data.path": "the CSV file, e.g. data.path=my.csv"}


def option(default, help: str, empty_ok: bool = False) -> Field:
    """A schema field: the option's default (a list or dict is copied for each instance) and its one-line `help`.
    A list given for it must hold each item once and, unless `empty_ok` (`[]` means "none": say so in `help`),
    at least one (typed_options)."""
    metadata = {"help": help, "empty_ok": empty_ok}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def threads_option() -> Field:
    """The `threads` option of the entry points that run torch (conf/runtime/threads.yaml; toolkit.entry.set_threads)."""
    return option("auto", "torch CPU threads: auto (SLURM_CPUS_PER_TASK or OMP_NUM_THREADS when set, else every core "
                          "of this process) or a number; one job of several at once: threads=1")


def schema_options(schema, groups=(), prefix: str = "") -> dict[str, Field]:
    """The options `schema` (a dataclass) declares, by dotted name (`trainer.accelerator`): nested dataclasses
    flattened, its top-level fields named in `groups` (config groups: model, data, ...) left out."""
    out = {}
    for f in fields(schema):
        if f.name in groups:
            continue
        nested = _nested(f)
        if nested is not None:
            out.update(schema_options(nested, (), f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = f
    return out


@dataclass
class ModelSchema:
    name: str = MISSING
    source: ModelSource = MISSING
    name_or_path: Optional[str] = None
    package: Optional[str] = None
    file: Optional[str] = None
    hidden_size: Optional[int] = None
    n_layers: Optional[int] = None
    seed: Optional[int] = None
    instruct: bool = False
    chat_template: Any = "auto"
    system_prompt: Optional[str] = None
    dtype: ComputeDtype = ComputeDtype.float32
    store_dtype: StoredDtype = StoredDtype.float16
    device: str = "auto"
    device_map: Any = None


@dataclass
class DataSchema:
    name: str = MISSING
    source: DataSource = DataSource.csv
    path: Optional[str] = None
    statement_column: str = "statement"
    label_column: Optional[str] = None


@dataclass
class InputStoreOptions:
    """Extraction of inputs under a context into a store beside the clean one (ncb's stress inputs, train_probe's
    augment=): the batching and windows of python -m extract."""
    batch_tokens: int = option(4096, "padded tokens per forward pass of the inputs under a context")
    window_tokens: Any = option("auto", "tokens per write of their store (as python -m extract)")
    window_mb: int = option(512, "buffer memory per window of their store")


@dataclass
class ExtractSchema:
    model: ModelSchema = field(default_factory=ModelSchema)
    data: DataSchema = field(default_factory=DataSchema)
    store_dir: str = option("activations", "the stores: <store_dir>/<model.name>/<data.name>.h5")
    layers: Any = option("all", "all, one int, or a list such as [0,8,16]; 0 = embeddings, L = last block")
    dtype: StoredDtype = option("${model.store_dtype}", "stored dtype: float16 | bfloat16 | float32 (default: the "
                                "model's store_dtype)")
    limit: Optional[int] = option(None, "N statements for quick runs: every label in the datapack's proportions, "
                                  "whole subjects, fixed seed (extract.statements.limit_statements)")
    overwrite: bool = option(False, "replace an existing store made with other settings")
    batch_tokens: int = option(4096, "padded tokens per forward pass (batch size x longest statement)")
    window_tokens: Any = option("auto", "tokens per write (the unit of resumption); auto: as many as fit window_mb")
    window_mb: int = option(512, "buffer memory per window (up to three windows are held at once)")
    prefix_cache: bool = option(True, "run the token prefix every input shares once (its key/value cache reused) and "
                                "store it once (schema 2); false: every input whole (schema 1)")
    dry_run: bool = option(False, "print the plan (statements, tokens, bytes, free disk, time) from the config and "
                           "tokenizer alone, and refuse one the disk cannot hold; nothing is written")
    tokens_per_s: Optional[float] = option(None, "dry_run's time estimate: forward tokens per second (null: the figure "
                                           "measured for this model and device, extract.plan)")
    shards: int = option(1, "split the datapack into N label-stratified slices (one store each, extract.shards); "
                         "without shard=: merge the N finished shards into the datapack's store")
    shard: Optional[int] = option(None, "the slice this job extracts, 0..shards-1 (-m shard='range(N)' runs them all)")
    threads: Any = threads_option()


def validate(cfg: DictConfig) -> DictConfig:
    """The config with every option's type and range checked (a plain DictConfig, enums as strings)."""
    checked = typed_options(cfg, ExtractSchema, _HINTS, _MISSING_HINTS)
    check_count(checked["limit"], "limit", none_ok=True)
    check_count(checked["batch_tokens"], "batch_tokens")
    check_count(checked["window_mb"], "window_mb")
    if checked["tokens_per_s"] is not None and not checked["tokens_per_s"] > 0:
        raise ToolkitError(f"tokens_per_s={checked['tokens_per_s']}: give a number > 0, or null")
    check_count(checked["shards"], "shards")
    if checked["shard"] is not None and not 0 <= checked["shard"] < checked["shards"]:
        raise ToolkitError(f"shard={checked['shard']} is outside 0..{checked['shards'] - 1} for shards="
                           f"{checked['shards']}: give shards=N (N >= 2) and shard=0..N-1")
    if checked["window_tokens"] != "auto":
        check_count(checked["window_tokens"], "window_tokens")
    if checked["model"]["chat_template"] not in ("auto", True, False):
        raise ToolkitError(f"model.chat_template={checked['model']['chat_template']!r}: use auto, true or false")
    return literal_config(checked)


def literal(value):
    """`value` (a plain config: dicts, lists, scalars) with every `${` in its strings escaped (and the
    backslashes before it doubled), so that a config made of it keeps them as characters: a resolved
    value is data, and wrapped again it must not become an interpolation (`${oc.env:SECRET}` in a
    system prompt would be resolved to the secret)."""
    if isinstance(value, str):
        return re.sub(r"(\\*)\$\{", lambda m: m.group(1) * 2 + "\\${", value)
    if isinstance(value, dict):
        return {k: literal(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [literal(v) for v in value]
    return value


def literal_config(plain: dict) -> DictConfig:
    """A DictConfig of the plain, resolved config `plain` whose strings stay as written (`literal`)."""
    return OmegaConf.create(literal(plain))


def typed_options(cfg: DictConfig, schema, hints: dict | None = None, missing_hints: dict | None = None) -> dict:
    """`cfg` as a plain dict, the keys `schema` (a dataclass) declares type-checked by OmegaConf; a
    wrong type or a missing value is one ToolkitError line naming the option."""
    try:
        plain = OmegaConf.to_container(cfg, resolve=True)
        _check_booleans(plain, schema)
        typed = OmegaConf.merge(OmegaConf.structured(schema), literal(_known(plain, schema)))
    except OmegaConfBaseException as err:
        raise config_error(err, hints) from None
    missing = sorted(OmegaConf.missing_keys(typed))
    if missing:
        key = missing[0]
        raise ToolkitError(f"{key} is not set: give {(missing_hints or {}).get(key, f'{key}=...')} on the command line")
    checked = OmegaConf.to_container(typed, resolve=True, enum_to_str=True)
    _check_seeds(checked)
    _check_lists(checked, schema)
    return _update(plain, checked)


SEED_MAX = 2**32 - 1      # numpy's and torch's seeds


def _check_seeds(values: dict, prefix: str = "") -> None:
    """Every option named `seed` or `*_seed` (nested too) is null or a whole number in 0..SEED_MAX
    (numpy refuses others deep inside a run): a one-line ToolkitError naming it."""
    for key, value in values.items():
        if isinstance(value, dict):
            _check_seeds(value, f"{prefix}{key}.")
        elif (key == "seed" or key.endswith("_seed")) and value is not None and not 0 <= value <= SEED_MAX:
            raise ToolkitError(f"{prefix}{key}={value} is outside 0..{SEED_MAX}: give a seed in that range, "
                               f"e.g. {prefix}{key}=0")


def _dotted(values: dict, name: str):
    """values[a][b] for name "a.b" (None where a level is missing)."""
    for key in name.split("."):
        values = values.get(key) if isinstance(values, dict) else None
    return values


def _check_booleans(values: dict, schema) -> None:
    """A boolean option given a number (`overwrite=1`) is one ToolkitError line: OmegaConf would read any
    number as true or false. (The words true / false, yes / no and on / off are read as booleans.)"""
    for name, f in schema_options(schema).items():
        value = _dotted(values, name)
        if f.type in ("bool", bool) and isinstance(value, (int, float)) and not isinstance(value, bool):
            raise ToolkitError(f"{name}={value}: use true or false")


def _check_lists(values: dict, schema) -> None:
    """Every list among `values` for an option of `schema` holds each item once and, unless the option is
    `empty_ok`, at least one: else a one-line ToolkitError naming it (an empty list would run nothing and
    exit 0; a repeated item would run twice)."""
    for name, f in schema_options(schema).items():
        value = _dotted(values, name)
        if not isinstance(value, list):
            continue
        items = value
        if not items and not f.metadata.get("empty_ok"):
            default = f.default_factory() if callable(f.default_factory) else f.default
            example = f"{name}=[{','.join(map(str, default))}]" if isinstance(default, list) and default else \
                f"{name}=[...]"
            raise ToolkitError(f"{name}=[]: give at least one, e.g. {example} (or leave the option out)")
        seen = [json.dumps(v, sort_keys=True, default=str) for v in items]
        twice = next((v for v, k in zip(items, seen) if seen.count(k) > 1), None)
        if twice is not None:
            raise ToolkitError(f"{name}={items}: {twice} is listed more than once: list each once")


def _known(values: dict, schema) -> dict:
    """The entries of `values` that `schema` declares (nested dataclasses recursively)."""
    out = {}
    for f in fields(schema):
        if f.name in values:
            sub = values[f.name]
            nested = _nested(f)
            out[f.name] = _known(sub, nested) if nested is not None and isinstance(sub, dict) else sub
    return out


def _nested(f: Field):
    """The dataclass a schema field holds (a nested block of options or a config group), else None."""
    default = f.default_factory() if callable(f.default_factory) else None
    return type(default) if is_dataclass(default) else None


def _update(base: dict, new: dict) -> dict:
    """`base` with the entries of `new` written over it (nested dicts merged)."""
    out = dict(base)
    for key, value in new.items():
        out[key] = _update(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict) else value
    return out
