"""The toolkit's own error type and the one wrapper every entry point uses to report it.

This is the bottom layer (no project imports), so every package can raise and catch it.

In a Hydra multirun a failing job does not stop the sweep: `run_entry` logs its one line, records
it in the job's output folder (`FAILED`) and lets the next job run; `ReportFailures` (a Hydra
callback named in each entry point's config) lists the failed jobs at the end and exits 1.
Relaunching the sweep reruns only what is missing (existing cells are skipped).

`hydra_main` is `hydra.main` for every entry point: Hydra's own errors (an unknown config group option,
an override it cannot apply, a plugin `_target_` it refuses), raised before the entry point's code
runs, are printed as one line too (a mistyped choice or option with the closest names: "did you
mean ...?"), and Hydra callbacks can only be the ones the toolkit's configs name.
"""
from __future__ import annotations

import difflib
import functools
import logging
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Callable, TypeVar

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import OmegaConf

T = TypeVar("T")
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+=,-]*$")


class ToolkitError(ValueError):
    """Bad input or settings the user can fix; the message is one line naming the bad thing and the fix."""


def check_name(value, option: str) -> str:
    """`value` as a single path component (it becomes a folder or file name): letters, digits and
    `._+=,-`, not starting with a dot; no separator, no `..`, no absolute path."""
    text = str(value)
    if not _SAFE_NAME.fullmatch(text) or ".." in text:
        raise ToolkitError(f"{option}={text!r} cannot be a file name (it becomes a folder under the output "
                           "folder): use letters, digits and ._+=,- only, no '/' or '..'")
    return text


def run_entry(func: Callable[..., T], *args, log: logging.Logger) -> T | None:
    """Call `func(*args)`; a ToolkitError is logged as one line and the process exits with status 1
    (in a multirun: the job is recorded as failed and None is returned, so the sweep goes on)."""
    try:
        return func(*args)
    except ToolkitError as err:
        message = " ".join(str(err).split("\n"))
        log.error("%s", message)
        if not (HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN):
            RefusedRunLeavesNothing.remove()
            sys.exit(1)
        job = HydraConfig.get()
        overrides = " ".join(job.overrides.task)
        ReportFailures.failed_here.append((overrides, message))
        try:
            (Path(job.runtime.output_dir) / "FAILED").write_text(f"{overrides}\n{message}\n")
        except OSError as err:   # a full or read-only disk: the failure is still listed at the end (failed_here)
            log.error("could not record the failure in %s (%s)", job.runtime.output_dir, err.strerror or err)
        return None


# ${pid:} in conf/hydra/{run,sweep}/logs.yaml: a run folder per process, so two runs started in the same second
# never share (or remove) one; cached in the config like Hydra's ${now:}, so a SLURM job keeps its launcher's folder
if not OmegaConf.has_resolver("pid"):
    OmegaConf.register_new_resolver("pid", os.getpid, use_cache=True)


def hydra_main(config_path: str, config_name: str) -> Callable:
    """`@hydra.main(version_base="1.3", config_path=..., config_name=...)` of an entry point, with
    Hydra's errors before the task runs (composition, overrides, plugin instantiation) printed as one
    line and exit 1, and any command-line override of `hydra.callbacks` refused (a callback is code run
    around every job: only the ones conf/ names are run). HYDRA_FULL_ERROR=1 shows Hydra's full error."""
    def decorate(task: Callable) -> Callable:
        hydra_task = hydra.main(version_base="1.3", config_path=config_path, config_name=config_name)(task)

        @functools.wraps(task)
        def main(cfg=None):
            if cfg is not None:       # called with a composed config (tests, notebooks)
                return hydra_task(cfg)
            try:
                refuse_callback_overrides(sys.argv[1:])
            except ToolkitError as err:
                _print_error(str(err))
                sys.exit(1)
            wanted = os.environ.get("HYDRA_FULL_ERROR")
            os.environ["HYDRA_FULL_ERROR"] = "1"    # Hydra raises instead of printing; we print one line
            try:
                return hydra_task()
            except Exception as err:
                if wanted == "1" or not _raised_by_hydra(err):
                    raise
                _print_error(hydra_error_line(err))
                sys.exit(1)
            finally:
                if wanted is None:
                    os.environ.pop("HYDRA_FULL_ERROR", None)
                else:
                    os.environ["HYDRA_FULL_ERROR"] = wanted
        return main
    return decorate


