"""`python -m experiments.sweep [train_probe options] probes=[samil,linear,mlp,mean_diff] workers=2`: every
stored layer of one store x the given probes, one `train_probe` job per (probe, layer), run by `workers`
worker processes that take jobs from one shared queue, longest first.

The rule is the longest-processing-time one: jobs are queued in decreasing estimated cost (the probe's
measured seconds per layer, `COST`; all layers of a probe cost about the same) and each worker takes the
next job when it is free, so the long jobs start first and the short ones fill the gaps at the end. No
layer lists are written by hand: the layers are the store's (or `layer=[...]`), so another model needs no
edit. `<probe>.<key>=<value>` applies to that probe's jobs only: `samil.layer=[18]` (its layers),
`samil.C=100` (= `probe.C=100` for samil alone). Every other option is a `python -m train_probe` option
(`model=`, `data=`, `tasks=[...]`, `store_dir=`, ...). All jobs' options are checked before any job starts. A job's cells are written as train_probe writes
them (existing ones skipped), so a killed sweep resumes by rerunning the command; its workers end within a second of its death. A worker
killed in a job (a signal, the out-of-memory killer) fails that job in one FAILED line, new workers take the
jobs left, and the sweep exits 1 listing it. Each worker runs at
`threads` torch threads (default 1: `workers` x `threads` should not exceed the cores).

On a machine with one GPU, several workers' GPU jobs queue on it: on an H200 with 16 cores, 16 workers with
`trainer.accelerator=auto` ran SmolLM2 samil layer jobs at ~39 s each (one job alone: 45 s on the GPU; make
run's median job on one CPU thread: 88 s), where 16 one-thread CPU workers (`trainer.accelerator=cpu`, what
`make run` passes) give 88 / 16 = 5.5 s a job (arithmetic, not measured there).
"""
from __future__ import annotations

import heapq
import logging
import os
import sys
import signal
import tempfile
import threading
import time
from pathlib import Path
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from multiprocessing import get_context

from hydra.errors import HydraException

from toolkit.config import CONF_DIR, compose_config
from toolkit.entry import reuse_freed_memory
from toolkit.errors import ToolkitError, check_count
from extract.store import ActivationStore, select_layers, store_path
from probes.base import resolve_device
from probes.pipeline import make_probe, method_name, train_probes
from probes.schema import validate

log = logging.getLogger("sweep")
# seconds per layer and probe, five tasks in one job, C by CV, SmolLM2 city_locations at one thread (the
# median jobs of docs/results/make_run.md): only their order matters for the schedule
COST = {"samil": 88.0, "samil_reference": 30.0, "mlp": 28.0, "linear": 5.0, "mean_diff": 1.0, "random_direction": 0.5,
        "ttpd": 2.0, "spca": 20.0, "ccs": 4.0}
OWN = ("probes", "workers", "threads")


def plan(overrides: list[str], probes: list[str]) -> list[tuple[str, int, list[str]]]:
    """(probe, layer, the job's train_probe overrides) of every job, longest first: every layer of the
    store (or of `layer=` / `<probe>.layer=`) for each probe; `<probe>.<key>=v` becomes `probe.<key>=v`
    in that probe's jobs."""
    known = sorted(f.stem for f in (CONF_DIR / "probe").glob("*.yaml"))
    if not probes or any(p not in known for p in probes):
        raise ToolkitError(f"probes={probes}: give one or more of {known}, e.g. probes=[linear,mlp]")
    if len(set(probes)) < len(probes):
        raise ToolkitError(f"probes={probes}: a probe is listed more than once (its jobs would run twice): list each once")
    own = {p: [o for o in overrides if o.split(".", 1)[0] == p] for p in known}
    common = [o for o in overrides if o.split(".", 1)[0] not in known]
    cfg = _compose(common)
    store = ActivationStore(store_path(cfg.store_dir, cfg.model.name, cfg.data.name))
    jobs = []
    for probe in probes:
        layer_spec = next((o.split("=", 1)[1] for o in own[probe] if o.startswith(f"{probe}.layer=")),
                          cfg.layer if any(o.split("=", 1)[0] == "layer" for o in common) else "all")
        extra = [f"probe.{o.split('.', 1)[1]}" for o in own[probe] if not o.startswith(f"{probe}.layer=")]
        job_cfg = _compose([*common, f"probe={probe}", *extra, f"layer={layer_spec}"])
        given = f"{probe}.layer" if any(o.startswith(f"{probe}.layer=") for o in own[probe]) else "layer"
        layers = select_layers(job_cfg.layer, store.n_layers, store.layers, option=given)
        job = validate(_compose([*common, f"probe={probe}", *extra, f"layer={layers[0]}"]))
        make_probe(job)   # every job's options checked now, not when the job starts
        method_name(job)
        jobs += [(probe, k, [*common, f"probe={probe}", *extra, f"layer={k}"]) for k in layers]
    return longest_first(jobs)


