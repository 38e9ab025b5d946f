"""Time `make run` and write its results page, docs/results/make_run.md, from what it did.

    python -m experiments.bench.make_run_page [--out docs/results/make_run.md] [--log make_run.log]

Runs `make run` in this checkout (on a fresh clone that includes `make install`), keeps its output in
`--log` with the time of every line, and writes the page: a provenance line (commit, date, command,
machine), the wall time of each step (the commands make echoes), the probe jobs' times per probe (from
`experiments.sweep`'s log lines), those job times replayed on 1-16 workers by the sweep's own schedule
(`experiments.sweep.replay`: what more cores would give, checked against the measured sweep), and the
report's best-layer tables (`reports/<model>/<data>/best.md`, copied as written) with its MCC-by-layer figure,
and the README's sentence on what `make run` covers and how long it took (between its `make_run_page`
markers; `--readme ''` leaves the README alone). Nothing on the page or in that sentence is typed by hand.
"""
from __future__ import annotations

import argparse
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from toolkit.disk import atomic_write
from toolkit.provenance import host, page_stamp
from experiments.sweep import longest_first, replay
from toolkit.markdown import markdown_table

ROOT = Path(__file__).resolve().parents[2]
REPORT = ROOT / "reports" / "smollm2" / "city_locations"
FIGURE = "smollm2_city_locations_mcc_by_layer.png"
FIGURE_COPY = ROOT / "experiments" / "figures" / FIGURE   # (the manual shows it as docs/figures/)
JOB = re.compile(r"\[(\d+)/(\d+)\] (\w+) layer (\d+): \w+ in ([\d.]+) s")
STEP = re.compile(r"^(\w+=\S+ )*(\S*python\S* -m \S+|test -x |touch )")   # a command make echoes
RUN_STAMP = "# make run at "                                              # the log's first line
RUN_EXIT = "# make run exited "                                           # its last line
WORKERS = re.compile(r"\d+ jobs \(.*\) on (\d+) worker\(s\)")             # the sweep's first line
REPLAY_WORKERS = (1, 2, 4, 8, 16)
README_BLOCK = re.compile(r"(<!-- make_run_page -->\n).*?(\n<!-- /make_run_page -->)", re.S)


def run_make(log: Path) -> tuple[list[tuple[float, str]], int]:
    """`make run`, each output line with its time since the start (also written to `log`, between a first
    line naming the commit and date of the run and a last one with its exit status)."""
    lines, t0 = [(0.0, RUN_STAMP + page_stamp())], time.perf_counter()
    with open(log, "w") as fh, subprocess.Popen(["make", "run"], cwd=ROOT, stdout=subprocess.PIPE,
                                                 stderr=subprocess.STDOUT, text=True, bufsize=1) as proc:
        fh.write(f"{0.0:9.1f} {lines[0][1]}\n")
        for line in proc.stdout:
            t = time.perf_counter() - t0
            lines.append((t, line.rstrip("\n")))
            fh.write(f"{t:9.1f} {line}")
            fh.flush()
            if JOB.search(line) or STEP.match(line):
                print(f"{t / 60:6.1f} min  {line.rstrip()}", flush=True)
        code = proc.wait()
        t = time.perf_counter() - t0
        fh.write(f"{t:9.1f} {RUN_EXIT}{code}\n")
    lines.append((t, ""))
    return lines, code


def read_log(log: Path) -> tuple[list[tuple[float, str]], int | None]:
    """The lines of an earlier run's log and its exit status, as `run_make` returns them (status None: the
    log has no last line, the run did not finish)."""
    lines = [(float(line[:9]), line[10:].rstrip("\n")) for line in log.read_text().splitlines(keepends=True)]
    if not lines or not lines[-1][1].startswith(RUN_EXIT):
        return lines, None
    return lines[:-1] + [(lines[-1][0], "")], int(lines[-1][1][len(RUN_EXIT):])


def steps(lines: list[tuple[float, str]]) -> list[tuple[str, float]]:
    """(command, seconds) of each command make echoed, up to the next one (or the end)."""
    starts = [(t, text) for t, text in lines if STEP.match(text)]
    end = lines[-1][0]
    return [(text, (starts[i + 1][0] if i + 1 < len(starts) else end) - t) for i, (t, text) in enumerate(starts)]


