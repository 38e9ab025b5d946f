"""`make bench`: run the benchmarks of experiments/bench/ and write docs/benchmarks.md from what they print.

    python -m experiments.bench.page [--out docs/benchmarks.md] [--work bench_work] [--only NAME ...]

Each benchmark runs as its own process (its own threads and peak memory), one after another. The page
holds, per benchmark, what it measures, its command and the lines it printed (progress bars left out),
under one provenance line (commit, date, command, machine); nothing on it is typed by hand. The
real-store benchmarks read SmolLM2 city_locations at layer 16, extracted into `--work` first when it
is not complete (every statement, that layer only). `--only` reruns some benchmarks and keeps the other
sections of the existing page as they are (each section names the commit it ran at).

    python -m experiments.bench.page --gpu-log LOG

puts what `bash experiments/bench/gpu_check.sh` printed on a CUDA machine (LOG) in the page's GPU section,
under the provenance line the script printed there (commit, date, machine, GPU), and keeps the others.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from toolkit.disk import atomic_write
from toolkit.provenance import host, page_stamp

ROOT = Path(__file__).resolve().parents[2]
STORE = "{work}/activations/smollm2/city_locations.h5"
SETUP = ["-m", "extract", "model=smollm2", "data=city_locations", "layers=[16]", "store_dir={work}/activations",
         "hydra.run.dir={work}/logs"]

# (name, heading, what it measures and the goal it is held to, arguments after `python`)
BENCHMARKS = [
    ("extract", "Extraction: the shared prefix, capture overhead, store size, layer reads",
     "2000 city_locations statements, every layer of SmolLM2-135M-Instruct (GGUF Q4_1, dequantised to "
     "float32), on the CPU. Goals: extraction wall with the shared prefix <= 0.5x the whole-input path; "
     "store bytes <= 0.45x.",
     ["-m", "experiments.bench.bench_extract", "2000", "smollm2"]),
    ("linear", "Linear probe: C by grouped CV vs scikit-learn's LogisticRegressionCV",
     "One layer (16) of the full city_locations store, true_vs_all, the same folds, C grid and "
     "class-balanced objective for both.",
     ["-m", "experiments.bench.bench_linear", "--store", STORE, "--layer", "16"]),
    ("samil_package", "sAwMIL vs the `sawmil` package (OSQP), synthetic bags",
     "Identical planted bags (d = 576, ~14 tokens a bag), the same C, eta and candidates; then one fit on "
     "5000 bags (time and memory). Goal: >= 100x the package at 250 bags. What the ratio compares: each "
     "solver's time to its own stopping point, not to one solution. Ours stops on a certified duality gap of "
     "the sAwMIL objective; the package's OSQP stops at its own tolerance, and its held-out bag AUROC (about "
     "0.5 here) shows that it did not reach the optimum ours certifies, so the two fits are different models.",
     ["experiments/bench/bench_samil.py", "--sizes", "250", "500", "--big", "5000"]),
    ("samil_real", "sAwMIL on every city_locations training bag, and its C by CV",
     "One fit at C = 100 on all training bags at layer 16 (goal <= 1 s at one thread), then the probe's C "
     "by grouped CV over its grid with warm starts (one head).",
     ["experiments/bench/bench_samil.py", "--sizes", "--big", "0", "--store", STORE, "--layer", "16"]),
    ("samil_solvers", "sAwMIL's C by CV: stage 3 by dual coordinate descent vs the previous solver",
     "One head (true_vs_all) at layer 16, C by grouped CV over the default grid with warm starts, stage 3 "
     "solved by the previous smoothing / interior-point path and by dual coordinate descent with the polish "
     "(the default), alternating; the same chosen C and certified objectives are the check.",
     ["experiments/bench/bench_samil.py", "--sizes", "--big", "0", "--store", STORE, "--layer", "16",
      "--cv-compare", "1"]),
    ("layer_jobs", "One `make run` layer job per probe: five tasks, C by CV",
     "What one `make run` job costs: every probe at layer 16 of the full city_locations store, the five tasks of "
     "`make run` in one job (their heads shared), samil and linear with C by grouped CV over their bracketing "
     "grids, at one thread as each sweep worker runs. Goals: a samil job <= 20 s, an mlp job <= 8 s.",
     ["-m", "experiments.bench.bench_layers", "model=smollm2", "data=city_locations", "store_dir={work}/activations",
      "samil_C=null"]),
    ("peers", "Extraction against nnsight, TransformerLens and plain Hugging Face, at equal threads",
     "2000 city_locations statements, every layer of SmolLM2-135M-Instruct (GGUF Q4_1, dequantised to float32), "
     "written to HDF5 by `python -m extract` and by what a user would write instead (nnsight's trace, "
     "TransformerLens' run_with_cache, a plain output_hidden_states forward + h5py; in their own virtualenv, "
     "`make peers`), the same token ids and batch budget for all, each tool a process timed whole at one thread "
     "and at all cores. Goals: ours >= 2x faster than each, store bytes <= 0.45x.",
     ["-m", "experiments.bench.bench_peers", "--peers-python", "{peers}", "--n", "2000"]),
    ("samil_wide", "sAwMIL at Llama-3.1-8B width (d = 4096), synthetic",
     "2929 planted bags (the city_locations training split's size): C by grouped CV of one head and one "
     "fit at d = 576, one fit at d = 4096, and from their ratio what a GPU-less user with an 8B model "
     "should expect per head and per layer (a CV at d = 4096 takes hours here).",
     ["experiments/bench/bench_samil.py", "--skip-package", "--big", "0", "--wide", "2929", "--dim", "4096"]),
]
GPU = ("gpu", "On a GPU: extraction, its checks, the linear probe and sAwMIL on CUDA",
       "`experiments/bench/gpu_check.sh` on a CUDA machine: 2000 city_locations statements extracted in bfloat16 "
       "with and without the shared prefix (times; the two stores and a plain `output_hidden_states` forward "
       "compared), the linear probe's C by CV, one sAwMIL fit and its C by CV (one head), one sAwMIL fit at "
       "d = 4096, then one `make run` samil layer job (every statement, layer 16, five tasks, C by CV) on CUDA.",
       ["bash", "experiments/bench/gpu_check.sh"])
PROGRESS = re.compile(r"\d+/\d+ \[|it/s\]|s/it\]|stmt/s")
TARGET = re.compile(r"\((?:goal|target)\s*(<=|>=|<|>)\s*([-+]?[0-9.]+)")
NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")
MISSED = "  [MISSED]"
SHOWN_WORK = "bench_work"      # the work folder as the page names it (in commands and printed lines)
PEERS_PYTHON = ["peers_venv/bin/python"]   # --peers-python: the peers' virtualenv (make peers)


def machine() -> str:
    """This machine and its load average, in one phrase."""
    return f"{host()}, load average {os.getloadavg()[0]:.1f} at the start"


SCRATCH = re.compile(re.escape(tempfile.gettempdir().rstrip("/")) + r"/[^/\s\]\)'\"]+")


def shown(line: str) -> str:
    """A printed line as the page shows it: a benchmark's temporary folder as <tmp>, not this machine's path."""
    return SCRATCH.sub("<tmp>", line.rstrip())


def run_one(args: list[str], work: Path) -> tuple[list[str], float, int]:
    """Run `python args` from the repository root: (printed lines without progress bars, the work folder
    named SHOWN_WORK and a benchmark's own temporary folders <tmp> in them, not as this machine's paths;
    seconds, exit code)."""
    argv = [sys.executable, *(a.format(work=work, peers=PEERS_PYTHON[0]) for a in args)]
    started = time.perf_counter()
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    lines = [line for chunk in (done.stdout + done.stderr).split("\n") for line in chunk.split("\r")]
    kept = [shown(line.replace(str(work), SHOWN_WORK)) for line in lines if line.strip() and not PROGRESS.search(line)]
    return kept, time.perf_counter() - started, done.returncode


def missed(line: str) -> bool:
    """Whether a printed line states a target (`(goal <= 0.5)`, `(target >= 100x ...)`) that its measured value
    misses. The measured value: the first number after `=` where the line has one before the target, else the
    number after "peak during fit" (memory lines), else the line's first number."""
    found = TARGET.search(line)
    if not found:
        return False
    before = line[:found.start()]
    if "=" in before:
        before = before.split("=", 1)[1]
    elif "peak during fit" in before:
        before = before.split("peak during fit", 1)[1]
    values = NUMBER.findall(before)
    if not values:
        return False
    value, bound = float(values[0]), float(found.group(2).rstrip("."))
    return not {"<=": value <= bound, ">=": value >= bound, "<": value < bound, ">": value > bound}[found.group(1)]


