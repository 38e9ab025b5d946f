"""Typed schemas of the report entry points' options (`python -m experiments.report`, `.transfer`,
`.cross_model`; conf/<name>.yaml holds the defaults), checked before any work by the one typed parser
(toolkit.schema.typed_options). Light on purpose: `--help` reads this module (toolkit.config.answer_help).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Optional

from omegaconf import MISSING

from evaluation.splits import KINDS
from toolkit.schema import option
from extract.statements import TRILEMMA

TRANSFER_TASKS = ("true_vs_false", "multiclass")
SplitKind = Enum("SplitKind", {k: k for k in KINDS})
_SPLIT_SEED = "only fills the split group's ${split_seed}; cells of any split seed are read"


@dataclass
class Named:
    """A config group of which a report reads only the name (model=, data=)."""
    name: str = MISSING


@dataclass
class SplitChoice:
    """The split group (conf/split/) of which a report reads only the kind: split=entity_disjoint | reference | ..."""
    kind: SplitKind = SplitKind.entity_disjoint


@dataclass
class ReportSchema:
    """`python -m experiments.report`'s options (conf/report.yaml)."""
    model: Named = field(default_factory=Named)
    data: Named = field(default_factory=Named)
    results_dir: str = option("results", "the result cells read: <results_dir>/<model>/<datapack>/...")
    reports_dir: str = option("reports", "tables and figures: <reports_dir>/<model>/<datapack>/")
    cross_model: Optional[list[str]] = option(None, "e.g. [smollm2,gemma3-270m]: also <reports_dir>/cross_model/ "
                                              "(MCC vs relative depth, claims)")


@dataclass
class TransferSchema:
    """`python -m experiments.transfer`'s options (conf/transfer.yaml)."""
    model: Named = field(default_factory=Named)
    datapacks: list[str] = option(list(TRILEMMA), "train and eval datapacks (rows and columns)")
    tasks: list[str] = option(list(TRANSFER_TASKS), "the tasks whose best-layer probes are applied")
    split: SplitChoice = field(default_factory=SplitChoice)
    split_seed: int = option(0, _SPLIT_SEED)
    results_dir: str = option("results", "the result cells read, and transfer cells written")
    reports_dir: str = option("reports", "-> <reports_dir>/<model>/transfer.csv, transfer.md, transfer_<task>.png")
    store_dir: Optional[str] = option("activations", "missing transfer cells are computed from "
                                      "<store_dir>/<model>/<datapack>.h5")
    page_dir: Optional[str] = option(None, "also the results page <page_dir>/<model>.md with its figures and csv, "
                                     "e.g. page_dir=docs/results/transfer")


@dataclass
class CrossModelSchema:
    """`python -m experiments.cross_model`'s options (conf/cross_model.yaml)."""
    models: list[str] = option(["smollm2", "gemma3-270m"], "the models compared")
    datapacks: list[str] = option(list(TRILEMMA), "the datapacks of each model")
    split: SplitChoice = field(default_factory=SplitChoice)
    split_seed: int = option(0, _SPLIT_SEED)
    n_boot: int = option(5000, "resamples of every bootstrap interval and p (Holm over a family of m needs > 40 m)")
    results_dir: str = option("results", "the result cells read")
    reports_dir: str = option("reports", "writes <reports_dir>/cross_model/ (whole or not at all)")
    page_dir: Optional[str] = option(None, "also the results page there (claims.md with its provenance line, "
                                     "claims.csv, the depth figures), e.g. page_dir=docs/results/claims")


@dataclass
class StudyOptions:
    """The options every study (experiments.ncb_study, experiments.claims_study) has: what it runs over, its
    sweeps' split and workers, the stores it extracts."""
    models: list[str] = option(["smollm2", "gemma3-270m"], "the models (conf/model/ names)")
    datapacks: list[str] = option(list(TRILEMMA), "the datapacks of each model (conf/data/ names)")
    split: SplitChoice = field(default_factory=SplitChoice)
    split_seed: int = option(0, "the split seed of the sweeps")
    workers: int = option(2, "sweep worker processes (one thread each)")
    store_dir: str = option("activations", "the stores: <store_dir>/<model>/<datapack>.h5 (extracted when missing)")
    run: bool = option(True, "run the missing steps (false: only write the page from the outputs already there)")