def jobs(lines: list[tuple[float, str]]) -> list[tuple[str, int, float]]:
    """(probe, layer, seconds) of every probe job the sweep reported, in completion order."""
    return [(m.group(3), int(m.group(4)), float(m.group(5))) for _, text in lines if (m := JOB.search(text))]


def job_table(lines: list[tuple[float, str]]) -> list[str]:
    """The lines of a Markdown table: per probe, its layer jobs' count, median and largest seconds and their sum."""
    per = {}
    for probe, _, seconds in jobs(lines):
        per.setdefault(probe, []).append(seconds)
    return markdown_table(["probe", "layer jobs", "median", "largest", "sum (worker-minutes)"],
                          [[probe, len(secs), f"{statistics.median(secs):.0f} s", f"{max(secs):.0f} s",
                            f"{sum(secs) / 60:.1f}"] for probe, secs in sorted(per.items(), key=lambda kv: -sum(kv[1]))]
                          ).splitlines()


def replay_table(lines: list[tuple[float, str]]) -> list[str]:
    """The lines of a Markdown table: the sweep's measured job times replayed on 1, 2, 4, ... workers by the sweep's own rule
    (`experiments.sweep.replay`, queue order `longest_first`), and `make run` with its other steps as measured."""
    queue = [seconds for _, _, seconds in longest_first(sorted(jobs(lines), key=lambda j: j[1]))]
    other = sum(sec for _, sec in steps(lines)) - sweep_seconds(lines)
    sweeps = [(k, replay(queue, k)) for k in REPLAY_WORKERS]
    return markdown_table(["workers", "sweep", "`make run`"],
                          [[k, f"{sweep / 60:.1f} min", f"{(sweep + other) / 60:.1f} min"] for k, sweep in sweeps]
                          ).splitlines()


def workers(lines: list[tuple[float, str]]) -> str:
    """The number of sweep workers, as the sweep's first line states it ("?" when absent)."""
    return next((m.group(1) for _, text in lines if (m := WORKERS.search(text))), "?")


def sweep_seconds(lines: list[tuple[float, str]]) -> float:
    """Wall seconds of the sweep step."""
    return next(sec for cmd, sec in steps(lines) if "experiments.sweep" in cmd)


def run_stamp(lines: list[tuple[float, str]]) -> str:
    """The commit and date of the run, as its log's first line records them (logs written before that line
    existed: the page's own stamp, saying so)."""
    if lines and lines[0][1].startswith(RUN_STAMP):
        return lines[0][1][len(RUN_STAMP):]
    return f"page written at {page_stamp()} from an earlier run's log that does not name its commit"


def page(stamp: str, lines: list[tuple[float, str]]) -> str:
    total = lines[-1][0]
    step_table = markdown_table(["step", "wall"], [[f"`{cmd[:160]}`", f"{sec / 60:.1f} min"]
                                                   for cmd, sec in steps(lines)]).rstrip("\n")
    best = (REPORT / "best.md").read_text()
    return "\n".join([
        "# `make run`: SmolLM2-135M-Instruct on city_locations", "",
        f"> Generated by `python -m experiments.bench.make_run_page` ({stamp}; {host()}): it ran `make run` "
        "and wrote this page from its output and its report. SmolLM2-135M-Instruct is the GGUF Q4_1 build, "
        "dequantised to float32.", "",
        "`make run` extracts every layer, then sweeps every layer with linear, mean_diff, mlp and samil, "
        "all five tasks in one job per probe and layer (the tasks share each layer's heads), C chosen by "
        "grouped cross-validation for every probe that has one (samil included), out-of-fold calibration "
        "from the CV fold fits (`calibration=out_of_fold_cv`, see [Differences](../differences.md)). "
        "`python -m experiments.sweep` runs the jobs on `RUN_WORKERS` one-thread workers (default: the "
        f"machine's cores; here {workers(lines)}) from one queue, longest first, so the sweep's wall time is "
        "about its worker-minutes over the workers; the layers are the store's, so another model needs no edit.", "",
        f"**Wall time: {total / 60:.1f} min** on this machine, by step:", "", step_table, "",
        "The probe jobs (each: one probe at one layer, five tasks, C by CV where the probe has one):", "",
        *job_table(lines), "",
        "The same jobs replayed (not run) on more workers: each worker takes the next job of the sweep's "
        "queue, longest first, when it is free, with the job times measured above; `make run` adds the "
        f"other steps' times measured here. The replay on this run's {workers(lines)} workers against the "
        f"sweep's measured wall ({sweep_seconds(lines) / 60:.1f} min) shows what the rule leaves out (process starts, "
        "reading the store); on more cores the job times hold only where the cores do not share a memory "
        "bus they saturate.", "",
        *replay_table(lines), "",
        "## What `make run` finds", "",
        f"![MCC and W-MCC by layer, SmolLM2-135M-Instruct, city_locations](../figures/{FIGURE})", "",
        "Best layer per probe and task (chosen on the calibration split, entity-disjoint from test), test "
        "MCC on the statements the conformal sets accept and W-MCC (that MCC x acceptance), with "
        "cluster-bootstrap 95 % intervals; `flag` names why a cell is not a healthy probe's "
        "(`C_at_grid_edge`: the chosen C is the grid's end). The report's `best.md`, as written:", "",
        best.strip(), ""])


