"""Compose a Hydra config from Python (tests, benchmarks, notebooks) exactly as the command line would,
and every entry point's `--help`: its config groups with their choices and its options with their
one-line descriptions (from its schema), printed without importing torch or lightning."""
from __future__ import annotations

import json
import sys
from dataclasses import Field
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from toolkit.schema import schema_options

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


def compose_config(config_name: str, *overrides: str, hydra: bool = False) -> DictConfig:
    """E.g. compose_config("extract", "model=tiny", "limit=10") == `python -m extract model=tiny limit=10`
    (`hydra`: with the `hydra` block, whose runtime.choices name each config group's choice)."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name=config_name, overrides=list(overrides), return_hydra_config=hydra)


def config_groups(cfg: DictConfig) -> dict[str, str | None]:
    """The config groups of a config composed with `hydra=True` (model, data, probe, ...) and their choices."""
    return {group: choice for group, choice in cfg.hydra.runtime.choices.items() if not group.startswith("hydra")}


def layer_sweep_probes() -> list[str]:
    """The probes of the layer_sweep preset (conf/experiment/layer_sweep.yaml): the one list of them."""
    preset = OmegaConf.load(CONF_DIR / "experiment" / "layer_sweep.yaml")
    return str(preset.hydra.sweeper.params.probe).split(",")


def answer_help(module: str, config_name: str, schema) -> None:
    """`python -m <entry point> --help` (or -h, the only argument): print `help_text` and exit 0. Each entry
    module calls it before its other imports (torch, lightning), so help takes a second; --hydra-help is Hydra's."""
    if module == "__main__" and sys.argv[1:] in (["--help"], ["-h"]):
        print(help_text(config_name, schema))
        sys.exit(0)


def help_text(config_name: str, schema) -> str:
    """The header comment of conf/<config_name>.yaml, the config groups (choices from conf/<group>/, the
    default marked *) and the options of `schema` (a dataclass) with their defaults and descriptions."""
    cfg = compose_config(config_name, hydra=True)
    header = [line.lstrip("# ") for line in (CONF_DIR / f"{config_name}.yaml").read_text().splitlines()
              if line.startswith("#")]
    lines = [*header, "", "config groups (group=choice, * the default; any key of a group: <group>.<key>=value):"]
    for group, choice, names in group_choices(cfg):
        lines.append(f"  {group:<14}" + ", ".join(f"*{n}" if n == choice else n for n in names)
                     + ("  (default: none)" if choice is None else ""))
    lines += ["", "options (option=default):"]
    for key, f, default in option_table(cfg, schema):
        lines.append(f"  {key + '=' + default:<32} {f.metadata.get('help', '')}")
    lines += ["", "multirun: -m option=a,b; Hydra's own help: --hydra-help"]
    return "\n".join(lines)


def group_choices(cfg: DictConfig) -> list[tuple[str, str | None, list[str]]]:
    """(group, its choice, every choice conf/<group>/ holds) of each config group of `cfg` (composed
    with hydra=True), sorted by group: what --help and the manual list."""
    return [(group, choice, sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml")))
            for group, choice in sorted(config_groups(cfg).items())]


def option_table(cfg: DictConfig, schema) -> list[tuple[str, Field, str]]:
    """(option, its schema field, its default as written on the command line) of every option `schema`
    declares (config groups left out), `cfg` composed with hydra=True: what --help and the manual list."""
    values = OmegaConf.to_container(cfg, resolve=False)
    return [(key, f, _shown(_lookup(values, key))) for key, f in schema_options(schema, config_groups(cfg)).items()]


def _lookup(values: dict, key: str):
    """The value at a dotted `key` of a nested dict (None where absent)."""
    for part in key.split("."):
        values = values.get(part) if isinstance(values, dict) else None
    return values


def _shown(value) -> str:
    """A default as written on the command line (null, true, [a,b], {key,...}), cut to 24 characters."""
    if isinstance(value, list):
        text = "[" + ",".join(_shown(v) for v in value) + "]"
    elif isinstance(value, dict):
        text = "{" + ",".join(value) + "}"
    else:
        text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= 24 else text[:21] + "..."
