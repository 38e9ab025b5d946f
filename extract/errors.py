"""The toolkit's own error type and the one wrapper every entry point uses to report it.

This is the bottom layer (no project imports), so every package can raise and catch it.
"""
from __future__ import annotations

import logging
import re
import sys
from typing import Callable, TypeVar

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


def run_entry(func: Callable[..., T], *args, log: logging.Logger) -> T:
    """Call `func(*args)`; a ToolkitError is logged as one line and the process exits with status 1."""
    try:
        return func(*args)
    except ToolkitError as err:
        log.error("%s", " ".join(str(err).split("\n")))
        sys.exit(1)