def flagged(lines: list[str]) -> list[str]:
    """The lines with `[MISSED]` after each target its value misses (a line flagged already is kept as it is)."""
    return [line + MISSED if missed(line) and not line.endswith(MISSED) else line for line in lines]


def section(name: str, heading: str, what: str, args: list[str], lines: list[str], seconds: float | None, code: int,
            stamp: str) -> str:
    """One benchmark's section: what it measures, its command (with its minutes when timed here) and its lines."""
    command = " ".join(["python", *args] if args[0] != "bash" else args).replace("{work}", SHOWN_WORK).replace(
        "{peers}", "peers_venv/bin/python")
    status = "" if code == 0 else f" **It failed (exit code {code}); its last lines are below.**"
    body = lines if code == 0 else lines[-30:]
    return "\n".join([f"<!-- bench:{name} -->", f"## {heading}", "", what, "",
                      f"`{command}` ({'' if seconds is None else f'{seconds / 60:.1f} min, '}{stamp}).{status}", "",
                      "```text", *body, "```", f"<!-- /bench:{name} -->", ""])


def refreshed(name: str, text: str) -> str:
    """A kept section with today's heading and description (BENCHMARKS), its missed targets flagged and counted,
    its command line and printed lines as they were."""
    lines = text.rstrip("\n").split("\n")
    spec = {b[0]: b for b in [*BENCHMARKS, GPU]}.get(name)
    command = lines[5].split(" Targets missed in this run:")[0]   # (the layout of `section`)
    body = flagged(lines[lines.index("```text") + 1:len(lines) - 1 - lines[::-1].index("```")])
    n = sum(line.endswith(MISSED) for line in body)
    note = f" Targets missed in this run: {n} (lines marked `[MISSED]`)." if n else ""
    heading, what = (spec[1], spec[2]) if spec else (lines[1].removeprefix("## "), lines[3])
    return "\n".join([f"<!-- bench:{name} -->", f"## {heading}", "", what, "", command + note, "", "```text", *body,
                      "```", f"<!-- /bench:{name} -->", ""])