def readme_summary(stamp: str, lines: list[tuple[float, str]]) -> str:
    """The README's sentence: what `make run` covers and its measured wall time, with the run's provenance."""
    return (f"`make run` extracts every layer, then fits linear, mean_diff, mlp and samil at every layer for all five "
            "tasks, C chosen by grouped cross-validation for every probe that has one (samil included), "
            f"out-of-fold calibration, and writes the report: **{lines[-1][0] / 60:.1f} min** wall on "
            f"{workers(lines)} workers ({host()}; {stamp}; `python -m experiments.bench.make_run_page`).")


def with_readme_summary(readme: str, summary: str) -> str:
    """`readme` with the text between its make_run_page markers replaced by `summary`."""
    if not README_BLOCK.search(readme):
        raise ValueError("the README has no <!-- make_run_page --> ... <!-- /make_run_page --> block")
    return README_BLOCK.sub(lambda m: m.group(1) + summary + m.group(2), readme, count=1)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "make_run.md"))
    ap.add_argument("--log", default=str(ROOT / "make_run.log"))
    ap.add_argument("--from-log", action="store_true", help="write the page from an earlier run's --log, no rerun")
    ap.add_argument("--readme", default=str(ROOT / "README.md"), help="the README whose make_run_page block to "
                    "rewrite ('': none)")
    args = ap.parse_args(argv)
    if args.readme and not README_BLOCK.search(Path(args.readme).read_text()):
        sys.exit(f"{args.readme} has no <!-- make_run_page --> ... <!-- /make_run_page --> block for the measured "
                 "time: add the two marker lines, or pass --readme ''")
    if args.from_log and not Path(args.log).is_file():
        sys.exit(f"--from-log: no log at {args.log}; run without --from-log, or give --log a make_run.log")
    lines, code = read_log(Path(args.log)) if args.from_log else run_make(Path(args.log))
    if code is None:
        sys.exit(f"{args.log} does not end with make run's exit status (a run that did not finish, or a log "
                 "written before it was recorded): rerun without --from-log")
    if code:
        sys.exit(f"make run failed (exit {code}); its output is in {args.log}")
    if not (REPORT / "best.md").is_file():
        sys.exit(f"no report at {REPORT}: write it with `python -m experiments.report model=smollm2 data=city_locations`")
    shutil.copyfile(REPORT / "mcc_by_layer.png", FIGURE_COPY)
    text = page(run_stamp(lines), lines)
    atomic_write(Path(args.out), lambda f: f.write(text.encode()))
    if args.readme:
        readme = with_readme_summary(Path(args.readme).read_text(), readme_summary(run_stamp(lines), lines))
        atomic_write(Path(args.readme), lambda f: f.write(readme.encode()))
    print(f"written: {args.out} ({lines[-1][0] / 60:.1f} min)")


if __name__ == "__main__":
    main()
