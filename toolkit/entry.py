"""The command line: every entry point's `main` has one shape, and `truthprobe <command> ...` runs any
of them (the `python -m` forms stay).

An entry point's main answers `--help` from its schema without importing torch (toolkit.config.
answer_help), composes its config under toolkit.errors.hydra_main (Hydra's errors as one line), calls
its run function through run_entry (a ToolkitError is one line, exit 1) and logs one summary line.
The modules below are named, not imported: `truthprobe --help` loads none of them.
"""
from __future__ import annotations

import importlib
import logging
import os
import re
import runpy
import sys
from typing import Callable

COMMANDS = {   # truthprobe <command> -> the module `python -m` runs, and what it does
    "extract": ("extract", "hidden states of every layer -> an activation store"),
    "train-probe": ("train_probe", "fit probes on a store's layers -> result cells and saved probes"),
    "apply-probe": ("apply_probe", "a saved probe on another datapack (transfer cell) or on your text"),
    "zero-shot": ("zero_shot", "the paper's prompting baseline -> result cells"),
    "truthfulqa": ("truthfulqa", "TruthfulQA: likelihood MC1 / MC2 (the harness's), verification, generation judged"),
    "ncb": ("ncb", "belief robustness: neighbourhood consistency and stress contexts"),
    "intervene": ("intervene", "push along a probe's direction: does the model's answer move beyond random ones?"),
    "report": ("experiments.report", "per-layer tables and figures from result cells"),
    "transfer": ("experiments.transfer", "transfer matrix of the best probes across datapacks"),
    "cross-model": ("experiments.cross_model", "the paper's claims across models"),
    "claims-study": ("experiments.claims_study", "the paper's claims with their controls -> docs/results/claims/"),
    "interventions": ("experiments.interventions", "python -m intervene on every best-layer probe -> "
                      "docs/results/interventions/"),
    "ncb-study": ("experiments.ncb_study", "NCB stress tests across models and datapacks -> docs/results/ncb/"),
    "compare": ("experiments.compare", "paired comparison of two result cells"),
    "sweep": ("experiments.sweep", "every (probe, layer) job of a model on a pool of workers"),
}

SCHEMAS = {   # conf/<name>.yaml -> the schema its entry point checks before any work (and --help and the manual list)
    "extract": "toolkit.schema:ExtractSchema", "train_probe": "probes.schema:TrainProbeSchema",
    "apply_probe": "probes.schema:ApplyProbeSchema", "zero_shot": "zero_shot.schema:ZeroShotSchema",
    "truthfulqa": "truthfulqa.schema:TruthfulQASchema", "ncb": "ncb.schema:NCBSchema",
    "report": "experiments.schema:ReportSchema", "transfer": "experiments.schema:TransferSchema",
    "cross_model": "experiments.schema:CrossModelSchema", "ncb_study": "experiments.schema:NCBStudySchema",
    "claims_study": "experiments.schema:ClaimsStudySchema", "intervene": "intervene.schema:InterveneSchema",
    "interventions": "experiments.schema:InterventionsSchema",
}


def schema_of(config_name: str) -> type:
    """The schema dataclass of the entry point of conf/<config_name>.yaml (SCHEMAS)."""
    module, name = SCHEMAS[config_name].split(":")
    return getattr(importlib.import_module(module), name)


def entry_main(config_name: str, schema: type, run: str | Callable, summary: Callable | None = None,
               quote: tuple[str, ...] = (), renames: dict[str, str] | None = None) -> Callable:
    """The main() of the entry point of conf/<config_name>.yaml: `run` (a function, or "module:function",
    imported only when a config is run, so `--help` needs no torch); `summary(result, cfg)` gives its
    last log line (None: none); the command line's values of `quote` are taken as written (quoted(),
    with `renames`). main(cfg) runs a composed config directly (tests, notebooks)."""
    from toolkit.config import answer_help
    from toolkit.errors import RefusedRunLeavesNothing, hydra_main, run_entry

    log = logging.getLogger(config_name)

    def job(cfg):
        if "threads" in cfg:
            set_threads(cfg.threads, log)
            reuse_freed_memory()
        if isinstance(run, str):
            module, function = run.split(":")
            return getattr(importlib.import_module(module), function)(cfg)
        return run(cfg)

    def task(cfg):
        result = run_entry(job, cfg, log=log)
        if result is not None and summary is not None:
            log.info("%s", summary(result, cfg))
        if cfg.get("dry_run"):          # a dry run leaves no file: its log folder goes too
            RefusedRunLeavesNothing.remove()
        return result

    task.__module__ = "__main__"   # Hydra then finds conf/ beside this file's folder, as for `python -m`
    hydra_task = hydra_main(config_path="../conf", config_name=config_name)(task)

    def main(cfg=None):
        if cfg is None:
            answer_help("__main__", config_name, schema)
            sys.argv[1:] = quoted(sys.argv[1:], quote, renames)
        return hydra_task(cfg)
    return main


