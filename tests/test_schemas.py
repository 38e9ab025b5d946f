"""Issue 27, one schema per entry point: every entry point's config (conf/<name>.yaml) has a typed schema
that declares each of its options (config groups aside) with the composed config's default and a
one-line description (the one `--help` prints)."""
from __future__ import annotations

import pytest
from omegaconf import MISSING, OmegaConf

from toolkit.config import CONF_DIR, compose_config, config_groups
from toolkit.entry import SCHEMAS as SCHEMA_NAMES, schema_of
from toolkit.schema import schema_options

SCHEMAS = {name: schema_of(name) for name in SCHEMA_NAMES}
GIVEN_BY_THE_YAML = {("ncb", "stress.neutral"), ("ncb", "stress.interferences")}   # long texts: MISSING in the schema


def composed_options(name: str) -> tuple[dict, dict]:
    """The options of conf/<name>.yaml as composed (dotted keys, unresolved, config groups left out) and
    the schema's declared options (dotted key -> dataclass field)."""
    cfg = compose_config(name, hydra=True)
    groups = config_groups(cfg)
    declared = schema_options(SCHEMAS[name], groups)
    values = OmegaConf.to_container(cfg, resolve=False)
    out = {}

    def walk(node: dict, prefix: str) -> None:
        for key, value in node.items():
            dotted = prefix + key
            if isinstance(value, dict) and dotted not in declared:
                walk(value, dotted + ".")
            else:
                out[dotted] = value
    walk({k: v for k, v in values.items() if k != "hydra" and k not in groups}, "")
    return out, declared


def schema_default(schema, key: str):
    value = OmegaConf.to_container(OmegaConf.structured(schema), resolve=False, enum_to_str=True)
    for part in key.split("."):
        value = value[part]
    return value


def test_every_entry_point_config_has_a_schema():
    assert {p.stem for p in CONF_DIR.glob("*.yaml")} == set(SCHEMAS)


@pytest.mark.parametrize("name", SCHEMAS)
def test_schema_declares_every_option_with_the_composed_default(name):
    composed, declared = composed_options(name)
    assert set(composed) == set(declared), f"{name}: only in the YAML {set(composed) - set(declared)}, only in " \
                                           f"the schema {set(declared) - set(composed)}"
    for key, value in composed.items():
        expected = MISSING if (name, key) in GIVEN_BY_THE_YAML else value
        assert schema_default(SCHEMAS[name], key) == expected, f"{name}: {key}"


@pytest.mark.parametrize("name", SCHEMAS)
def test_every_option_has_a_one_line_description(name):
    for key, f in schema_options(SCHEMAS[name], config_groups(compose_config(name, hydra=True))).items():
        text = f.metadata.get("help", "")
        assert text and "\n" not in text, f"{name}: {key}"

