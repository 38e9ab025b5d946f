"""Fault injection on the reports (report, compare, cross_model, transfer's writer): real full and
read-only disks (small tmpfs mounts, root), cells copied under the wrong folder or hand-edited (NaN, a
block removed), bad options and Hydra's own errors. Each shows that nothing was lost or mixed: the old
report stays byte-identical or the new one is whole, a refused cell is named in one line, exit 1."""
from __future__ import annotations

import hashlib
import json
import logging
import shutil
from functools import partial
from pathlib import Path

import pytest

from evaluation.cells import CellError
from experiments import compare as compare_module
from experiments.cross_model import cross_model, write_cross_model
from experiments.report import report, write_report
from experiments.tables import ReportError, load_cells, publish
from toolkit.config import compose_config
from toolkit.errors import ToolkitError, hydra_error_line
from probes.pipeline import train_probes
from tests.helpers import assert_one_error_line, fill_disk, make_depth_store, make_synthetic_store, run_module, tmpfs

CELL = Path("synthetic/city_locations/linear/true_vs_all/entity_disjoint/layer=1/seed=0.json")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    """results_dir with mean_diff and linear true_vs_all cells at layers 0 and 1 of the synthetic store."""
    root = tmp_path_factory.mktemp("report_faults")
    make_synthetic_store(root / "activations", n_real=200, n_neither=100)
    run = partial(compose_config, "train_probe", "model.name=synthetic", f"store_dir={root / 'activations'}",
                  f"results_dir={root / 'results'}", "n_boot=20", "layer=all", "task=true_vs_all")
    for probe in ("mean_diff", "linear"):
        train_probes(run(f"probe={probe}"))
    return root / "results"


def _copy(results: Path, tmp_path: Path) -> Path:
    shutil.copytree(results, tmp_path / "results", ignore=shutil.ignore_patterns(".*.lock"))
    return tmp_path / "results"


def _edit(path: Path, change) -> None:
    cell = json.loads(path.read_text())
    change(cell)
    path.write_text(json.dumps(cell))   # json writes NaN as NaN, as a hand edit would


