"""The Lightning trainer the probes trained by gradient descent (linear, mlp) run inside `fit`, its
optional loggers (`trainer_logging`) and the one-item data set of full-batch training."""
from __future__ import annotations

import importlib.util
import logging
import warnings
from contextlib import contextmanager

import lightning as L
import torch
from torch.utils.data import Dataset

from probes.base import ProbeError, check_choice


@contextmanager
def quiet_lightning():
    """Silence the Trainer's per-fit info lines and data-loader hints (the caller shows progress)."""
    names = ("lightning", "lightning.pytorch", "lightning.fabric", "pytorch_lightning")
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*does not have many workers.*")
            warnings.filterwarnings("ignore", message=".*number of training batches.*")
            warnings.filterwarnings("ignore", message=".*GPU available but not used.*")
            warnings.filterwarnings("ignore", message=".*srun.*")
            warnings.filterwarnings("ignore", message=".*LeafSpec.*")  # lightning 2.6 on torch >= 2.10
            yield
    finally:
        for lg, lvl in zip(loggers, levels):
            lg.setLevel(lvl)


TRAINER_LOGGERS = ("csv", "tensorboard")
_LOGGING: dict = {}   # {"kind": ..., "folder": ...} inside trainer_logging(), else empty


def check_logger(kind: str) -> None:
    """One ProbeError line unless `kind` is a logger this environment can run (tensorboard needs its package)."""
    check_choice("trainer.logger", kind, TRAINER_LOGGERS)
    if kind == "tensorboard" and not any(importlib.util.find_spec(m) for m in ("tensorboard", "tensorboardX")):
        raise ProbeError("trainer.logger=tensorboard needs the tensorboard package: pip install tensorboard (or use "
                         "trainer.logger=csv)")


@contextmanager
def trainer_logging(kind: str | None, folder):
    """Within: every Lightning fit (mlp, linear) logs its metrics with Lightning's `kind` logger ("csv":
    metrics.csv, "tensorboard": event files) under `folder`/version_<n> (one version per fit: heads,
    folds, C values in the order fitted); None: no logger (the default, nothing written)."""
    if kind is None:
        yield
        return
    check_logger(kind)
    _LOGGING.update(kind=kind, folder=str(folder))
    try:
        yield
    finally:
        _LOGGING.clear()


def _logger():
    """The Lightning logger of the current trainer_logging() context, or False."""
    if not _LOGGING:
        return False
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    return (CSVLogger if _LOGGING["kind"] == "csv" else TensorBoardLogger)(_LOGGING["folder"], name="")


def make_trainer(accelerator: str, max_epochs: int, callbacks=None, **kwargs) -> L.Trainer:
    """A single-device Trainer without checkpoints / progress bar / model summary, and without a logger
    unless inside trainer_logging()."""
    return L.Trainer(accelerator=accelerator, devices=1, max_epochs=max_epochs, callbacks=callbacks,
                     logger=_logger(), enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, num_sanity_val_steps=0, log_every_n_steps=1,
                     **kwargs)


class FullBatch(Dataset):
    """A data set of one item: the whole training split (for full-batch optimisers)."""

    def __init__(self, *tensors: torch.Tensor):
        self.tensors = tensors

    def __len__(self) -> int:
        return 1

    def __getitem__(self, i):
        return self.tensors
