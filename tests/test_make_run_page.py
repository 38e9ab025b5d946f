"""experiments.bench.make_run_page: the step and job times it reads from `make run`'s output."""
import pytest

from experiments.bench.make_run_page import (RUN_STAMP, job_table, main, read_log, readme_summary, replay_table,
                                             run_stamp, steps, with_readme_summary, workers)


def test_steps_and_jobs_from_make_output():
    lines = [(0.0, ".venv/bin/python -m extract model=smollm2 data=city_locations"),
             (5.0, "[10:00:00 INFO] store ready"),
             (600.0, "OMP_NUM_THREADS=1 .venv/bin/python -m experiments.sweep model=smollm2 workers=2"),
             (610.0, "[10:00:10][sweep][INFO] - 3 jobs (samil x 2, mean_diff x 1) on 2 worker(s), longest first"),
             (700.0, "[10:10:00 INFO] [1/3] samil layer 4: done in 90.0 s (1.7 min elapsed)"),
             (720.0, "[10:10:20 INFO] [2/3] samil layer 3: done in 110.0 s (2.0 min elapsed)"),
             (730.0, "[10:10:30 INFO] [3/3] mean_diff layer 4: FAILED in 10.0 s (2.2 min elapsed)"),
             (1500.0, ".venv/bin/python -m experiments.report model=smollm2 data=city_locations"),
             (1560.0, "")]
    assert [(cmd.split(" -m ")[1].split()[0], sec) for cmd, sec in steps(lines)] == [
        ("extract", 600.0), ("experiments.sweep", 900.0), ("experiments.report", 60.0)]
    table = job_table(lines)
    assert table[2] == "| samil | 2 | 100 s | 110 s | 3.3 |"     # the probe with the most worker time first
    assert table[3] == "| mean_diff | 1 | 10 s | 10 s | 0.2 |"
    assert workers(lines) == "2" and workers(lines[:2]) == "?"


def test_replay_table_and_run_stamp():
    lines = [(0.0, RUN_STAMP + "commit abc1234, 2026-12-04 20:00 UTC"),
             (0.0, ".venv/bin/python -m extract model=smollm2 data=city_locations"),
             (60.0, "OMP_NUM_THREADS=1 .venv/bin/python -m experiments.sweep model=smollm2 workers=2"),
             (100.0, "[10:00:00 INFO] [1/4] mlp layer 0: done in 60.0 s (1.0 min elapsed)"),
             (130.0, "[10:00:00 INFO] [2/4] samil layer 1: done in 120.0 s (2.0 min elapsed)"),
             (150.0, "[10:00:00 INFO] [3/4] samil layer 0: done in 120.0 s (2.5 min elapsed)"),
             (160.0, "[10:00:00 INFO] [4/4] mlp layer 1: done in 60.0 s (2.7 min elapsed)"),
             (300.0, ".venv/bin/python -m experiments.report model=smollm2 data=city_locations"),
             (360.0, "")]
    assert run_stamp(lines) == "commit abc1234, 2026-12-04 20:00 UTC"
    assert "does not name its commit" in run_stamp(lines[1:])
    rows = replay_table(lines)
    # queue: samil 0, samil 1, mlp 0, mlp 1; other steps 60 + 60 s
    assert rows[2] == "| 1 | 6.0 min | 8.0 min |"
    assert rows[3] == "| 2 | 3.0 min | 5.0 min |"
    assert rows[4] == "| 4 | 2.0 min | 4.0 min |"


def test_an_unfinished_or_failed_log_is_one_line(tmp_path):
    log = tmp_path / "make_run.log"
    start = ("      0.0 # make run at commit abc1234, 2026-12-04 20:00 UTC\n"
             "      0.1 .venv/bin/python -m extract model=smollm2 data=city_locations\n")
    log.write_text(start)                                   # killed: no exit line
    with pytest.raises(SystemExit, match="does not end with make run's exit status"):
        main(["--from-log", "--log", str(log), "--out", str(tmp_path / "page.md"), "--readme", ""])
    log.write_text(start + "     30.0 # make run exited 2\n")
    lines, code = read_log(log)
    assert code == 2 and lines[-1] == (30.0, "") and lines[1][1].startswith(".venv/bin/python -m extract")
    with pytest.raises(SystemExit, match="make run failed"):
        main(["--from-log", "--log", str(log), "--out", str(tmp_path / "page.md"), "--readme", ""])
    readme = tmp_path / "README.md"
    readme.write_text("# x\n")                            # no block for the time: refused before any run
    with pytest.raises(SystemExit, match="has no <!-- make_run_page -->"):
        main(["--log", str(log), "--out", str(tmp_path / "page.md"), "--readme", str(readme)])
    assert not (tmp_path / "page.md").exists()


def test_readme_summary_replaces_only_its_block():
    lines = [(0.0, RUN_STAMP + "commit abc1234, 2026-12-04 20:00 UTC"),
             (10.0, "[10:00:10][sweep][INFO] - 3 jobs (samil x 2, mean_diff x 1) on 2 worker(s), longest first"),
             (1470.0, "")]
    summary = readme_summary(run_stamp(lines), lines)
    assert "**24.5 min** wall on 2 workers" in summary and "commit abc1234" in summary
    readme = "intro\n<!-- make_run_page -->\nold text\n<!-- /make_run_page -->\nrest\n"
    assert with_readme_summary(readme, summary) == (
        "intro\n<!-- make_run_page -->\n" + summary + "\n<!-- /make_run_page -->\nrest\n")
    with pytest.raises(ValueError, match="no <!-- make_run_page -->"):
        with_readme_summary("intro\n", summary)