def _digests(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _report_cli(results: Path, reports: Path, tmp_path: Path, *extra: str):
    return run_module("experiments.report", "model.name=synthetic", "data=city_locations", f"results_dir={results}",
                      f"reports_dir={reports}", *extra, cwd=tmp_path)


# ------------------------------------------------------------------ data loss: the report's writer
def test_report_on_a_full_disk_keeps_the_old_report_then_the_rerun_writes_it_whole(results, tmp_path):
    """A full reports_dir: one line, exit 1, the earlier report byte-identical (no new table beside old
    PNGs, no cut PNG) and no staging folder left; with space again the rerun replaces it whole."""
    results = _copy(results, tmp_path)
    with tmpfs(tmp_path / "disk", "3m") as disk:
        old = write_report(results, disk, "synthetic", "city_locations")
        before = _digests(old)
        assert {"layers.csv", "best.md", "mcc_by_layer.png", "reliability.png"} <= set(before)
        _edit(results / CELL, lambda c: c["metrics"].update(mcc=0.5))          # the new report differs
        filler = fill_disk(disk)
        with filler.open("r+b") as f:                                          # room for the tables only
            f.truncate(filler.stat().st_size - 40 * 1024)
        done = _report_cli(results, disk, tmp_path)
        assert_one_error_line(done, "cannot write the report")
        assert _digests(old) == before
        assert sorted(p.name for p in disk.iterdir()) == ["filler", "synthetic"]
        assert [p.name for p in (disk / "synthetic").iterdir()] == ["city_locations"]   # no staging folder
        filler.unlink()
        new = write_report(results, disk, "synthetic", "city_locations")
        after = _digests(new)
        assert set(after) == set(before) and after["layers.csv"] != before["layers.csv"]
        assert [p.name for p in (disk / "synthetic").iterdir()] == ["city_locations"]


def test_first_report_on_a_full_disk_writes_nothing(results, tmp_path):
    """A fresh, full reports_dir: one line, exit 1, and no folder or (0-byte) file of the report."""
    with tmpfs(tmp_path / "disk", "1m") as disk:
        fill_disk(disk)
        done = _report_cli(results, disk / "reports", tmp_path)
        assert_one_error_line(done, "cannot write the report")
        assert [p.name for p in disk.iterdir()] == ["filler"]


def test_read_only_reports_dir_is_one_line_before_any_work(results, tmp_path):
    with tmpfs(tmp_path / "disk", "1m", "ro") as disk:
        done = _report_cli(results, disk / "reports", tmp_path)
        assert_one_error_line(done, f"reports_dir={disk / 'reports'}")
        assert "report written" not in done.stderr


def test_publish_failure_inside_the_build_leaves_the_old_folder(tmp_path):
    """The one writer of every report: a build that raises leaves the old folder as it was and no
    staging folder; a whole build replaces the folder (old files gone); whole_folder=False replaces
    only the files it writes."""
    out = tmp_path / "m" / "r"
    publish(out, lambda f: (f / "a.csv").write_text("old"))

    def broken(folder):
        (folder / "a.csv").write_text("new")
        raise OSError(28, "No space left on device")

    with pytest.raises(ReportError, match="No space left on device"):
        publish(out, broken)
    assert (out / "a.csv").read_text() == "old" and [p.name for p in out.parent.iterdir()] == ["r"]
    publish(out, lambda f: (f / "b.csv").write_text("new"))
    assert [p.name for p in out.iterdir()] == ["b.csv"]
    publish(out.parent, lambda f: (f / "t.csv").write_text("t"), whole_folder=False)
    assert sorted(p.name for p in out.parent.iterdir()) == ["r", "t.csv"] and (out / "b.csv").exists()


# ------------------------------------------------------------- wrong result: path vs content
def test_a_cell_copied_under_another_folder_is_refused_naming_the_file(results, tmp_path):
    """A city cell copied under med_indications' folder, or under another seed's name, would be counted
    as another datapack's cell or a further seed: refused, one line naming the file and the mismatch."""
    results = _copy(results, tmp_path)
    moved = results / str(CELL).replace("city_locations", "med_indications")
    moved.parent.mkdir(parents=True)
    shutil.copy(results / CELL, moved)
    with pytest.raises(CellError, match=r"datapack=city_locations") as err:
        write_report(results, tmp_path / "reports", "synthetic", "med_indications")
    assert str(moved) in str(err.value) and "\n" not in str(err.value)
    moved.unlink()
    extra = (results / CELL).with_name("seed=2.json")
    shutil.copy(results / CELL, extra)
    with pytest.raises(CellError, match=r"seed=0") as err:
        load_cells(results, "synthetic", "city_locations")
    assert str(extra) in str(err.value)
    assert not (tmp_path / "reports").exists()


# ------------------------------------------------------------------ tracebacks -> one line
@pytest.mark.parametrize("case,change,needle", [
    ("NaN MCC", lambda c: c["metrics"].update(mcc=float("nan")), "metrics.mcc is not a finite number"),
    ("NaN calibration MCC", lambda c: c["calibration_metrics"].update(mcc_all=float("nan")),
     "calibration_metrics.mcc_all is not a finite number"),
    ("no split block", lambda c: c.pop("split"), "has no split.kind"),
])
def test_report_refuses_a_damaged_cell_in_one_line(results, tmp_path, case, change, needle):
    results = _copy(results, tmp_path)
    _edit(results / CELL, change)
    with pytest.raises(CellError, match=needle) as err:
        write_report(results, tmp_path / "reports", "synthetic", "city_locations")
    assert str(results / CELL) in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "reports").exists()


def _compare(caplog, *argv: str) -> str:
    """experiments.compare's main: the one error line it exits 1 with."""
    caplog.clear()
    with caplog.at_level(logging.ERROR), pytest.raises(SystemExit) as stop:
        compare_module.main(list(argv))
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert stop.value.code == 1 and len(errors) == 1 and "\n" not in errors[0], errors
    return errors[0]


def test_compare_refuses_nan_and_a_non_positive_n_boot(results, tmp_path, caplog):
    results = _copy(results, tmp_path)
    other = results / str(CELL).replace("linear", "mean_diff")
    for n_boot in ("0", "-5"):
        assert "--n-boot" in _compare(caplog, str(results / CELL), str(other), "--n-boot", n_boot)
    _edit(results / CELL, lambda c: c["test"]["probs"][0].__setitem__(0, float("nan")))
    assert f"{results / CELL}: test.probs[0][0] is not a finite number" in _compare(caplog, str(results / CELL),
                                                                                   str(other))