def longest_first(jobs: list[tuple]) -> list[tuple]:
    """Jobs ``(probe, layer, ...)`` in the order the workers take them: decreasing `COST` of their probe
    (an unknown probe counts as the costliest), otherwise as given (stable)."""
    return sorted(jobs, key=lambda j: -COST.get(j[0], max(COST.values())))


def replay(seconds: list[float], workers: int) -> float:
    """Wall seconds of jobs taking ``seconds`` (in queue order) on ``workers`` workers that each take the
    next job when free: the sweep's schedule with its job times given (e.g. measured ones)."""
    free = [0.0] * workers
    for s in seconds:
        heapq.heappush(free, heapq.heappop(free) + s)
    return max(free)


_MARK: list[Path] = []   # in a worker: the mark of the job it runs (see run_job)


def run_job(probe: str, layer: int, overrides: list[str], running: str) -> tuple[str, int, float, str | None]:
    """One train_probe job in a worker: (probe, layer, seconds, error line or None). While it runs, the file
    `<running>/<pid>` names it (`probe layer`), so that the sweep can tell which job a dead worker held."""
    started = time.perf_counter()
    mark = Path(running, str(os.getpid()))
    mark.write_text(f"{probe} {layer}")
    _MARK[:] = [mark]
    try:
        train_probes(compose_config("train_probe", *overrides))
        error = None
    except ToolkitError as err:
        error = " ".join(str(err).split("\n"))
    mark.unlink(missing_ok=True)
    _MARK.clear()
    return probe, layer, time.perf_counter() - started, error


def _on_sigterm(signum, frame) -> None:
    """A worker ended by its pool (which terminates every worker once one has died): not the job's fault,
    so its mark goes and its job is retried."""
    for mark in _MARK:
        mark.unlink(missing_ok=True)
    os._exit(128 + signum)


def died_holding(running: Path) -> set[tuple[str, int]]:
    """The jobs (probe, layer) that workers of this host held when they died (their `run_job` marks
    left behind by a process that is gone)."""
    dead = set()
    for mark in running.iterdir():
        try:
            os.kill(int(mark.name), 0)
        except ProcessLookupError:
            probe, layer = mark.read_text().split()
            dead.add((probe, int(layer)))
        except (PermissionError, ValueError):
            pass
    return dead


def _init_worker(threads: int, parent: int) -> None:
    """A worker's setup: its torch threads, and a watchdog that ends it within a second of its sweep's death
    (a killed sweep leaves no worker writing cells that a rerun would race)."""
    import torch

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="sweep-parent-watchdog").start()
    signal.signal(signal.SIGTERM, _on_sigterm)
    torch.set_num_threads(threads)
    reuse_freed_memory()
    logging.getLogger().setLevel(logging.WARNING)   # the main process reports each job


