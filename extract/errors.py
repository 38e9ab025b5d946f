"""The toolkit's own error type and the one wrapper every entry point uses to report it.

This is the bottom layer (no project imports), so every package can raise and catch it.

In a Hydra multirun a failing job does not stop the sweep: `run_entry` logs its one line, records
it in the job's output folder (`FAILED`) and lets the next job run; `ReportFailures` (a Hydra
callback named in each entry point's config) lists the failed jobs at the end and exits 1.
Relaunching the sweep reruns only what is missing (existing cells are skipped).
"""
from __future__ import annotations

import logging
import re
import sys
from pathlib import Path
from typing import Callable, TypeVar

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode

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
            sys.exit(1)
        job = HydraConfig.get()
        record = Path(job.runtime.output_dir) / "FAILED"
        record.write_text(f"{' '.join(job.overrides.task)}\n{message}\n")
        return None


class ReportFailures(Callback):
    """At the end of a multirun: one line per failed job (its overrides and reason), then exit 1."""

    def on_multirun_end(self, config, **kwargs) -> None:
        failed = sorted(Path(config.hydra.sweep.dir).glob("*/FAILED"))
        log = logging.getLogger("multirun")
        for record in failed:
            overrides, reason = record.read_text().splitlines()[:2]
            log.error("failed job %s: %s", overrides, reason)
        if failed:
            log.error("%d job(s) failed (listed above); rerun the same command to retry them, finished cells are "
                      "kept", len(failed))
            sys.exit(1)


def check_count(value, option: str, none_ok: bool = False) -> int | None:
    """`value` as a whole number >= 1 (None passes when `none_ok`); anything else is a one-line error."""
    if value is None and none_ok:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        alternative = f" (or {option}=null for no limit)" if none_ok else ""
        raise ToolkitError(f"{option}={value!r} is not a whole number >= 1: give e.g. {option}=100{alternative}")
    return int(value)


def config_error(err: Exception, hints: dict[str, str] | None = None) -> ToolkitError:
    """An OmegaConf error (wrong type, unknown key, bad enum value) as one line naming the option;
    `hints` maps an option to what it accepts (e.g. {"limit": "a whole number >= 1 or null"})."""
    key = getattr(err, "full_key", None) or "config"
    message = str(getattr(err, "msg", None) or err).strip().splitlines()[0].rstrip(".")
    accepts = (hints or {}).get(key)
    fix = f"give {key}= {accepts}" if accepts else f"correct {key}= on the command line"
    return ToolkitError(f"{key}: {message}; {fix}")