def kept_sections(page: Path) -> dict[str, str]:
    """The sections of an existing page, by benchmark name."""
    if not page.exists():
        return {}
    found = re.findall(r"(<!-- bench:(\w+) -->.*?<!-- /bench:\2 -->\n)", page.read_text(), re.S)
    return {name: text for text, name in found}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"))
    ap.add_argument("--work", default=str(ROOT / "bench_work"), help="store and scratch folder (kept for reruns)")
    ap.add_argument("--only", nargs="*", choices=[b[0] for b in BENCHMARKS], help="rerun these, keep the others")
    ap.add_argument("--gpu-log", help="what gpu_check.sh printed on a CUDA machine: its section, the others kept")
    ap.add_argument("--rewrite", action="store_true", help="rewrite the page from its sections, running nothing")
    ap.add_argument("--peers-python", default=PEERS_PYTHON[0], help="python of the peers' virtualenv (make peers)")
    args = ap.parse_args(argv)
    PEERS_PYTHON[0] = args.peers_python
    work, out = Path(args.work).resolve(), Path(args.out)
    if args.rewrite:
        write_page(out, page(kept_sections(out), page_stamp(), machine(), "python -m experiments.bench.page --rewrite"))
        print(f"written: {out}")
        return
    if args.gpu_log:
        sections = kept_sections(out)
        sections[GPU[0]] = gpu_section(Path(args.gpu_log))
        write_page(out, page(sections, page_stamp(), machine(), "python -m experiments.bench.page --gpu-log LOG"))
        print(f"written: {out}")
        return
    stamp = page_stamp()
    where = machine()
    command = "make bench" if not args.only else f"python -m experiments.bench.page --only {' '.join(args.only)}"
    print("the SmolLM2 city_locations store at layer 16 in", work, "(extracted or resumed when not complete)",
          flush=True)
    lines, _, code = run_one(SETUP, work)
    if code:
        sys.exit("the store for the benchmarks could not be extracted:\n" + "\n".join(lines[-10:]))
    sections = kept_sections(out)
    for name, heading, what, bench_args in BENCHMARKS:
        if args.only and name not in args.only:
            continue
        print(f"[{name}] python {' '.join(bench_args)}", flush=True)
        lines, seconds, code = run_one(bench_args, work)
        print("\n".join(lines[-6:]), flush=True)
        sections[name] = section(name, heading, what, bench_args, lines, seconds, code, stamp)
        write_page(out, page(sections, stamp, where, command))
    write_page(out, page(sections, stamp, where, command))
    print(f"written: {out}")


