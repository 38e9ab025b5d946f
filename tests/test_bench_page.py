"""The benchmarks page (`make bench`): what a benchmark prints goes on the page without progress bars, a
failed benchmark says so, `--only` reruns and a GPU log (`--gpu-log`) keep the other sections."""

import pytest

from experiments.bench.page import BENCHMARKS, kept_sections, main, page, run_one, section, write_page


def test_printed_lines_kept_without_progress_bars(tmp_path):
    script = "import sys; print('ratio = 0.46'); print('extract:  50%|#  | 1/2 [00:01<00:01, 3.2stmt/s]\\rdone', file=sys.stderr)"
    lines, seconds, code = run_one(["-c", script], tmp_path)
    assert code == 0 and seconds >= 0
    assert lines == ["ratio = 0.46", "done"]


def test_work_folder_shown_as_in_the_commands(tmp_path):
    lines, _, code = run_one(["-c", "import sys; print('[' + sys.argv[1] + ' layer 16]')", "{work}/store.h5"], tmp_path)
    assert code == 0 and lines == ["[bench_work/store.h5 layer 16]"]     # not this machine's path


def test_temporary_folders_shown_as_placeholders(tmp_path):
    script = ("import tempfile\nwith tempfile.TemporaryDirectory() as d:\n"
              "    print('store ready: ' + d + '/smollm2/c.h5'); print('[' + d + ' x]')")
    lines, _, code = run_one(["-c", script], tmp_path)
    assert code == 0 and lines == ["store ready: <tmp>/smollm2/c.h5", "[<tmp> x]"]


def test_failed_benchmark_is_marked(tmp_path):
    lines, _, code = run_one(["-c", "import sys; print('partial'); sys.exit(3)"], tmp_path)
    text = section("extract", "Extraction", "what", ["-m", "x"], lines, 1.0, code, "commit abc")
    assert "It failed (exit code 3)" in text and "partial" in text


def test_only_rerun_keeps_the_other_sections_in_order(tmp_path):
    out = tmp_path / "benchmarks.md"
    names = [b[0] for b in BENCHMARKS]
    sections = {name: section(name, heading, what, ["-m", name], [f"line of {name}"], 60.0, 0, "commit old")
                for name, heading, what, _ in BENCHMARKS}     # (the page shows today's headings and descriptions)
    write_page(out, page(sections, "commit old", "2 x CPU", "make bench"))
    kept = kept_sections(out)
    assert list(kept) == names and kept == sections
    kept[names[1]] = section(names[1], "new", "what", ["-m", "y"], ["new line"], 6.0, 0, "commit new")
    write_page(out, page(kept, "commit new", "2 x CPU", f"python -m experiments.bench.page --only {names[1]}"))
    text = out.read_text()
    assert "line of " + names[0] in text and "new line" in text and "line of " + names[1] not in text
    assert text.index(names[0]) < text.index("new line") < text.index("line of " + names[2])
    assert f"--only {names[1]}" in text.splitlines()[2]


def test_gpu_log_becomes_the_gpu_section_and_keeps_the_others(tmp_path):
    out = tmp_path / "benchmarks.md"
    name = BENCHMARKS[0][0]
    write_page(out, page({name: section(name, "h", "what", ["-m", name], ["cpu line"], 60.0, 0, "commit old")},
                         "commit old", "2 x CPU", "make bench"))
    log = tmp_path / "gpu.log"
    log.write_text("gpu_check: commit abc1234, 2026-12-04 15:00 UTC; Linux x86_64, X, 16 cores, NVIDIA H200; torch 2\n"
                   "Loading weights:  54%|#####  | 146/272 [00:00<00:00, 1447.35it/s]\rsamil layer job on cuda: 12 s\n")
    main(["--out", str(out), "--gpu-log", str(log)])
    text = out.read_text()
    assert "cpu line" in text and text.index("cpu line") < text.index("samil layer job on cuda: 12 s")
    assert "`bash experiments/bench/gpu_check.sh` (commit abc1234, 2026-12-04 15:00 UTC; Linux x86_64" in text
    assert "Loading weights" not in text and "--gpu-log LOG" in text.splitlines()[2]
    log.write_text("not a gpu_check log\n")
    with pytest.raises(SystemExit, match="no 'gpu_check:' provenance line"):
        main(["--out", str(out), "--gpu-log", str(log)])


def test_missed_targets_are_flagged_where_the_printed_value_misses():
    from experiments.bench.page import flagged, missed

    assert missed("extract, without / bare forward        = 1.295, 1.113   (target <= 1.15)")
    assert not missed("extract, shared prefix / without       = 0.179, 0.352   (goal <= 0.5)")
    assert missed("  one fit 2.80 s (target <= 1 s; stage 1 2.27 s, stage 3 0.29 s), peak RSS 1257 MiB")
    assert not missed("  fit wall 7.2 s, cpu 10.6 s (stage 1 6.1 s / 10 Newton steps, stage 3 0.8 s / 0)  (target < 60 s)")
    assert missed("  memory: RSS before 1773 MiB, peak during fit 2738 MiB, added 965 MiB  (target < 2048 MiB)")
    assert not missed("  memory: RSS before 1080 MiB, peak during fit 1717 MiB, added 637 MiB  (target < 2048 MiB)")
    assert not missed("  time ratio package / ours           100.0x (159.2x with 1 thread)  (target >= 100x at 250 bags)")
    assert not missed("no target on this line = 3")
    assert missed("samil layer job (five tasks), one CPU thread, on cuda = 45 s (target <= 5 s)")   # gpu_check.sh's
    assert not missed("make run (RUN_ACCELERATOR=auto, 16 workers, on cuda) = 280 s (target <= 300 s)")
    once = flagged(["layer read: h5py raw / fromfile speed      = 0.35   (target >= 0.5)"])
    assert once[0].endswith("[MISSED]") and flagged(once) == once


def test_gpu_check_imports_what_exists():
    """gpu_check.sh runs only where a GPU is lent (minutes a session, never in CI): every name its Python
    snippets import must exist here, or the lent minutes end on an ImportError (the toolkit/ move once did it)."""
    import importlib
    import re

    from experiments.bench.page import ROOT

    imports = re.findall(r"^from ([\w.]+) import ([\w, ]+)$", (ROOT / "experiments/bench/gpu_check.sh").read_text(),
                         re.M)
    assert imports
    for module, names in imports:
        for name in names.split(","):
            assert hasattr(importlib.import_module(module), name.strip()), f"{module}.{name.strip()}"
