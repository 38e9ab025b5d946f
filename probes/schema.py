"""Typed schemas of `python -m train_probe`'s and `python -m apply_probe`'s own options, checked before any
work (see toolkit/schema.py).

Probe options (`probe.*`) are checked by each probe's constructor; these are the runs' options. This
module imports neither torch nor the probes: `--help` reads it (toolkit.config.answer_help).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional

from omegaconf import MISSING, DictConfig

from evaluation.tracking import check_tracker
from toolkit.errors import ToolkitError, check_count, check_writable
from toolkit.schema import literal_config, InputStoreOptions, option, threads_option, typed_options

Bootstrap = Enum("Bootstrap", {k: k for k in ("cluster", "iid")})
Calibration = Enum("Calibration", {k: k for k in ("out_of_fold", "out_of_fold_cv", "in_sample")})
TrainerLogger = Enum("TrainerLogger", {k: k for k in ("csv", "tensorboard")})
Accelerator = Enum("Accelerator", {k: k for k in ("auto", "cpu", "gpu", "cuda")})
View = Enum("View", {"html": "html"})
Tracker = Enum("Tracker", {k: k for k in ("mlflow", "tensorboard")})   # evaluation.tracking.TRACKERS
AUGMENTS = ("structure_aware", "neutral")     # train_probe augment=<kind> (probes.augment; conf/augment/)
AugmentKind = Enum("AugmentKind", {k: k for k in AUGMENTS})
_HINTS = {"tasks": "a list of tasks, e.g. tasks=[true_vs_all,multiclass]", "seed": "a whole number", "split_seed": "a whole number", "n_boot": "a whole number >= 1",
          "alpha": "a number in (0, 1), e.g. 0.1", "mondrian": "true or false", "overwrite": "true or false",
          "calibration_folds": "a whole number >= 2", "bootstrap": "cluster or iid",
          "calibration": "out_of_fold, out_of_fold_cv or in_sample", "trainer.accelerator": "auto, cpu or gpu",
          "trainer.logger": "csv, tensorboard or null", "tracker": "mlflow, tensorboard or null", "augment.kind": f"one of {', '.join(AUGMENTS)}",
          "augment.per_statement": "a whole number >= 1, or null for every context",
          "augment.extract.batch_tokens": "a whole number >= 1", "augment.extract.window_mb": "a whole number >= 1"}
APPLY_HINTS = {"overwrite": "true or false", "batch_tokens": "a whole number >= 1", "cell": "a result cell's path",
               "csv": "a CSV file's path", "name": "a file name (letters, digits, ._+=,-)",
               "device": "auto, cpu, cuda or mps", "view": "html or null", "row": "a whole number >= 0",
               "tracker": "mlflow, tensorboard or null"}
# apply_probe's command line: these values are taken as written (toolkit.entry.quoted), and probe= means cell=
APPLY_QUOTED, APPLY_RENAMED = ("cell", "csv", "text"), {"probe": "cell"}


def tracker_option():
    return option(None, "mlflow | tensorboard: log every cell written to that tracker (evaluation/tracking.py); "
                        "null: none")


def tracker_dir_option():
    return option(None, "the tracker's folder; null: mlruns/ (mlflow) or tensorboard/ beside results_dir")


@dataclass
class TrainerSchema:
    accelerator: Accelerator = option(Accelerator.auto, "where the probes are fitted: cpu | gpu | auto")
    logger: Optional[TrainerLogger] = option(None, "Lightning's csv | tensorboard logger for the mlp fits' losses, "
                                             "under <results_dir>/logs/lightning/<model>/<datapack>/<probe>/layer=<k>/"
                                             "; null: none")


@dataclass
class AugmentSchema:
    """The `augment` group (conf/augment/; absent without augment=, so plain runs' cells do not change)."""
    kind: AugmentKind = option(MISSING, "structure_aware: stress contexts from training statements; neutral: the "
                               "neutral passage at the same lengths")
    per_statement: Optional[int] = option(None, "inputs kept per training statement (drawn with seed=); null: all")
    extract: InputStoreOptions = field(default_factory=InputStoreOptions)
    stress: Any = option(MISSING, "the contexts' templates and neutral passage (conf/stress/)")


@dataclass
class TrainProbeSchema:
    layer: Any = option(16, "one layer, a list [4,8,16], or all (every stored layer, one read each)")
    tasks: Optional[list[str]] = option(None, "several tasks in one job, e.g. [true_vs_all,multiclass]: each layer "
                                        "read and its heads fitted once for all; null: the task= group's")
    seed: int = option(0, "probe seed (initialisation, CV folds) and bootstrap seed")
    split_seed: int = option(0, "entity_disjoint split seed (apart from seed: a multi-seed sweep varies only the "
                             "probe)")
    bootstrap: Bootstrap = option(Bootstrap.cluster, "intervals resample subject entities (object_1) with all their "
                                  "statements | iid: statements")
    calibration: Calibration = option(Calibration.out_of_fold_cv, "score map fitted on out-of-fold training scores: "
                                      "out_of_fold_cv (the CV fold fits) | out_of_fold (refits) | in_sample")
    calibration_folds: int = option(3, "grouped folds for the out-of-fold scores (out_of_fold_cv: also the probes' "
                                    "CV folds)")
    alpha: float = option(0.1, "conformal miscoverage level: sets cover the truth with prob. >= 1 - alpha")
    mondrian: bool = option(False, "class-conditional conformal thresholds")
    n_boot: int = option(1000, "bootstrap resamples for the 95 % intervals")
    store_dir: str = option("activations", "the stores read: <store_dir>/<model.name>/<data.name>.h5")
    results_dir: str = option("results", "result cells: <results_dir>/<model>/<datapack>/<method>/<task>/...")
    overwrite: bool = option(False, "recompute cells that exist")
    features: str = option("activations", "activations (the store's layers) | text (TF-IDF of the statement, no "
                           "model) | surprisal (the model's mean / max NLL of the statement): the controls, cells under "
                           "<probe>+text / +surprisal at layer=none")
    shuffle_labels: bool = option(False, "true: the training labels permuted (by seed) before fitting: the null "
                                  "floor, cells under <probe>+shuffled")
    tracker: Optional[Tracker] = tracker_option()
    tracker_dir: Optional[str] = tracker_dir_option()
    threads: Any = threads_option()
    trainer: TrainerSchema = field(default_factory=TrainerSchema)
    augment: Optional[AugmentSchema] = option(None, "augment=structure_aware | neutral (a config group)")


@dataclass
class ApplyProbeSchema:
    """python -m apply_probe's options; `text` is declared for --help only: it is read raw (apply_probe.raw_text)."""
    cell: Optional[str] = option(None, "the result cell whose saved probe is applied (probe=<path> on the command "
                                 "line)")
    text: Any = option(None, "one statement or a list: extracted now with the probe's model and template")
    csv: Optional[str] = option(None, "a CSV file with a `statement` column (extracted likewise)")
    name: Optional[str] = option(None, "output name of text= / csv= scores (default: text, or the CSV file's stem)")
    data: Any = None                  # a data group: only its `name` is read (checked as a file name where used)
    store_dir: str = option("activations", "the stores: <store_dir>/<the probe's model>/<data.name>.h5")
    results_dir: str = option("results", "transfer cells: <results_dir>/<model>/<train>-><eval>/...; text: "
                              "<model>/apply/")
    overwrite: bool = option(False, "recompute a transfer cell that exists, replace an earlier text= / csv= "
                                    "output of the same name")
    batch_tokens: int = option(4096, "padded tokens per forward pass (text= / csv=)")
    device: str = option("auto", "where the model runs for text= / csv=: auto | cpu | cuda | cuda:N | mps")
    view: Optional[View] = option(None, "html: also a per-token page (probes/token_view.py) of text= / csv= (at most "
                                  "50 statements), or of data='s row=; null: none")
    row: Optional[int] = option(None, "with data= and view=html: the datapack row viewed (0-based; no transfer "
                                "cell is written)")
    tracker: Optional[Tracker] = tracker_option()
    tracker_dir: Optional[str] = tracker_dir_option()
    threads: Any = threads_option()


def validate(cfg: DictConfig) -> DictConfig:
    """The config with the run's options' types and ranges checked, and results_dir writable."""
    checked = typed_options(cfg, TrainProbeSchema, _HINTS)
    check_count(checked["n_boot"], "n_boot")
    if checked["calibration_folds"] < 2:
        raise ToolkitError(f"calibration_folds={checked['calibration_folds']}: give {_HINTS['calibration_folds']}")
    if not 0 < checked["alpha"] < 1:
        raise ToolkitError(f"alpha={checked['alpha']}: give {_HINTS['alpha']}")
    import torch   # here, not at the top: --help imports this module

    if checked["trainer"]["accelerator"] in ("gpu", "cuda") and not torch.cuda.is_available():
        raise ToolkitError(f"trainer.accelerator={checked['trainer']['accelerator']} but no GPU is visible: use "
                           "trainer.accelerator=cpu (or auto)")
    augment = checked.pop("augment")
    if augment is not None:     # kept only when chosen: a plain run's config (and cells) hold no augment key
        check_count(augment["per_statement"], "augment.per_statement", none_ok=True)
        for key in ("batch_tokens", "window_mb"):
            check_count(augment["extract"][key], f"augment.extract.{key}")
        if augment["extract"]["window_tokens"] != "auto":
            check_count(augment["extract"]["window_tokens"], "augment.extract.window_tokens")
        checked["augment"] = augment
    if checked["trainer"]["logger"] is not None:
        from probes.trainer import check_logger

        check_logger(checked["trainer"]["logger"])
    check_tracker(checked["tracker"])
    check_writable(checked["results_dir"])
    return literal_config(checked)
