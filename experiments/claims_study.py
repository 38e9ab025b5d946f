"""`python -m experiments.claims_study`: the paper's claims with their controls, as one resumable command, and
the results page docs/results/claims/ they make.

Each step runs one of the toolkit's entry points in a child process (experiments.steps) and is skipped where its
outputs exist, so a killed study resumes by rerunning the command (each job writes its own cells; finished ones are
kept and reused bit for bit; a killed study's children end with it). Steps 1-2 run for every (model, datapack) in
turn; then the jobs of steps 3-5 of every (model, datapack), which read only the sweeps' cells, run on `workers`
processes at once (one thread each), the costliest first:

1. store    `python -m extract model=<m> data=<d>` (every layer; `limit=N`: a stratified subset, for a quick look)
            unless the store is complete;
2. sweep    `python -m experiments.sweep probes=<probes> tasks=<tasks>` over every stored layer: the probes and
            the random-direction control (probes.random_direction), C grids that bracket their optimum;
3. controls `python -m train_probe probe=linear features=<text|surprisal>` (probes.controls: the statement's
            TF-IDF, no model; the model's surprisal of the statement), every task;
4. nulls    `python -m train_probe probe=<p> shuffle_labels=true layer=<best> seed=<s>` for s = 0..<permutations - 1>:
            each of `null_probes` refitted on permuted training labels at its best calibration layer of each task
            (experiments.tables.best_layers), one process per (probe, layer, seed);
5. at best  `python -m train_probe probe=<p> layer=<l>` for each of `best_layer_probes` (the reference's
            baselines ttpd, spca, ccs, then samil_reference: ~2 worker-minutes per task and layer, a day at every
            layer of the six stores) at the layers where the probes of `best_layer_of` peak on a task (their best
            calibration layers; only the tasks each can fit): where claim (c) and the baselines' table compare them;

then the page, `experiments.cross_model` on those cells with page_dir=<out_dir> (claims.md, claims.csv, the depth
figures; whole or not at all): rerunning the command on the same cells rewrites it byte for byte but for its
provenance line.
"""
from __future__ import annotations

from toolkit.config import answer_help
from experiments.schema import ClaimsStudySchema

answer_help(__name__, "claims_study", ClaimsStudySchema)   # before the imports below: --help is quick

import logging
from pathlib import Path

import pandas as pd
from omegaconf import DictConfig, OmegaConf

from evaluation.tasks import TASKS
from experiments.cross_model import write_cross_model
from experiments.steps import run_step, run_steps, store_complete
from experiments.tables import best_layers, layer_table, load_cells
from toolkit.config import CONF_DIR
from toolkit.entry import entry_main
from toolkit.errors import ToolkitError, check_count, check_writable
from toolkit.schema import typed_options
from extract.store import store_path
from probes.artifacts import build_probe

log = logging.getLogger(__name__)
# steps 3-5's jobs by cost, the costliest started first (unlisted: cheap): a SmolLM2 city_locations layer's job
# of samil_reference ~2 minutes a task, samil ~2 minutes for five tasks, mlp ~0.5, the surprisal control a forward
# pass of every statement
JOB_COST = {"samil_reference": 4, "samil": 3, "mlp": 2, "surprisal": 2}


def study_steps(o: dict) -> None:
    """Steps 1-5 of the module docstring: the store and sweep of every (model, datapack) in turn (what every
    claim needs; the sweep runs its jobs on `workers` processes), then the jobs of steps 3-5 of every (model,
    datapack), which depend only on the sweeps' cells, on `workers` processes at once, the costliest first."""
    pairs = [(m, d) for m in o["models"] for d in o["datapacks"]]
    cells = [f"results_dir={o['results_dir']}", f"n_boot={o['n_boot']}", f"split={o['split']['kind']}",
             f"split_seed={o['split_seed']}"]
    tasks = f"tasks=[{','.join(o['tasks'])}]"

    def common(model, datapack):
        return [f"model={model}", f"data={datapack}", f"store_dir={o['store_dir']}"]

    for model, datapack in pairs:
        if not store_complete(store_path(o["store_dir"], model, datapack)):
            run_step("extract", *common(model, datapack), *([] if o["limit"] is None else [f"limit={o['limit']}"]))
        run_step("experiments.sweep", *common(model, datapack), *cells, tasks, f"probes=[{','.join(o['probes'])}]",
                 f"workers={o['workers']}")
    jobs = []   # (cost rank, command)
    for model, datapack in pairs:
        for kind in o["controls"]:
            jobs.append((JOB_COST.get(kind, 0), ("train_probe", *common(model, datapack), *cells, tasks,
                                                 "probe=linear", f"features={kind}")))
        for probe, layer, todo in null_jobs(o, model, datapack):
            for seed in range(o["permutations"]):
                jobs.append((JOB_COST.get(probe, 0), ("train_probe", *common(model, datapack), *cells,
                                                      f"tasks=[{','.join(todo)}]", f"probe={probe}", f"layer={layer}",
                                                      "shuffle_labels=true", f"seed={seed}")))
        for probe, layer, todo in best_layer_jobs(o, model, datapack):
            jobs.append((JOB_COST.get(probe, 0), ("train_probe", *common(model, datapack), *cells,
                                                  f"tasks=[{','.join(todo)}]", f"probe={probe}", f"layer={layer}")))
    run_steps([command for _, command in sorted(jobs, key=lambda job: -job[0])], o["workers"])