def refuse_callback_overrides(arguments: list[str]) -> None:
    """A command-line override that adds, changes or removes a Hydra callback is one ToolkitError line."""
    for argument in arguments:
        key = argument.lstrip("+~").split("=", 1)[0]
        if key.replace("/", ".").split(".")[:2] == ["hydra", "callbacks"]:
            raise ToolkitError(f"{argument}: Hydra callbacks cannot be set from the command line (they run code around "
                               "every job; the toolkit's own are named in conf/): drop this override")


def _raised_by_hydra(err: Exception) -> bool:
    """Hydra's or OmegaConf's own error (its class, or raised from their code), not the entry point's."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    if isinstance(err, (HydraException, OmegaConfBaseException)):
        return True
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    module = tb.tb_frame.f_globals.get("__name__", "") if tb is not None else ""
    return module.split(".")[0] in ("hydra", "omegaconf")


def hydra_error_line(err: Exception) -> str:
    """Hydra's multi-line message as one line: its lines joined by "; ", a list of available options
    joined by ", ", the search path, OmegaConf's key details and the HYDRA_FULL_ERROR hint left out (a
    mistyped group choice or option close to a known one: `misspelt_line`'s line)."""
    misspelt = misspelt_line(err)
    if misspelt:
        return misspelt
    text = str(err)
    cause = err.__cause__
    if cause is not None and str(cause).strip() and str(cause).strip() not in text:
        text += "\n" + str(cause)
    parts: list[str] = []
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("Config search path"):
            break
        line = re.sub(r",? ?set env var HYDRA_FULL_ERROR=1 to see chained exception\.?", "", line)
        if not line or line.startswith(("full_key:", "object_type=", "reference_type=", "Set the environment")):
            continue
        if raw[:1] in ("\t", " ") and parts and parts[-1].endswith((":", ",")):
            parts[-1] += " " + line + ","
        else:
            parts.append(line)
    parts = [part.rstrip(",.") for part in parts]
    return "; ".join(parts) or type(err).__name__


def misspelt_line(err: Exception) -> str | None:
    """Hydra's error for an unknown config group choice or option whose name is close to known ones
    (difflib) as one line naming them, e.g. `probe=linaer: no such probe; did you mean linear? (choices:
    linear, mlp, ...)` or `lyer: no such option; did you mean layer?`; None for any other error."""
    missing, choices = getattr(err, "missing_cfg_file", None), getattr(err, "options", None)
    if missing and choices:
        group, _, name = missing.rpartition("/")
        close = difflib.get_close_matches(name, choices, n=3)
        return f"{group}={name}: no such {group}; did you mean {' or '.join(close)}? (choices: " \
               f"{', '.join(choices)})" if close else None
    cause = err.__cause__
    parent, key = getattr(cause, "parent_node", None), getattr(cause, "full_key", None)
    if parent is None or not key or "not in struct" not in str(cause):
        return None
    prefix, _, name = key.rpartition(".")
    close = difflib.get_close_matches(name, [str(k) for k in parent.keys() if k != "hydra"], n=3)
    head = prefix + "." if prefix else ""
    return f"{key}: no such option; did you mean {' or '.join(head + c for c in close)}?" if close else None


def _print_error(message: str) -> None:
    """One line in the entry points' log format (Hydra's logging is not configured yet)."""
    sys.stderr.write(f"[{time.strftime('%H:%M:%S')} ERROR] {message}\n")
    sys.stderr.flush()


class ReportFailures(Callback):
    """Before a multirun: its log folder must be writable (check_log_folder). At its end: one line per failed
    job (its overrides and reason), then exit 1."""

    def on_multirun_start(self, config, **kwargs) -> None:
        check_log_folder(config, "hydra.sweep.dir")

    failed_here: list[tuple[str, str]] = []   # (overrides, reason) of the jobs run_entry failed in this process

    def on_multirun_end(self, config, **kwargs) -> None:
        records = [tuple(r.read_text().splitlines()[:2]) for r in sorted(Path(config.hydra.sweep.dir).glob("*/FAILED"))]
        failed = list(dict.fromkeys(records + ReportFailures.failed_here))   # (a launcher's other processes: FAILED)
        log = logging.getLogger("multirun")
        for overrides, reason in failed:
            log.error("failed job %s: %s", overrides, reason)
        if failed:
            log.error("%d job(s) failed (listed above); rerun the same command to retry them, finished cells are "
                      "kept", len(failed))
            sys.exit(1)


