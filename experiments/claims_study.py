"""`python -m experiments.claims_study`: the paper's claims with their controls, as one resumable command, and
the results page docs/results/claims/ they make.

For every (model, datapack), each step runs one of the toolkit's entry points in a child process
(experiments.steps) and is skipped where its outputs exist, so a killed study resumes by rerunning the command
(each job writes its own cells; finished ones are kept and reused bit for bit):

1. store    `python -m extract model=<m> data=<d>` (every layer; `limit=N`: a stratified subset, for a quick look)
            unless the store is complete;
2. sweep    `python -m experiments.sweep probes=<probes> tasks=<tasks>` over every stored layer: the probes and
            the random-direction control (probes.random_direction), C grids that bracket their optimum;
3. controls `python -m train_probe probe=linear features=<text|surprisal>` (probes.controls: the statement's
            TF-IDF, no model; the model's surprisal of the statement), every task;
4. nulls    `python -m train_probe -m probe=<p> shuffle_labels=true layer=<best> seed=0,..,<permutations - 1>`: each
            of `null_probes` refitted on permuted training labels at its best calibration layer of each task
            (experiments.tables.best_layers), one process per (probe, layer);

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
from experiments.tables import best_layers, layer_table, load_cells
from extract.config import CONF_DIR
from extract.entry import entry_main
from extract.errors import ToolkitError, check_count
from extract.schema import check_writable, typed_options
from extract.store import store_path

log = logging.getLogger(__name__)


def study_steps(o: dict) -> None:
    """Steps 1-4 of the module docstring for every (model, datapack), each in its own process."""
    for model in o["models"]:
        for datapack in o["datapacks"]:
            common = [f"model={model}", f"data={datapack}", f"store_dir={o['store_dir']}"]
            if not store_complete(store_path(o["store_dir"], model, datapack)):
                run_step("extract", *common, *([] if o["limit"] is None else [f"limit={o['limit']}"]))  # resumes
            cells = [f"results_dir={o['results_dir']}", f"n_boot={o['n_boot']}", f"split={o['split']['kind']}",
                     f"split_seed={o['split_seed']}"]
            tasks = f"tasks=[{','.join(o['tasks'])}]"
            run_step("experiments.sweep", *common, *cells, tasks, f"probes=[{','.join(o['probes'])}]",
                     f"workers={o['workers']}")
            for kind in o["controls"]:
                run_step("train_probe", *common, *cells, tasks, "probe=linear", f"features={kind}")
            for probe, layer, todo in null_jobs(o, model, datapack):
                run_step("train_probe", "-m", *common, *cells, f"tasks=[{','.join(todo)}]", f"probe={probe}",
                         f"layer=[{layer}]", "shuffle_labels=true",
                         f"seed={','.join(str(s) for s in range(o['permutations']))}")


def null_jobs(o: dict, model: str, datapack: str) -> list[tuple[str, int, list[str]]]:
    """Step 4's jobs: (probe, its best calibration layer, the tasks best there) for each of `null_probes` swept
    whose shuffled-label cells at that layer are not all there yet."""
    cells = load_cells(o["results_dir"], model, datapack)
    cells = cells[cells["split"] == o["split"]["kind"]]
    probes = [p for p in o["null_probes"] if p in o["probes"]]
    best = best_layers(layer_table(cells[cells["probe"].isin(probes) & cells["layer"].notna()]))
    done = set(zip(cells["probe"], cells["task"], cells["layer"], cells["seed"]))
    jobs: dict[tuple[str, int], list[str]] = {}
    for r in best.itertuples():
        if r.task in o["tasks"] and any((f"{r.probe}+shuffled", r.task, r.layer, s) not in done
                                        for s in range(o["permutations"])):
            jobs.setdefault((r.probe, int(r.layer)), []).append(r.task)
    return [(probe, layer, tasks) for (probe, layer), tasks in sorted(jobs.items())]


def claims_study(cfg: DictConfig) -> Path:
    o = typed_options(cfg, ClaimsStudySchema, {"models": "a list, e.g. [smollm2]", "probes": "a list, e.g. [linear]",
                                               "tasks": "a list, e.g. [multiclass]", "run": "true or false",
                                               "workers": "a whole number >= 1", "n_boot": "a whole number >= 1",
                                               "controls": "a list, e.g. [text,surprisal]",
                                               "null_probes": "a list, e.g. [linear]",
                                               "permutations": "a whole number >= 0",
                                               "page_n_boot": "a whole number >= 1"})
    for key in ("workers", "n_boot", "page_n_boot"):
        check_count(o[key], key)
    if o["permutations"] < 0:
        raise ToolkitError(f"permutations={o['permutations']}: give a whole number >= 0 (0: no shuffled-label nulls)")
    if any(c not in ("text", "surprisal") for c in o["controls"]):
        raise ToolkitError(f"controls={o['controls']}: give any of [text, surprisal] (or [] for none)")
    for key, group in (("models", "model"), ("datapacks", "data"), ("probes", "probe"), ("null_probes", "probe")):
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
