"""Compose a Hydra config from Python (tests, benchmarks, notebooks) exactly as the command line would."""
from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


def compose_config(config_name: str, *overrides: str) -> DictConfig:
    """E.g. compose_config("extract", "model=tiny", "limit=10") == `python -m extract model=tiny limit=10`."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name=config_name, overrides=list(overrides))


def layer_sweep_probes() -> list[str]:
    """The probes of the layer_sweep preset (conf/experiment/layer_sweep.yaml): the one list of them."""
    preset = OmegaConf.load(CONF_DIR / "experiment" / "layer_sweep.yaml")
    return str(preset.hydra.sweeper.params.probe).split(",")