def check_log_folder(config, key: str) -> None:
    """Before Hydra makes a run's log folder (`key`: hydra.run.dir, or hydra.sweep.dir for a multirun), the
    deepest existing folder of it must be writable: else one line naming the option it lies under
    (results_dir=, else store_dir=, else `key`) and exit 1, instead of Hydra's OSError traceback."""
    run_dir = Path(str(OmegaConf.select(config, key))).absolute()
    bad = unwritable(run_dir)
    if bad is None:
        return
    option = next((k for k in ("results_dir", "store_dir") if OmegaConf.select(config, k) is not None
                   and run_dir.is_relative_to(Path(str(OmegaConf.select(config, k))).absolute())), key)
    _print_error(f"{option}={OmegaConf.select(config, option)}: {bad} is not a writable folder (the run's log "
                 f"folder {run_dir.name} goes under it): choose another {option}=")
    sys.exit(1)


class RefusedRunLeavesNothing(Callback):
    """A single run refused with a ToolkitError (run_entry) leaves no log folder behind: before Hydra makes
    the run's folder (<results_dir>/logs/<entry>/<time>-<pid>) the first of its ancestors that does not exist
    yet is noted; remove() deletes the run's folder and then those ancestors up to that one while they are
    empty (another run's folder in them is kept)."""
    created: Path | None = None

    def on_run_start(self, config, **kwargs) -> None:
        check_log_folder(config, "hydra.run.dir")
        parent = Path(str(OmegaConf.select(config, "hydra.run.dir"))).absolute().parent
        missing = [p for p in (parent, *parent.parents) if not p.exists()]
        RefusedRunLeavesNothing.created = missing[-1] if missing else None

    @classmethod
    def remove(cls) -> None:
        if not HydraConfig.initialized() or not HydraConfig.get().runtime.output_dir:
            return
        folder = Path(HydraConfig.get().runtime.output_dir)
        for handler in list(logging.root.handlers):   # the run's log file, closed before its folder goes
            if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).is_relative_to(folder):
                handler.close()
                logging.root.removeHandler(handler)
        shutil.rmtree(folder, ignore_errors=True)
        if cls.created is None or not folder.is_relative_to(cls.created):
            return
        for parent in folder.parents:          # the folders this run made, while empty: a run started at the
            if not parent.is_relative_to(cls.created):   # same time may have put its own log folder there
                break
            try:
                parent.rmdir()
            except OSError:
                break


def check_writable(folder, option: str = "results_dir") -> None:
    """The deepest existing folder of `folder` must be a writable directory (checked before any work;
    nothing is created): else one ToolkitError line naming `option`."""
    bad = unwritable(folder)
    if bad is not None:
        raise ToolkitError(f"{option}={folder}: {bad} is not a writable folder: choose {option}=...")


def unwritable(folder) -> Path | None:
    """The deepest existing folder of `folder` when it is not a writable directory (None when it is)."""
    existing = Path(folder).absolute()
    while not existing.exists():
        existing = existing.parent
    return None if existing.is_dir() and os.access(existing, os.W_OK | os.X_OK) else existing


def check_count(value, option: str, none_ok: bool = False) -> int | None:
    """`value` as a whole number >= 1 (None passes when `none_ok`); anything else is a one-line error."""
    if value is None and none_ok:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        example, alternative = (100, f" (or {option}=null for no limit)") if none_ok else (1, "")
        raise ToolkitError(f"{option}={value!r} is not a whole number >= 1: give e.g. {option}={example}{alternative}")
    return int(value)


def config_error(err: Exception, hints: dict[str, str] | None = None) -> ToolkitError:
    """An OmegaConf error (wrong type, unknown key, bad enum value) as one line naming the option;
    `hints` maps an option to what it accepts (e.g. {"limit": "a whole number >= 1 or null"})."""
    key = getattr(err, "full_key", None) or "config"
    message = str(getattr(err, "msg", None) or err).strip().splitlines()[0].rstrip(".")
    if "is not a ListConfig" in message:   # OmegaConf's words for a single value given to a list option
        message = f"{getattr(err, 'value', None)!r} is not a list"
    accepts = (hints or {}).get(key)
    fix = f"give {key}= {accepts}" if accepts else f"correct {key}= on the command line"
    return ToolkitError(f"{key}: {message}; {fix}")