def swept_best(o: dict, model: str, datapack: str, probes: list[str]) -> tuple[pd.DataFrame, set]:
    """(the best calibration layer of each of `probes` per task (experiments.tables.best_layers, layered cells
    of the study's split), the (method, task, layer, seed) of every cell there)."""
    cells = load_cells(o["results_dir"], model, datapack)
    cells = cells[cells["split"] == o["split"]["kind"]]
    best = best_layers(layer_table(cells[cells["probe"].isin(probes) & cells["layer"].notna()]))
    return best, set(zip(cells["probe"], cells["task"], cells["layer"], cells["seed"]))


def jobs_of(wanted: dict[tuple[str, int], set[str]], order: list[str] | None = None) -> list[tuple[str, int, list[str]]]:
    """{(probe, layer): tasks} -> [(probe, layer, sorted tasks)], by the probes' place in `order` (else by name),
    then layer."""
    rank = {p: i for i, p in enumerate(order or [])}
    return [(probe, layer, sorted(tasks)) for (probe, layer), tasks in
            sorted(wanted.items(), key=lambda kv: (rank.get(kv[0][0], len(rank)), kv[0][0], kv[0][1])) if tasks]


def probe_tasks(probe: str) -> tuple[str, ...] | None:
    """The tasks conf/probe/<probe>.yaml's probe class can fit (Probe.supported_tasks; None: every task); its
    `_target_` is the file's own or that of the first file in its `defaults` (read here: a study runs inside Hydra,
    which cannot compose a second config)."""
    spec = OmegaConf.load(CONF_DIR / "probe" / f"{probe}.yaml")
    while "_target_" not in spec and spec.get("defaults"):
        spec = OmegaConf.load(CONF_DIR / "probe" / f"{next(d for d in spec.defaults if d != '_self_')}.yaml")
    return build_probe({"_target_": spec.get("_target_", "")}).supported_tasks


def best_layer_jobs(o: dict, model: str, datapack: str) -> list[tuple[str, int, list[str]]]:
    """The `best_layer_probes` jobs: (probe, layer, tasks) for each layer where one of `best_layer_of` peaks
    on a task (one the probe can fit: Probe.supported_tasks), where that probe's cell (seed 0) is not there yet;
    in the order of `best_layer_probes`."""
    best, done = swept_best(o, model, datapack, [p for p in o["best_layer_of"] if p in o["probes"]])
    wanted: dict[tuple[str, int], set[str]] = {}
    for probe in o["best_layer_probes"]:
        tasks = probe_tasks(probe)
        for r in best.itertuples():
            if r.task in o["tasks"] and (tasks is None or r.task in tasks) and (probe, r.task, r.layer, 0) not in done:
                wanted.setdefault((probe, int(r.layer)), set()).add(r.task)
    return jobs_of(wanted, o["best_layer_probes"])


def null_jobs(o: dict, model: str, datapack: str) -> list[tuple[str, int, list[str]]]:
    """Step 4's jobs: (probe, its best calibration layer, the tasks best there) for each of `null_probes` swept
    whose shuffled-label cells at that layer are not all there yet."""
    best, done = swept_best(o, model, datapack, [p for p in o["null_probes"] if p in o["probes"]])
    wanted: dict[tuple[str, int], set[str]] = {}
    for r in best.itertuples():
        if r.task in o["tasks"] and any((f"{r.probe}+shuffled", r.task, r.layer, s) not in done
                                        for s in range(o["permutations"])):
            wanted.setdefault((r.probe, int(r.layer)), set()).add(r.task)
    return jobs_of(wanted)


def claims_study(cfg: DictConfig) -> Path:
    o = typed_options(cfg, ClaimsStudySchema, {"models": "a list, e.g. [smollm2]", "probes": "a list, e.g. [linear]",
                                               "tasks": "a list, e.g. [multiclass]", "run": "true or false",
                                               "workers": "a whole number >= 1", "n_boot": "a whole number >= 1",
                                               "controls": "a list, e.g. [text,surprisal]",
                                               "null_probes": "a list, e.g. [linear]",
                                               "best_layer_probes": "a list, e.g. [samil_reference]",
                                               "best_layer_of": "a list, e.g. [samil,linear]",
                                               "permutations": "a whole number >= 0",
                                               "page_n_boot": "a whole number >= 1"})
    for key in ("workers", "n_boot", "page_n_boot"):
        check_count(o[key], key)
    if o["permutations"] < 0:
        raise ToolkitError(f"permutations={o['permutations']}: give a whole number >= 0 (0: no shuffled-label nulls)")
    if any(c not in ("text", "surprisal") for c in o["controls"]):
        raise ToolkitError(f"controls={o['controls']}: give any of [text, surprisal] (or [] for none)")
    for key, group in (("models", "model"), ("datapacks", "data"), ("probes", "probe"), ("null_probes", "probe"),
                       ("best_layer_probes", "probe"), ("best_layer_of", "probe")):
        known = sorted(f.stem for f in (CONF_DIR / group).glob("*.yaml"))
        if (not o[key] and key != "best_layer_probes") or any(name not in known for name in o[key]):
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
