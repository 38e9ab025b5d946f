"""`python -m experiments.claims_study`: the paper's claims with their controls, as one resumable command, and
the results page docs/results/claims/ they make.

For every (model, datapack), each step runs one of the toolkit's entry points in a child process
(experiments.steps) and is skipped where its outputs exist, so a killed study resumes by rerunning the command
(each job writes its own cells; finished ones are kept and reused bit for bit):

1. store    `python -m extract model=<m> data=<d>` (every layer) unless the store is complete;
2. sweep    `python -m experiments.sweep probes=<probes> tasks=<tasks>` over every stored layer: the probes and
            the random-direction control (probes.random_direction), C grids that bracket their optimum;

then the page, `experiments.cross_model` on those cells with page_dir=<out_dir> (claims.md, claims.csv, the depth
figures; whole or not at all): rerunning the command on the same cells rewrites it byte for byte but for its
provenance line.
"""
from __future__ import annotations

from extract.config import answer_help
from experiments.schema import ClaimsStudySchema

answer_help(__name__, "claims_study", ClaimsStudySchema)   # before the imports below: --help is quick

import logging
from pathlib import Path

from omegaconf import DictConfig

from evaluation.tasks import TASKS
from experiments.cross_model import write_cross_model
from experiments.steps import run_step, store_complete
from extract.config import CONF_DIR
from extract.entry import entry_main
from extract.errors import ToolkitError, check_count
from extract.schema import check_writable, typed_options
from extract.store import store_path

log = logging.getLogger(__name__)


def study_steps(o: dict) -> None:
    """Steps 1-2 of the module docstring for every (model, datapack), each in its own process."""
    for model in o["models"]:
        for datapack in o["datapacks"]:
            common = [f"model={model}", f"data={datapack}", f"store_dir={o['store_dir']}"]
            if not store_complete(store_path(o["store_dir"], model, datapack)):
                run_step("extract", *common)                 # a stopped store resumes
            run_step("experiments.sweep", *common, f"results_dir={o['results_dir']}",
                     f"tasks=[{','.join(o['tasks'])}]", f"probes=[{','.join(o['probes'])}]",
                     f"workers={o['workers']}", f"n_boot={o['n_boot']}", f"split={o['split']['kind']}",
                     f"split_seed={o['split_seed']}")


def claims_study(cfg: DictConfig) -> Path:
    o = typed_options(cfg, ClaimsStudySchema, {"models": "a list, e.g. [smollm2]", "probes": "a list, e.g. [linear]",
                                               "tasks": "a list, e.g. [multiclass]", "run": "true or false",
                                               "workers": "a whole number >= 1", "n_boot": "a whole number >= 1",
                                               "page_n_boot": "a whole number >= 1"})
    for key in ("workers", "n_boot", "page_n_boot"):
        check_count(o[key], key)
    for key, group in (("models", "model"), ("datapacks", "data"), ("probes", "probe")):
        known = sorted(f.stem for f in (CONF_DIR / group).glob("*.yaml"))
        if not o[key] or any(name not in known for name in o[key]):
            raise ToolkitError(f"{key}={o[key]}: give one or more of {known}")
    if not o["tasks"] or any(t not in TASKS for t in o["tasks"]):
        raise ToolkitError(f"tasks={o['tasks']}: give one or more of {', '.join(TASKS)}")
    check_writable(o["out_dir"], "out_dir")
    check_writable(o["reports_dir"], "reports_dir")
    if o["run"]:
        study_steps(o)
    return write_cross_model(Path(o["results_dir"]), Path(o["reports_dir"]), o["models"], o["datapacks"],
                             o["split"]["kind"], o["page_n_boot"], Path(o["out_dir"]))


main = entry_main("claims_study", ClaimsStudySchema, claims_study)


if __name__ == "__main__":
    main()