def sweep(argv: list[str]) -> int:
    """Run the jobs; returns the exit status (1 when a job failed: its line is printed)."""
    own = {k: v for k, _, v in (a.partition("=") for a in argv) if k in OWN}
    overrides = [a for a in argv if a.partition("=")[0] not in OWN]
    probes = [p.strip() for p in own.get("probes", "[linear,mean_diff,mlp,samil]").strip("[]").split(",") if p.strip()]
    workers, threads = (check_count(_int(own.get(k, d), k), k) for k, d in (("workers", "2"), ("threads", "1")))
    jobs = plan(overrides, probes)
    warning = shared_gpu_warning(_compose(jobs[0][2]).trainer.accelerator, workers)
    if warning:
        log.warning("%s", warning)
    log.info("%d jobs (%s) on %d worker(s), longest first", len(jobs),
             ", ".join(f"{p} x {sum(j[0] == p for j in jobs)}" for p in dict.fromkeys(j[0] for j in jobs)), workers)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    started, failed, remaining, n_done = time.perf_counter(), [], list(jobs), 0
    while remaining:   # one round of workers; a worker's death (SIGKILL, out of memory) ends it, then the rest go on
        with tempfile.TemporaryDirectory(prefix="sweep-running-") as running:
            broken, finished = False, 0
            with ProcessPoolExecutor(workers, mp_context=get_context("spawn"), initializer=_init_worker,
                                     initargs=(threads, os.getpid())) as pool:
                futures = {pool.submit(run_job, *job, running): job for job in remaining}
                for future in as_completed(futures):
                    try:
                        probe, layer, seconds, error = future.result()
                    except BrokenProcessPool:
                        broken = True
                        continue
                    n_done, finished = n_done + 1, finished + 1
                    remaining.remove(futures[future])
                    log.info("[%d/%d] %s layer %d: %s in %.1f s (%.1f min elapsed)", n_done, len(jobs), probe, layer,
                             "FAILED" if error else "done", seconds, (time.perf_counter() - started) / 60)
                    if error:
                        failed.append(f"{probe} layer {layer}: {error}")
            killed = died_holding(Path(running)) if broken else set()   # (the pool's workers have all ended)
        if broken:
            lost = [job for job in remaining if (job[0], job[1]) in killed]
            if not lost and not finished:       # no job to blame and none done: workers die as they start
                lost = list(remaining)
            for job in lost:
                n_done += 1
                remaining.remove(job)
                reason = "its worker died (killed by a signal, or out of memory)"
                log.error("[%d/%d] %s layer %d: FAILED: %s", n_done, len(jobs), job[0], job[1], reason)
                failed.append(f"{job[0]} layer {job[1]}: {reason}")
            if remaining:
                log.warning("a worker died: new workers take the %d job(s) left", len(remaining))
    for line in failed:
        log.error("failed job %s", line)
    if failed:
        log.error("%d job(s) failed (listed above); rerun the same command to retry them, finished cells are kept",
                  len(failed))
    return 1 if failed else 0


def shared_gpu_warning(accelerator: str, workers: int) -> str | None:
    """The line to warn with when several workers would fit on the GPU (all on cuda:0, where their jobs
    queue), else None."""
    if workers < 2 or resolve_device(accelerator).type != "cuda":
        return None
    return (f"{workers} workers with trainer.accelerator={accelerator} all fit on cuda:0, where their jobs queue "
            "(16 workers on an H200: a samil layer job every ~39 s); with several cores trainer.accelerator=cpu "
            "is faster (make run's default), or run workers=1 on the GPU")


def _compose(overrides: list[str]):
    try:
        return compose_config("train_probe", *overrides)
    except HydraException as err:
        raise ToolkitError(f"{' '.join(str(err).split())}: correct the train_probe option") from None


def _int(value: str, option: str):
    try:
        return int(value)
    except ValueError:
        raise ToolkitError(f"{option}={value!r} is not a whole number >= 1: give e.g. {option}=2") from None


def main() -> None:
    if sys.argv[1:] in (["--help"], ["-h"]):
        print(__doc__.strip() + "\n\nits own options: probes=[...] workers=N threads=N; the train_probe options: "
              "python -m train_probe --help")
        sys.exit(0)
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    try:
        status = sweep(sys.argv[1:])
    except ToolkitError as err:
        log.error("%s", " ".join(str(err).split("\n")))
        status = 1
    sys.exit(status)


if __name__ == "__main__":
    main()