@dataclass
class NCBStudySchema(StudyOptions):
    """`python -m experiments.ncb_study`'s options (conf/ncb_study.yaml)."""
    probes: list[str] = option(["linear", "mean_diff", "mlp"], "the probes swept and stress-tested, each at its best "
                               "calibration layer")
    task: str = option("true_vs_all", "the probes' task (evaluation/tasks.py names)")
    fraction: float = option(0.2, "the page's high / low group fraction (one of ncb's fractions; ncb.csv has all)")
    n_boot: int = option(1000, "bootstrap resamples of the sweeps' and the NCB intervals")
    results_dir: str = option("results", "cells and NCB outputs: <results_dir>/<model>/<datapack>/...")
    out_dir: str = option("docs/results/ncb", "the page: <out_dir>/index.md and ncb.csv (whole or not at all)")


@dataclass
class ClaimsStudySchema(StudyOptions):
    """`python -m experiments.claims_study`'s options (conf/claims_study.yaml)."""
    probes: list[str] = option(["samil", "linear", "mlp", "mean_diff", "random_direction"],
                               "the probes and probe-like controls swept at every stored layer")
    best_layer_probes: list[str] = option(["ttpd", "spca", "ccs", "samil_reference"], "probes fitted only at the "
                                          "layers where one of `best_layer_of` peaks on a task, in this order ([]: "
                                          "none)", empty_ok=True)
    best_layer_of: list[str] = option(["samil", "linear", "mlp", "mean_diff"], "the swept probes whose best "
                                      "calibration layers the `best_layer_probes` are fitted at (those of `probes`)")
    tasks: list[str] = option(["true_vs_all", "false_vs_all", "neither_vs_all", "multiclass", "true_vs_false"],
                              "the tasks of every sweep job (heads shared within a layer)")
    null_probes: list[str] = option(["samil", "linear", "mlp", "mean_diff"], "the probes refitted on shuffled labels "
                                    "at their best layers (those of `probes` only; []: none)", empty_ok=True)
    controls: list[str] = option(["text", "surprisal"], "the controls fitted by probe=linear beside the sweep "
                                 "(probes/controls.py: text, the statement's TF-IDF; surprisal, the model's NLL; []: none)",
                                 empty_ok=True)
    limit: Optional[int] = option(None, "extract N statements of each datapack (label-stratified, whole subjects) for a "
                                  "quick look; null: all")
    permutations: int = option(3, "shuffled-label refits of each probe at its best layer per task (0: none)")
    n_boot: int = option(1000, "bootstrap resamples of the cells' intervals")
    page_n_boot: int = option(5000, "bootstrap resamples of the page's paired differences and p (Holm over a family "
                              "of m needs > 40 m)")
    results_dir: str = option("results", "the cells: <results_dir>/<model>/<datapack>/...")
    reports_dir: str = option("reports", "also <reports_dir>/cross_model/")
    out_dir: str = option("docs/results/claims", "the page: <out_dir>/claims.md, claims.csv and the figures")


@dataclass
class InterventionsSchema:
    """`python -m experiments.interventions`'s options (conf/interventions.yaml)."""
    models: list[str] = option(["smollm2", "gemma3-270m"], "the models (conf/model/ names)")
    datapacks: list[str] = option(list(TRILEMMA), "the datapacks of each model (conf/data/ names)")
    probes: list[str] = option(["linear", "mean_diff", "samil"], "the probes steered, each at its best calibration "
                               "layer per task")
    tasks: list[str] = option(["true_vs_false", "true_vs_all"], "binary tasks whose best-layer cells are steered")
    split: SplitChoice = field(default_factory=SplitChoice)
    split_seed: int = option(0, _SPLIT_SEED)
    n_statements: int = option(100, "test statements (and contrast pairs) steered per cell")
    n_random: int = option(10, "random directions of the same push norm per cell")
    alphas: list[float] = option([-8.0, -4.0, 0.0, 4.0, 8.0], "push sizes in sd of the probe's projection (0 required)")
    at: str = option("statement", "steered positions: statement | last")
    n_boot: int = option(1000, "bootstrap resamples of the intervals")
    run: bool = option(True, "false: only the page, from the intervention files already there")
    store_dir: str = option("activations", "the stores <store_dir>/<model>/<datapack>.h5 the probes were fitted on")
    results_dir: str = option("results", "cells and intervention files: <results_dir>/<model>/<datapack>/...")
    out_dir: str = option("docs/results/interventions", "the page: <out_dir>/index.md, interventions.csv and the "
                          "dose-response figures (whole or not at all)")
