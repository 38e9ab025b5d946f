"""experiments.steps.run_steps: a study's independent steps on several processes at once (at most `workers`,
each on one thread), a failure named in one line after the running ones end, nothing left running when the
study is killed."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from experiments.steps import run_steps
from toolkit.errors import ToolkitError
from tests.helpers import ROOT


def _events(log) -> list[list[str]]:
    return [line.split() for line in log.read_text().splitlines()]


def _step(log, name: str, seconds: float, *extra: str) -> tuple[str, ...]:
    return ("tests.step_child", str(log), name, str(seconds), *extra)


def test_steps_run_at_most_workers_at_once_on_one_thread_each(tmp_path):
    log = tmp_path / "log"
    # the first two wait for each other (two starts in the log): they meet only if they run at once
    run_steps([_step(log, f"s{i}", 0.3, "meet", "2") for i in range(5)], workers=2)
    events = _events(log)
    assert sorted(e[1] for e in events if e[0] == "end") == [f"s{i}" for i in range(5)]
    assert not [e for e in events if e[0] == "alone"]
    assert {e[3] for e in events if e[0] == "start"} == {"1"}
    running, most = 0, 0
    for kind, *_ in events:                         # (the log's order is the order things happened)
        running += {"start": 1, "end": -1}[kind]
        most = max(most, running)
    assert most == 2
    assert [e[1] for e in events if e[0] == "start"][:2] == ["s0", "s1"]     # in the order given


def test_a_failure_starts_nothing_new_and_names_the_command(tmp_path):
    log = tmp_path / "log"
    steps = [_step(log, "slow", 5.0, "meet", "2"), _step(log, "bad", 0.5, "fail"), _step(log, "never", 0.1)]
    with pytest.raises(ToolkitError) as err:
        run_steps(steps, workers=2)
    message = str(err.value)
    assert "\n" not in message and "tests.step_child" in message and " bad " in message and "slow" not in message
    events = _events(log)
    assert ["end", "slow"] == [e[:2] for e in events if e[1] == "slow"][-1]   # the running one was let finish
    assert not any(e[1] == "never" for e in events)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_killed_study_leaves_no_step_running(tmp_path):
    log = tmp_path / "log"
    study = textwrap.dedent(f"""
        from experiments.steps import run_steps
        run_steps([("tests.step_child", {str(log)!r}, "long", "60")], workers=1)
    """)
    parent = subprocess.Popen([sys.executable, "-c", study], cwd=ROOT)
    deadline = time.monotonic() + 60
    while not (log.exists() and log.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    child = int(_events(log)[0][2])
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.kill(child, signal.SIGKILL)
        pytest.fail("the step outlived its killed study")
    assert not any(e[0] == "end" for e in _events(log))
