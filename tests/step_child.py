"""A study step for tests/test_study_steps.py: `python -m tests.step_child <log> <name> <seconds> [fail]` appends
"start <name> <time> <pid> <OMP_NUM_THREADS>" to <log>, sleeps, appends "end <name> <time>", exits 1 with `fail`."""
import os
import sys
import time

log, name, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
with open(log, "a") as f:
    f.write(f"start {name} {time.time()} {os.getpid()} {os.environ.get('OMP_NUM_THREADS')}\n")
time.sleep(seconds)
with open(log, "a") as f:
    f.write(f"end {name} {time.time()}\n")
sys.exit(1 if sys.argv[4:] == ["fail"] else 0)