# ------------------------------------------------------------------------------ cross_model
@pytest.fixture(scope="module")
def one_quarter(tmp_path_factory) -> Path:
    """results_dir of a model whose stored layers (5, 6 of 8) all lie in depth Q3."""
    root = tmp_path_factory.mktemp("one_quarter")
    make_depth_store(root / "activations", "toy-q", [5, 6], 8, 6, n_real=150, n_neither=75)
    train_probes(compose_config("train_probe", "model.name=toy-q", f"store_dir={root / 'activations'}",
                                f"results_dir={root / 'results'}", "n_boot=20", "layer=all", "probe=mean_diff",
                                "task=true_vs_all"))
    return root / "results"


def test_cross_model_on_cells_in_one_depth_quarter(one_quarter, tmp_path):
    """No layer outside Q3: the Q3-vs-rest comparison is empty (NaN), not a KeyError; also via report."""
    out = write_cross_model(one_quarter, tmp_path / "reports", ["toy-q"], ["city_locations"], n_boot=20)
    assert (out / "claims.md").stat().st_size > 0
    report(compose_config("report", "model.name=toy-q", f"results_dir={one_quarter}",
                          f"reports_dir={tmp_path / 'via_report'}", "cross_model=[toy-q]"))
    assert (tmp_path / "via_report" / "cross_model" / "claims.csv").stat().st_size > 0


def test_cross_model_options_are_typed_and_split_is_settable(one_quarter, tmp_path, caplog):
    run = partial(compose_config, "cross_model", "models=[toy-q]", "datapacks=[city_locations]",
                  f"results_dir={one_quarter}", f"reports_dir={tmp_path / 'reports'}")
    with pytest.raises(ToolkitError, match=r"^n_boot: .*give n_boot= a whole number >= 1$"):
        cross_model(run("n_boot=abc"))
    with pytest.raises(ToolkitError, match="n_boot=0 is not a whole number"):
        cross_model(run("n_boot=0"))
    with caplog.at_level(logging.INFO), pytest.raises(CellError, match="no result cells"):
        cross_model(run("split=reference", "n_boot=20"))          # the documented split= selects the cells read
    assert "no reference probe cells for toy-q / city_locations" in caplog.text
    assert cross_model(run("split=entity_disjoint", "n_boot=20")).is_dir()


# -------------------------------------------------------------------- Hydra's errors, callbacks
def test_hydra_errors_and_callback_overrides_are_one_line(one_quarter, tmp_path):
    cases = {("experiments.report", "model=nonexistent"): "Available options in 'model': gemma3-270m, llama, smollm2",
             ("experiments.report", "+hydra.callbacks.x._target_=builtins.print"): "Hydra callbacks cannot be set",
             ("experiments.cross_model", "+split=reference"): "Multiple values for split",
             ("experiments.transfer", "nosuchkey=1"): "Could not override 'nosuchkey'"}
    for (module, override), needle in cases.items():
        done = run_module(module, f"results_dir={one_quarter}", f"reports_dir={tmp_path / 'reports'}", override,
                          cwd=tmp_path)
        assert_one_error_line(done, needle)
        assert "HYDRA_FULL_ERROR" not in done.stderr and "Config search path" not in done.stderr
    assert not (tmp_path / "reports").exists()


@pytest.mark.parametrize("module", ["extract", "train_probe", "apply_probe", "zero_shot", "truthfulqa", "ncb"])
def test_every_entry_point_prints_hydra_errors_and_refuses_callbacks_in_one_line(module, tmp_path):
    done = run_module(module, "model=nonexistent", cwd=tmp_path)
    assert_one_error_line(done, "nonexistent")   # apply_probe has no model group: another Hydra error, one line
    assert "Config search path" not in done.stderr and "HYDRA_FULL_ERROR" not in done.stderr
    done = run_module(module, "+hydra.callbacks.x._target_=builtins.print", cwd=tmp_path)
    assert_one_error_line(done, "Hydra callbacks cannot be set")


def test_hydra_error_line_joins_the_options():
    from hydra.errors import MissingConfigException

    err = MissingConfigException("In 'report': Could not find 'model/x'\n\nAvailable options in 'model':\n\ta\n\tb\n"
                                 "Config search path:\n\tprovider=hydra, path=pkg://hydra.conf")
    assert hydra_error_line(err) == "In 'report': Could not find 'model/x'; Available options in 'model': a, b"