def gpu_section(log: Path) -> str:
    """The GPU section from a gpu_check.sh log: its lines (progress bars left out) under the provenance line
    the script printed first."""
    if not log.is_file():
        sys.exit(f"--gpu-log {log}: no such file; give the output of `bash experiments/bench/gpu_check.sh`")
    lines = [line.rstrip() for chunk in log.read_text().split("\n") for line in chunk.split("\r")]
    lines = [shown(line) for line in lines if line.strip() and not PROGRESS.search(line)]
    stamp = next((line.removeprefix("gpu_check: ") for line in lines if line.startswith("gpu_check: ")), None)
    if stamp is None:
        sys.exit(f"--gpu-log {log}: no 'gpu_check:' provenance line; is it gpu_check.sh's output?")
    name, heading, what, args = GPU
    return section(name, heading, what, args, [line for line in lines if not line.startswith("gpu_check: ")],
                   None, 0, stamp)


def write_page(out: Path, text: str) -> None:
    atomic_write(out, lambda f: f.write(text.encode()))


def page(sections: dict[str, str], stamp: str, where: str, command: str) -> str:
    """The whole page: the provenance line (the command that wrote it last) and the sections in order."""
    head = ["# Benchmarks", "",
            f"> Written by `{command}` ({stamp}; {where}). Each section holds what one run of the command shown "
            "with it printed, with that run's commit and date (sections come from different runs and commits; "
            "\"(modified)\": the work tree had uncommitted changes then): compare the ratios within a section, "
            "measured in one run, not seconds across sections (a shared 2-core machine is noisy). A target a run "
            "missed is marked `[MISSED]` on its line and counted under the section's command. Rerun one section "
            "with `python -m experiments.bench.page --only NAME`; `--rewrite` rewrites the page from its sections "
            "without running anything.", "",
            "The cost of the whole study (`make run`, every layer of every probe with C by CV) is on "
            "[its results page](results/make_run.md).", ""]
    body = [refreshed(name, sections[name]) for name, *_ in [*BENCHMARKS, GPU] if name in sections]
    return "\n".join(head + body)


if __name__ == "__main__":
    main()
