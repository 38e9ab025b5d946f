"""Issue 24 on `python -m truthfulqa`, `python -m ncb` and the zero-shot checkpoint: every option through
its typed schema before any work (one line, nothing written), a corrupt checkpoint (real garbage, a
truncated file) discarded with one warning and the work redone bit-identically, a latin-1 CSV named
in one line, the documented template override, and resumption after a real SIGKILL."""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from omegaconf import OmegaConf

from toolkit.config import compose_config
from toolkit.errors import ToolkitError
from extract.statements import DATA_DIR

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
HEADER = "Type,Category,Question,Best Answer,Correct Answers,Incorrect Answers,Source\n"

# python -c KILL_AFTER <module.attr> <k> <entry> args...: SIGKILL right after the k-th call of module.attr returns
KILL_AFTER = """
import importlib, os, runpy, signal, sys
target, k, entry = sys.argv.pop(1), int(sys.argv.pop(1)), sys.argv.pop(1)
module_name, attr = target.rsplit(".", 1)
module = importlib.import_module(module_name)
real, calls = getattr(module, attr), [0]
def kill_after(*args, **kwargs):
    out = real(*args, **kwargs)
    calls[0] += 1
    if calls[0] == k:
        os.kill(os.getpid(), signal.SIGKILL)
    return out
setattr(module, attr, kill_after)
runpy.run_module(entry, run_name="__main__", alter_sys=True)
"""


def killed_run(target: str, k: int, entry: str, *args: str, logs: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", KILL_AFTER, target, str(k), entry, *args, f"hydra.run.dir={logs}"]
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)