_CORES: dict[str, int] = {}   # torch's own default thread count (its physical cores), read before the first change


def set_threads(value, log: logging.Logger | None = None) -> int:
    """Set torch's CPU threads for this run from the `threads` option and log the choice: a number, or
    "auto": SLURM_CPUS_PER_TASK (a SLURM job's share), else OMP_NUM_THREADS (set by whoever runs several
    jobs at once, e.g. experiments.sweep), else every core this process may use (a single job). Several
    jobs sharing the cores each at every core oversubscribe them: one linear cell took 35 s at 2 threads
    on a loaded 2-core machine and 4.4 s at 1."""
    from toolkit.errors import ToolkitError

    if str(value) == "auto":
        import torch

        source = next((k for k in ("SLURM_CPUS_PER_TASK", "OMP_NUM_THREADS") if os.environ.get(k, "").isdigit()
                       and int(os.environ[k]) >= 1), None)
        n, why = ((int(os.environ[source]), source) if source else
                  (_CORES.setdefault("torch", torch.get_num_threads()), "every core of this process"))
    elif isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        n, why = value, f"threads={value}"
    else:
        raise ToolkitError(f"threads={value!r}: use auto or a whole number >= 1, e.g. threads=1 for one job of "
                           "several running at once")
    import torch

    torch.set_num_threads(n)
    if log is not None:
        log.info("torch CPU threads: %d (%s; threads=N sets it)", n, why)
    return n


def reuse_freed_memory() -> bool:
    """Keep the memory this process frees for its next allocations (glibc: no mmap for large blocks, no
    trimming of the heap's top); True where it took effect, False off glibc. PyTorch's CPU tensors come
    from malloc, and glibc serves a block over 32 MB by mmap and unmaps it when freed, so each large
    temporary (a float64 copy of a layer's rows) is fresh pages the kernel zeroes: a SmolLM2 samil layer
    job (five tasks, C by CV, one thread) spent 23.5 s of its 120 s in the kernel, with this 9.4 s of 102 s,
    its cells unchanged. The process keeps its peak memory until it exits (1.73 -> 1.97 GB there)."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_max = -1, -4       # glibc's malloc.h
    return bool(mallopt(m_mmap_max, 0)) and bool(mallopt(m_trim_threshold, 2**31 - 1))


def quoted(args: list[str], keys: tuple[str, ...], renames: dict[str, str] | None = None) -> list[str]:
    """Command-line arguments as Hydra overrides, the values of `keys` taken as written: quoted unless
    already a list or quoted (paths of cells hold `=`; a statement may hold `=`, `,` or quotes). `renames`
    maps what a user types to the option (apply_probe: probe= -> cell=). Every value is data: `${` in it is
    escaped (`\\${`, read back as the two characters), so no option resolves an interpolation or an
    environment variable (`model.system_prompt='${oc.env:SECRET}'` would store the secret); Hydra's own
    `hydra.*` options keep theirs."""
    out = []
    for arg in args:
        key, eq, value = arg.partition("=")
        key = (renames or {}).get(key, key)
        if eq and not key.lstrip("+~").startswith("hydra."):
            value = re.sub(r"(?<!\\)\$\{", r"\\${", value)
        if eq and key in keys and not value.startswith(("[", "'", '"')):
            value = "'" + re.sub(r"(\\*)('|$)", lambda m: m.group(1) * 2 + ("\\'" if m.group(2) else ""), value) + "'"
        out.append(f"{key}{eq}{value}")
    return out


def truthprobe(argv: list[str] | None = None) -> None:
    """The console script: `truthprobe <command> [options]` == `python -m <module> [options]`."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        width = max(map(len, COMMANDS))
        print("usage: truthprobe <command> [option=value ...]   (truthprobe <command> --help for its options)\n\n"
              "commands:\n" + "\n".join(f"  {name:<{width}}  {about}" for name, (_, about) in COMMANDS.items()))
        sys.exit(0 if argv else 2)
    if argv[0] not in COMMANDS:
        from difflib import get_close_matches

        close = get_close_matches(argv[0], COMMANDS, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        print(f"truthprobe: no command {argv[0]!r}; {hint}(commands: {', '.join(COMMANDS)})", file=sys.stderr)
        sys.exit(2)
    module = COMMANDS[argv[0]][0]
    sys.argv = [module, *argv[1:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
