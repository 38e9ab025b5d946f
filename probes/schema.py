"""Typed schema of `python -m train_probe`'s own options, checked before any work (see extract/schema.py).

Probe options (`probe.*`) are checked by each probe's constructor; these are the run's options.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional

import torch
from omegaconf import DictConfig, OmegaConf

from extract.errors import ToolkitError, check_count
from extract.schema import check_writable, typed_options

Bootstrap = Enum("Bootstrap", {k: k for k in ("cluster", "iid")})
Calibration = Enum("Calibration", {k: k for k in ("out_of_fold", "out_of_fold_cv", "in_sample")})
Accelerator = Enum("Accelerator", {k: k for k in ("auto", "cpu", "gpu", "cuda")})
_HINTS = {"tasks": "a list of tasks, e.g. tasks=[true_vs_all,multiclass]", "seed": "a whole number", "split_seed": "a whole number", "n_boot": "a whole number >= 1",
          "alpha": "a number in (0, 1), e.g. 0.1", "mondrian": "true or false", "overwrite": "true or false",
          "calibration_folds": "a whole number >= 2", "bootstrap": "cluster or iid",
          "calibration": "out_of_fold, out_of_fold_cv or in_sample", "trainer.accelerator": "auto, cpu or gpu"}


@dataclass
class TrainerSchema:
    accelerator: Accelerator = Accelerator.auto


@dataclass
class TrainProbeSchema:
    layer: Any = 16
    tasks: Optional[list[str]] = None
    seed: int = 0
    split_seed: int = 0
    bootstrap: Bootstrap = Bootstrap.cluster
    calibration: Calibration = Calibration.out_of_fold_cv
    calibration_folds: int = 3
    alpha: float = 0.1
    mondrian: bool = False
    n_boot: int = 1000
    store_dir: str = "activations"
    results_dir: str = "results"
    overwrite: bool = False
    trainer: TrainerSchema = field(default_factory=TrainerSchema)


def validate(cfg: DictConfig) -> DictConfig:
    """The config with the run's options' types and ranges checked, and results_dir writable."""
    checked = typed_options(cfg, TrainProbeSchema, _HINTS)
    check_count(checked["n_boot"], "n_boot")
    if checked["calibration_folds"] < 2:
        raise ToolkitError(f"calibration_folds={checked['calibration_folds']}: give {_HINTS['calibration_folds']}")
    if not 0 < checked["alpha"] < 1:
        raise ToolkitError(f"alpha={checked['alpha']}: give {_HINTS['alpha']}")
    if checked["trainer"]["accelerator"] in ("gpu", "cuda") and not torch.cuda.is_available():
        raise ToolkitError(f"trainer.accelerator={checked['trainer']['accelerator']} but no GPU is visible: use "
                           "trainer.accelerator=cpu (or auto)")
    check_writable(checked["results_dir"])
    return OmegaConf.create(checked)
