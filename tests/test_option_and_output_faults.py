"""Issue 50 (third sweep), the cases fixed at the typed schema, the Hydra callbacks, the report and the split:
each fails on the code before it. Read-only output folders are one line (Hydra made its log folder first);
empty and repeated lists, numbers for booleans, an empty C grid and bad `classes` are one line before any
work; a dry run leaves no file and says what the run would refuse; a report names cells of mixed settings
and stored layers without a cell; deletion is advised only for a damaged cell; a split of statements
without entities says so."""
from __future__ import annotations

import logging
import re
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from evaluation.cells import CellError, read_cell
from evaluation.splits import make_split
from experiments.report import write_report
from toolkit.config import compose_config
from toolkit.errors import ToolkitError
from probes.base import ProbeError
from probes.pipeline import make_probe, train_probes
from tests.helpers import ROOT, assert_one_error_line, make_synthetic_store, run_cfg, tmpfs

TINY = ("model=tiny", "data=city_locations")


@pytest.fixture()
def read_only(tmp_path):
    with tmpfs(tmp_path / "ro", "1m", "ro") as folder:
        yield folder


@pytest.mark.parametrize("entry,args", [
    ("extract", [*TINY, "limit=40", "store_dir={ro}"]),
    ("train_probe", [*TINY, "layer=2", "store_dir={tmp}", "results_dir={ro}"]),
    ("train_probe", ["-m", *TINY, "probe=linear,mean_diff", "layer=2", "store_dir={tmp}", "results_dir={ro}"]),
    ("zero_shot", [*TINY, "results_dir={ro}/below"]),
])
def test_a_read_only_output_folder_is_one_line_not_hydras_traceback(read_only, tmp_path, entry, args):
    argv = [a.format(ro=read_only, tmp=tmp_path) for a in args]   # no hydra.run.dir: the default, under the folder
    done = subprocess.run([sys.executable, "-m", entry, *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    option = "store_dir" if entry == "extract" else "results_dir"
    assert_one_error_line(done, f"{option}=")
    assert "not a writable folder" in done.stderr


@pytest.mark.parametrize("config,args,needle", [
    ("train_probe", ["tasks=[]"], "tasks=[]: give at least one"),
    ("train_probe", ["tasks=[multiclass,multiclass]"], "listed more than once"),
    ("train_probe", ["overwrite=1"], "overwrite=1: use true or false"),
    ("train_probe", ["tasks=multiclass"], "tasks: 'multiclass' is not a list"),   # was "AnyNode is not a ListConfig"
    ("zero_shot", ["modes=[]"], "modes=[]: give at least one, e.g. modes=[argmax,conformal]"),
    ("zero_shot", ["tasks=[]"], "tasks=[]: give at least one"),
    ("extract", ["overwrite=0"], "overwrite=0: use true or false"),
    ("extract", ["dry_run=1"], "dry_run=1: use true or false"),
])
def test_empty_or_repeated_lists_and_numbers_for_booleans_are_one_line(config, args, needle):
    from toolkit.entry import schema_of
    from toolkit.schema import typed_options

    cfg = compose_config(config, *TINY, *args)
    with pytest.raises(ToolkitError) as err:
        typed_options(cfg, schema_of(config))
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_the_words_true_false_yes_no_stay_booleans():
    from probes.schema import validate

    assert validate(compose_config("train_probe", *TINY, "overwrite=yes")).overwrite is True
    assert validate(compose_config("train_probe", *TINY, "overwrite=false")).overwrite is False


@pytest.mark.parametrize("probe,args,needle", [
    ("samil", ["probe.Cs=[]"], "Cs=[]: C is chosen from Cs by cross-validation"),   # was max() of an empty grid
    ("linear", ["probe.Cs=[]"], "Cs=[]"),
    ("linear", ["probe.Cs=[inf]"], "Cs=inf: use a finite number > 0"),
    ("samil", ["probe.Cs=[10,nan]"], "Cs=nan: use a finite number > 0"),
])
def test_a_c_grid_that_cannot_be_searched_is_one_line_before_any_work(probe, args, needle):
    with pytest.raises(ProbeError) as err:
        make_probe(compose_config("train_probe", *TINY, f"probe={probe}", *args))
    assert needle in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("classes,needle", [([], "classes=[]"), (["a"], "'a' is not a label of y"),
                                            ([5], "5 is not a label of y"), ([1, 1], "listed twice")])
def test_fit_probe_refuses_classes_it_cannot_fit(classes, needle):
    from probes.artifacts import fit_probe

    rng = np.random.default_rng(0)
    X, y = rng.standard_normal((60, 4)).astype(np.float32), np.tile([0, 1, 2], 20)
    with pytest.raises(ProbeError, match=re.escape(needle)):
        fit_probe("mean_diff", X, y, np.arange(40), np.arange(40, 60), classes=classes)


def test_a_dry_run_leaves_no_file_and_says_what_the_run_would_refuse(tmp_path):
    store_dir = tmp_path / "act"
    common = [sys.executable, "-m", "extract", *TINY, f"store_dir={store_dir}"]
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    first = subprocess.run([*common, "limit=40"], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert first.returncode == 0, first.stderr[-2000:]
    before = sorted(p.relative_to(store_dir) for p in store_dir.rglob("*"))
    dry = subprocess.run([*common, "limit=60", "dry_run=true"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env=env)
    assert dry.returncode == 0 and "nothing written" in dry.stderr, dry.stderr[-2000:]
    assert "the run would refuse the existing store" in dry.stderr and "n_statements=40" in dry.stderr
    assert sorted(p.relative_to(store_dir) for p in store_dir.rglob("*")) == before   # no new log folder either


def test_the_report_flags_cells_of_mixed_settings_and_names_layers_without_a_cell(tmp_path, caplog):
    make_synthetic_store(tmp_path / "activations", layers=(0, 1, 2), n_layers=2)
    train_probes(run_cfg(tmp_path, "probe=mean_diff", "layer=[0]"))
    train_probes(run_cfg(tmp_path, "probe=mean_diff", "layer=[1]", "alpha=0.3"))   # another setting at layer 1
    with caplog.at_level(logging.WARNING):
        out = write_report(tmp_path / "results", tmp_path / "reports", "synthetic", "city_locations")
    layers = pd.read_csv(out / "layers.csv")
    assert layers["flag"].fillna("").str.contains("mixed_settings").all()   # both layers: not comparable
    assert "alpha: 0.1 -> 0.3" in caplog.text or "alpha: 0.3 -> 0.1" in caplog.text
    cells = (out / "cells.md").read_text()
    assert "mean_diff true_vs_all entity_disjoint: 2 of 3 layers, missing 2" in cells
    assert "made at" in cells and "mixed settings" in cells and "mean_diff true_vs_all" in cells


def test_deletion_is_advised_only_for_a_damaged_cell(tmp_path):
    (tmp_path / "mine.csv").write_text("statement\nParis is in France.\n")
    damaged = tmp_path / "layer=1" / "seed=0.json"
    damaged.parent.mkdir()
    damaged.write_text('{"metrics": ')
    for path, needle in ((tmp_path, "is a folder, not a result cell"), (tmp_path / "mine.csv", "give a result cell"),
                         (damaged, "delete it and rerun")):
        with pytest.raises(CellError) as err:
            read_cell(path)
        assert needle in str(err.value)
        assert ("delete" in str(err.value)) == (path == damaged), str(err.value)


def test_a_split_of_statements_without_entities_says_so(caplog):
    table = pd.DataFrame({"statement": [f"Paris {i} is in France." for i in range(60)],
                          "label": np.tile([0, 1], 30), "object_1": "", "object_2": ""})
    with caplog.at_level(logging.WARNING):
        split = make_split(table)
    assert split.summary()["rows_without_entity"] == 60
    assert "60 of 60 statements name no entity" in caplog.text
    kept = make_split(table.assign(object_1=[f"c{i // 2}" for i in range(60)]))
    assert "rows_without_entity" not in kept.summary()   # (the datapacks' cells do not change)


def test_a_sweep_refuses_a_probe_listed_twice(tmp_path):
    from experiments.sweep import plan

    make_synthetic_store(tmp_path / "activations")
    with pytest.raises(ToolkitError, match="listed more than once"):
        plan(["model.name=synthetic", f"store_dir={tmp_path / 'activations'}"], ["mean_diff", "mean_diff"])


def test_count_options_suggest_a_valid_value():
    from toolkit.errors import check_count

    with pytest.raises(ToolkitError, match=r"give e.g. workers=1$"):
        check_count(0, "workers")
