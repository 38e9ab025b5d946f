"""A study step for tests/test_study_steps.py: `python -m tests.step_child <log> <name> <seconds> [fail | meet N]`
appends "start <name> <pid> <OMP_NUM_THREADS>" to <log>; with `meet N` it first waits (up to 60 s, else it appends
"alone <name>") until <log> holds N starts; then it sleeps <seconds>, appends "end <name>", and exits 1 with `fail`."""
import os
import sys
import time
from pathlib import Path

log, name, seconds, mode = Path(sys.argv[1]), sys.argv[2], float(sys.argv[3]), sys.argv[4:]
with open(log, "a") as f:
    f.write(f"start {name} {os.getpid()} {os.environ.get('OMP_NUM_THREADS')}\n")
if mode[:1] == ["meet"]:
    deadline = time.monotonic() + 60
    while log.read_text().count("start ") < int(mode[1]) and time.monotonic() < deadline:
        time.sleep(0.05)
    if log.read_text().count("start ") < int(mode[1]):
        with open(log, "a") as f:
            f.write(f"alone {name}\n")
time.sleep(seconds)
with open(log, "a") as f:
    f.write(f"end {name}\n")
sys.exit(1 if mode == ["fail"] else 0)