def cli(entry: str, *args: str, logs: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", entry, *args, f"hydra.run.dir={logs}"], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=600)


def one_line(err: pytest.ExceptionInfo, *needles: str) -> str:
    message = str(err.value)
    assert isinstance(err.value, ToolkitError) and "\n" not in message, message
    for needle in needles:
        assert needle in message, message
    return message


class _Reached(Exception):
    """The expensive part was reached (the options should have been refused before it)."""


def _expensive(*args, **kwargs):
    raise _Reached


def garbage(path: Path, kind: str, valid: Path | None = None) -> None:
    """A corrupt checkpoint at `path`: random bytes, a truncated copy of a valid one, or an npz of
    something else (no expected keys)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "bytes":
        path.write_bytes(np.random.default_rng(0).bytes(3000))
    elif kind == "truncated":
        data = valid.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    else:
        np.savez(path, something=np.arange(3))
        if not path.exists():                          # np.savez appends .npz to a name without it
            path.with_name(path.name + ".npz").rename(path)


# ====================================================================================== truthfulqa
def tqa(*overrides: str):
    return compose_config("truthfulqa", "model=tiny", *overrides)


@pytest.mark.parametrize("option, needle", [
    ("batch_size=abc", "batch_size"), ("n_boot=0", "n_boot=0"), ("n_boot=abc", "n_boot"),
    ("save_every=0", "save_every=0"), ("prefix_cache=maybe", "prefix_cache"), ("seed=abc", "seed"),
    ("model.instruct=maybe", "model.instruct"), ("format=mc3", "format='mc3'"),
])
def test_truthfulqa_options_are_refused_in_one_line_before_any_work(tmp_path, monkeypatch, option, needle):
    import truthfulqa.run as tqa_run

    monkeypatch.setattr(tqa_run, "load_model", _expensive)
    with pytest.raises(ToolkitError) as err:
        tqa_run.run(tqa(option, f"results_dir={tmp_path / 'r'}"))
    one_line(err, needle)
    assert not (tmp_path / "r").exists()


def test_truthfulqa_results_dir_under_a_file_is_refused_before_any_work(tmp_path, monkeypatch):
    import truthfulqa.run as tqa_run

    monkeypatch.setattr(tqa_run, "load_model", _expensive)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ToolkitError) as err:
        tqa_run.run(tqa(f"results_dir={tmp_path / 'file' / 'r'}"))
    one_line(err, "results_dir=")


def test_truthfulqa_cli_n_boot_0_is_one_line_and_writes_nothing(tmp_path):
    done = cli("truthfulqa", "model=tiny", "format=plain", "limit=2", "n_boot=0", f"results_dir={tmp_path / 'r'}",
               logs=tmp_path / "logs")
    errors = [line for line in done.stderr.splitlines() if "ERROR" in line]
    assert done.returncode == 1 and len(errors) == 1 and "n_boot=0" in errors[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr and not (tmp_path / "r").exists()


def test_truthfulqa_latin1_csv_is_one_line_naming_the_file_and_the_encoding(tmp_path, caplog):
    from toolkit.errors import run_entry
    from truthfulqa.run import run

    path = tmp_path / "latin1.csv"
    path.write_bytes((HEADER + "A,B,Où est le café?,Ici,Ici; là,Nulle part,\n").encode("latin-1"))
    with pytest.raises(ToolkitError) as err:
        run(tqa(f"data_path={path}", f"results_dir={tmp_path / 'r'}"))
    one_line(err, str(path), "UTF-8")
    with caplog.at_level(logging.ERROR), pytest.raises(SystemExit) as exit_:
        run_entry(run, tqa(f"data_path={path}", f"results_dir={tmp_path / 'r'}"), log=logging.getLogger("t"))
    assert exit_.value.code == 1 and not (tmp_path / "r").exists()
    from toolkit.config import compose_config
    from extract.run import extract   # the probing datapack reads the CSV with the same parser
    with pytest.raises(ToolkitError) as err:
        extract(compose_config("extract", "model=tiny", "data=truthfulqa", f"data.path={path}",
                               f"store_dir={tmp_path / 's'}"))
    one_line(err, str(path), "UTF-8")
    assert not (tmp_path / "s").exists()


@pytest.fixture(scope="module")
def tqa_whole(tmp_path_factory):
    """An uninterrupted tiny run (format=plain, 4 questions) and its options."""
    from truthfulqa.run import run

    common = ["format=plain", "limit=4", "batch_size=4", "save_every=1", "n_boot=50"]
    folder = tmp_path_factory.mktemp("tqa")
    return common, json.loads(run(tqa(*common, f"results_dir={folder}")).read_text())


@pytest.mark.parametrize("kind", ["bytes", "truncated", "other_npz"])
def test_truthfulqa_corrupt_partial_is_discarded_with_one_line_and_redone(tqa_whole, tmp_path, caplog, kind):
    from truthfulqa.run import partial_path, result_path, run

    common, whole = tqa_whole
    cfg = tqa(*common, f"results_dir={tmp_path / 'r'}")
    partial = partial_path(result_path(cfg))
    valid = None
    if kind == "truncated":                            # a real checkpoint of this run, cut in half
        killed = killed_run("toolkit.disk.atomic_write", 1, "truthfulqa", "model=tiny", *common,
                            f"results_dir={tmp_path / 'r'}", logs=tmp_path / "logs")
        assert killed.returncode == -signal.SIGKILL and partial.exists(), killed.stderr[-2000:]
        valid = tmp_path / "valid.npz"
        partial.rename(valid)
    garbage(partial, kind, valid)
    with caplog.at_level(logging.WARNING):
        resumed = json.loads(run(cfg).read_text())
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and partial.name in r.getMessage()]
    assert len(warned) == 1 and "\n" not in warned[0] and "discard" in warned[0], warned
    assert resumed["resumed_after_requests"] == 0 and not partial.exists()
    for key in ("mc1", "mc2", "mc1_ci", "mc2_ci", "questions"):
        assert resumed[key] == whole[key], key


def test_truthfulqa_resumes_after_sigkill_bit_identical(tqa_whole, tmp_path):
    from truthfulqa.run import partial_path, result_path

    common, whole = tqa_whole
    args = ["model=tiny", *common, f"results_dir={tmp_path / 'r'}"]
    killed = killed_run("toolkit.disk.atomic_write", 2, "truthfulqa", *args, logs=tmp_path / "logs")
    final = result_path(tqa(*common, f"results_dir={tmp_path / 'r'}"))
    assert killed.returncode == -signal.SIGKILL and partial_path(final).exists() and not final.exists()
    done = cli("truthfulqa", *args, logs=tmp_path / "logs2")
    assert done.returncode == 0, done.stderr[-2000:]
    resumed = json.loads(final.read_text())
    assert resumed["resumed_after_requests"] > 0 and not partial_path(final).exists()
    for key in ("mc1", "mc2", "mc1_ci", "mc2_ci", "questions"):
        assert resumed[key] == whole[key], key


# ======================================================================================= zero_shot
@pytest.mark.parametrize("kind", ["bytes", "truncated", "other_npz"])
def test_zero_shot_corrupt_partial_is_discarded_with_one_line_and_redone(tmp_path, caplog, kind):
    from zero_shot.scoring import compute_scores, partial_path, scores_path

    common = ["model=tiny", "limit=8", "batch_size=4", "save_every=1", "evaluate=false"]
    whole = np.load(compute_scores(compose_config("zero_shot", *common, f"results_dir={tmp_path / 'a'}")))
    cfg = compose_config("zero_shot", *common, f"results_dir={tmp_path / 'b'}")
    partial = partial_path(scores_path(cfg, "-limit8"))
    valid = None
    if kind == "truncated":
        killed = killed_run("toolkit.disk.atomic_write", 1, "zero_shot", *common,
                            f"results_dir={tmp_path / 'b'}", logs=tmp_path / "logs")
        assert killed.returncode == -signal.SIGKILL and partial.exists(), killed.stderr[-2000:]
        valid = tmp_path / "valid.npz"
        partial.rename(valid)
    garbage(partial, kind, valid)
    with caplog.at_level(logging.WARNING):
        again = np.load(compute_scores(cfg))
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and partial.name in r.getMessage()]
    assert len(warned) == 1 and "\n" not in warned[0] and "discard" in warned[0], warned
    assert not partial.exists()
    np.testing.assert_array_equal(again[:8], whole[:8])


# ============================================================================================= ncb
def ncb_cfg(*overrides: str):
    return compose_config("ncb", "model=tiny", *overrides)


@pytest.mark.parametrize("option, needle", [
    ("overwrite=maybe", "overwrite"), ("overwrite=[]", "overwrite"), ("balance_by_py=maybe", "balance_by_py"),
    ("zero_shot.prefix_cache=sometimes", "zero_shot.prefix_cache"), ("clip=2", "clip=2"), ("clip=0", "clip=0"),
    ("fractions=abc", "fractions"), ("fractions=[0.6]", "fractions"), ("fractions=[]", "fractions"),
    ("n_bins=abc", "n_bins"), ("n_bins=0", "n_bins=0"), ("n_boot=0", "n_boot=0"), ("seed=abc", "seed"),
    ("zero_shot.task=bogus", "zero_shot.task"), ("zero_shot.batch_size=0", "zero_shot.batch_size=0"),
    ("zero_shot.enumeration=bogus", "bogus"), ("extract.batch_tokens=abc", "extract.batch_tokens"),
])
@pytest.mark.parametrize("method", ["zero_shot", "'{cell}'"])
def test_ncb_options_are_refused_in_one_line_before_any_work(tmp_path, monkeypatch, option, needle, method):
    import ncb.run as ncb_run

    cell = tmp_path / "results" / "tiny" / "seed=0.json"           # never read: the options come first
    monkeypatch.setattr(ncb_run, "load_method", _expensive)
    with pytest.raises(ToolkitError) as err:
        ncb_run.run(ncb_cfg(f"method={method.format(cell=cell)}", option, f"results_dir={tmp_path / 'r'}",
                            f"store_dir={tmp_path / 's'}"))
    one_line(err, needle)
    assert not (tmp_path / "r").exists() and not (tmp_path / "s").exists()


def test_ncb_booleans_are_read_by_the_typed_parser_not_by_truthiness():
    """`overwrite=no` was the string "no", true to `if cfg.overwrite` (outputs and the stress store were
    recomputed); the schema reads it as false, as train_probe and extract do."""
    from ncb.schema import validate

    cfg = validate(ncb_cfg("method=zero_shot", "overwrite=no", "balance_by_py=off", "zero_shot.prefix_cache=no"))
    assert cfg.overwrite is False and cfg.balance_by_py is False and cfg.zero_shot.prefix_cache is False
    assert validate(ncb_cfg("method=zero_shot", "overwrite=yes")).overwrite is True


def test_ncb_without_method_is_one_line(tmp_path):
    done = cli("ncb", "model=tiny", f"results_dir={tmp_path / 'r'}", logs=tmp_path / "logs")
    errors = [line for line in done.stderr.splitlines() if "ERROR" in line]
    assert done.returncode == 1 and len(errors) == 1 and "method is not set" in errors[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr and not (tmp_path / "r").exists()


def test_ncb_results_dir_under_a_file_is_refused_before_any_work(tmp_path, monkeypatch):
    import ncb.run as ncb_run

    monkeypatch.setattr(ncb_run, "load_method", _expensive)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ToolkitError) as err:
        ncb_run.run(ncb_cfg("method=zero_shot", f"results_dir={tmp_path / 'file' / 'r'}"))
    one_line(err, "results_dir=")


@pytest.mark.parametrize("template, needle", [
    ("'A post says {bogus}.'", "{bogus}"), ("'A post says {}.'", "{}"), ("'A post says {false.x}.'", "{false.x}"),
    ("'A post says {false.'", "stress.interferences.source.forum"), ("''", "empty"),
])
def test_ncb_template_with_an_unknown_field_is_refused_naming_it_and_the_allowed_fields(tmp_path, monkeypatch,
                                                                                        template, needle):
    import ncb.run as ncb_run
    from contexts.interference import perturbations
    from extract.statements import load_statements

    monkeypatch.setattr(ncb_run, "load_method", _expensive)
    cfg = ncb_cfg("method=zero_shot", f"stress.interferences.source.forum={template}", f"results_dir={tmp_path}")
    with pytest.raises(ToolkitError) as err:
        ncb_run.run(cfg)
    message = one_line(err, needle, "stress.interferences.source.forum")
    if needle != "empty":
        assert "{false}" in message and "{true}" in message and "{neighbour}" in message and "control" in message
    table = load_statements("city_locations").iloc[:50]
    with pytest.raises(ToolkitError):                  # the function itself never drops them silently
        perturbations(table, np.arange(10), OmegaConf.to_container(cfg.stress.interferences), "x y z")


def test_ncb_documented_template_override_replaces_one_level(tmp_path):
    """`stress.interferences.peer.1='...'` (the README's form) replaces level 1's template; `+` on an
    existing level is refused by Hydra; a level key that is not text is refused (never pooled)."""
    from contexts.interference import perturbations
    from extract.statements import load_statements

    cfg = ncb_cfg("method=zero_shot", "stress.interferences.peer.1='Two friends told me that {false}.'",
                  "+stress.interferences.peer.2='Some people said that {false}.'")
    from ncb.schema import validate
    cfg = validate(cfg)
    peer = OmegaConf.to_container(cfg.stress.interferences.peer)
    assert list(peer) == ["0", "1", "3", "5", "2"] and peer["1"] == "Two friends told me that {false}."
    table = load_statements("city_locations").iloc[:200]
    frame = perturbations(table, np.arange(len(table)), OmegaConf.to_container(cfg.stress.interferences),
                          str(cfg.stress.neutral))
    one = frame[(frame["interference"] == "peer") & (frame["level"] == "1")]
    assert len(one) and one["context"].str.startswith("Two friends told me that").all()
    assert not frame.duplicated(["target_row", "interference", "level"]).any()
    with pytest.raises(Exception, match="already at 'stress.interferences.peer.1'"):
        ncb_cfg("method=zero_shot", "+stress.interferences.peer.1='Two friends told me that {false}.'")
    pooled = ncb_cfg("method=zero_shot")                 # a preset with an integer level key next to "1"
    OmegaConf.set_struct(pooled, False)
    pooled.stress.interferences.peer = {"1": "x {false}.", 1: "y {false}."}
    with pytest.raises(ToolkitError) as err:
        validate(pooled)
    one_line(err, "stress.interferences.peer")


def test_ncb_clip_above_one_is_the_defect_it_guards(tmp_path):
    """clip=2 today: every NCB = 4.0 (P(y) and every neighbour's p floored at 2)."""
    from ncb.neighbourhoods import ncb_scores

    geo, arith = ncb_scores(np.array([0.3, 0.9]), [np.array([0.2, 0.7]), np.array([0.5])], clip=2.0)
    assert (geo == 4.0).all() and (arith == 4.0).all()


@pytest.fixture(scope="module")
def mini_pack(tmp_path_factory):
    """A CSV datapack of every statement about 14 real and 4 synthetic cities (and one of the real ones only)."""
    root = tmp_path_factory.mktemp("ncbz")
    real = pd.read_csv(DATA_DIR / "city_locations.csv", dtype=str, keep_default_na=False)
    fake = pd.read_csv(DATA_DIR / "city_locations_synthetic.csv", dtype=str, keep_default_na=False)
    real = real[real["object_1"].isin(real["object_1"].drop_duplicates().iloc[:14])]
    real.to_csv(root / "real.csv", index=False)
    pd.concat([real, fake[fake["object_1"].isin(fake["object_1"].drop_duplicates().iloc[:4])]]).to_csv(
        root / "cities.csv", index=False)
    return root, ["model=tiny", "data=csv", f"data.path={root / 'cities.csv'}", "data.name=mini", "method=zero_shot",
                  "n_boot=20", "zero_shot.batch_size=8", "zero_shot.save_every=1"]


def test_ncb_zero_shot_task_is_refused_before_the_zero_shot_scoring(mini_pack, tmp_path):
    from ncb.run import run

    root, common = mini_pack
    with pytest.raises(ToolkitError) as err:
        run(ncb_cfg(*common[1:], "zero_shot.task=bogus", f"results_dir={tmp_path / 'r'}"))
    one_line(err, "zero_shot.task")
    assert not (tmp_path / "r").exists()                 # the zero-shot scores were not computed first
    real = [o.replace("cities.csv", "real.csv") for o in common[1:]]     # no "neither": multiclass cannot be read
    with pytest.raises(ToolkitError) as err:
        run(ncb_cfg(*real, f"results_dir={tmp_path / 'r'}"))
    one_line(err, "task multiclass needs statements of every class")
    assert not (tmp_path / "r").exists()


def _stress_frame(n: int = 6) -> pd.DataFrame:
    from extract.statements import load_statements
    from contexts.interference import perturbations

    stress = OmegaConf.to_container(ncb_cfg("method=zero_shot").stress)
    table = load_statements("city_locations").iloc[:60]
    return perturbations(table, np.arange(3), stress["interferences"], stress["neutral"]).iloc[:n]


@pytest.mark.parametrize("kind", ["bytes", "truncated", "other_npz"])
def test_ncb_corrupt_stress_scores_are_discarded_with_one_line_and_redone(tmp_path, caplog, kind):
    from ncb.methods import score_prompts
    from zero_shot.prompts import get_enumeration

    cfg = ncb_cfg("method=zero_shot", "zero_shot.batch_size=2", "zero_shot.save_every=1")
    frame, enum = _stress_frame(), get_enumeration("default")
    whole = score_prompts(cfg, enum, frame, tmp_path / "a" / "stress_scores.npz")
    path = tmp_path / "b" / "stress_scores.npz"
    garbage(path, kind, tmp_path / "a" / "stress_scores.npz")
    with caplog.at_level(logging.WARNING):
        again = score_prompts(cfg, enum, frame, path)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and path.name in r.getMessage()]
    assert len(warned) == 1 and "\n" not in warned[0] and "discard" in warned[0], warned
    np.testing.assert_array_equal(again, whole)
    with np.load(path) as z:                             # the redone checkpoint replaced the garbage
        assert int(z["n_done"]) == len(frame)


def test_ncb_zero_shot_resumes_after_sigkill_bit_identical(mini_pack, tmp_path):
    root, common = mini_pack
    whole = cli("ncb", *common, f"results_dir={tmp_path / 'a'}", logs=tmp_path / "logs")
    assert whole.returncode == 0, whole.stderr[-3000:]
    args = [*common, f"results_dir={tmp_path / 'b'}"]
    killed = killed_run("ncb.methods.atomic_write", 2, "ncb", *args, logs=tmp_path / "logs1")
    out = Path("tiny") / "mini" / "ncb" / "zero_shot_default_multiclass_entity_disjoint"
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    with np.load(tmp_path / "b" / out / "stress_scores.npz") as z:
        assert 0 < int(z["n_done"]) < len(z["scores"])
    assert not (tmp_path / "b" / out / "stress.json").exists()
    done = cli("ncb", *args, logs=tmp_path / "logs2")
    assert done.returncode == 0, done.stderr[-3000:]
    for name in ("targets.json", "inputs.csv"):
        assert (tmp_path / "a" / out / name).read_bytes() == (tmp_path / "b" / out / name).read_bytes(), name
    a, b = (json.loads((tmp_path / d / out / "stress.json").read_text()) for d in "ab")
    assert a["results"] == b["results"] and a["counts"] == b["counts"]
    za, zb = (np.load(tmp_path / d / out / "stress_scores.npz") for d in "ab")
    np.testing.assert_array_equal(za["scores"], zb["scores"])


# --------------------------------------------------------------------- zero_shot options
@pytest.mark.parametrize("override, needle", [("overwrite=maybe", "overwrite"), ("evaluate=perhaps", "evaluate"),
                                              ("batch_size=abc", "batch_size"), ("batch_size=0", "batch_size"),
                                              ("alpha=2", "alpha"), ("rows=some", "rows="),
                                              ("bootstrap=blocks", "bootstrap="), ("enumeration=bogus", "bogus")])
def test_zero_shot_options_are_refused_in_one_line_before_any_work(tmp_path, override, needle):
    from toolkit.config import compose_config
    from zero_shot.run import run

    with pytest.raises(ToolkitError, match=needle) as err:
        run(compose_config("zero_shot", "model=tiny", f"results_dir={tmp_path / 'r'}", override))
    assert "\n" not in str(err.value) and not (tmp_path / "r").exists()


@pytest.mark.slow
def test_runs_started_together_under_one_results_dir_keep_their_own_log_folders(tmp_path):
    """One run and four refused runs started at once under a fresh results_dir (same second, so the same time
    stamp): each gets its own log folder (<time>-<pid>), the refused ones remove only theirs (and the folders
    they made while empty), and the run that works keeps its folder and its log."""
    from tests.helpers import make_synthetic_store

    make_synthetic_store(tmp_path / "activations")
    results = tmp_path / "results"
    common = [sys.executable, "-m", "train_probe", "model.name=synthetic", "probe=mean_diff", "layer=1",
              f"store_dir={tmp_path / 'activations'}", f"results_dir={results}", "trainer.accelerator=cpu"]
    runs = [subprocess.Popen([*common, "n_boot=20"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)]
    runs += [subprocess.Popen([*common, "n_boot=0"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(4)]
    outcomes = [(run.wait(timeout=600), run.stderr.read()) for run in runs]
    assert outcomes[0][0] == 0, outcomes[0][1][-2000:]
    assert all(code == 1 and "n_boot" in err for code, err in outcomes[1:]), [o[1][-500:] for o in outcomes[1:]]
    folders = list((results / "logs" / "train_probe").iterdir())
    assert len(folders) == 1 and folders[0].name.endswith(f"-{runs[0].pid}")
    assert any(f.suffix == ".log" and f.stat().st_size for f in folders[0].iterdir())
