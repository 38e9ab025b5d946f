"""Saved probes and apply_probe against hostile input (issue 24): a pair whose hash is consistent but
whose content cannot make a working probe (hand-crafted: the test regenerates the hash), options that
the typed schema cannot read, text that is not a statement, and fit_probe / FittedProbe inputs that
would fail deep inside torch or be scored as silent abstentions. Each is one line, nothing written."""
from __future__ import annotations

import hashlib
import json
import re
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from probes.apply import apply, apply_to_store
from evaluation.cells import CellError, read_cell
from evaluation.splits import entity_groups, make_split
from toolkit.errors import ToolkitError
from extract.store import ActivationStore
from probes.artifacts import fit_probe, load_probe
from probes.saved_pair import artifact_path
from probes.base import ProbeError
from probes.pipeline import train_probes
from tests.helpers import assert_one_error_line, compose_apply, make_synthetic_store, run_cfg, run_module

D = 24   # the synthetic store's hidden size


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("apply_faults")
    make_synthetic_store(root / "activations", n_real=300, n_neither=150)
    return root


@pytest.fixture(scope="module")
def cells(dirs) -> dict[str, Path]:
    """mean_diff true_vs_all cells on the synthetic store: LAC and reference conformal sets."""
    run = partial(run_cfg, dirs, "probe=mean_diff", "task=true_vs_all", "layer=1", "n_boot=10")
    return {"lac": train_probes(run())[0],
            "reference": train_probes(run("conformal=reference", f"results_dir={dirs / 'reference'}"))[0]}


@pytest.fixture(scope="module")
def data(dirs):
    """X [n, d] (layer 1, last statement token), labels, groups and the entity-disjoint split."""
    store = ActivationStore(dirs / "activations" / "synthetic" / "city_locations.h5")
    return (store.last_token(1), store.table["label"].to_numpy(), entity_groups(store.table),
            make_split(store.table, "entity_disjoint"))


def crafted_pair(src: Path, folder: Path, edit_cell=None, edit_tensors=None) -> Path:
    """A copy of the pair `src` edited by hand, its heads' sha256 and size recomputed so that the hash
    check passes (a crafted pair, not a damaged one); the cell is written as plain JSON (NaN allowed)."""
    folder.mkdir(parents=True)
    cell, tensors = read_cell(src), load_tensors(artifact_path(src).read_bytes())
    if edit_tensors:
        tensors = edit_tensors(tensors)
    blob = save_tensors(tensors)
    digest = hashlib.sha256(blob).hexdigest()
    heads = folder / f"seed=0.{digest[:16]}.probe.safetensors"
    heads.write_bytes(blob)
    cell["heads"] = {"file": heads.name, "sha256": digest, "bytes": len(blob)}
    if edit_cell:
        edit_cell(cell)
    path = folder / "seed=0.json"
    path.write_text(json.dumps(cell))
    return path


def _scaled(tensors, factor):
    return {k: v * factor if v.numel() > 1 else v for k, v in tensors.items()}


CRAFTED = {   # name: (which cell, edit of the cell, edit of its heads, what the one line says)
    "no_probe_params": ("lac", lambda c: c.pop("probe_params"), None, "no probe_params block"),
    "nan_weights": ("lac", None, lambda t: _scaled(t, float("nan")), "NaN or inf in head0.direction"),
    "wrong_width": ("lac", None, lambda t: {k: torch.zeros(D + 6) if v.numel() > 1 else v for k, v in t.items()},
                    f"width [{D + 6}], but the store it records has hidden_size {D}"),
    "extra_head": ("lac", None, lambda t: {**t, **{k.replace("head0", "head1"): v.clone() for k, v in t.items()}},
                   "2 head(s), probe_params 1"),
    "missing_tensor": ("lac", None, lambda t: {k: v for k, v in t.items() if k.endswith("direction")},
                       "Missing key(s)"),
    "function_target": ("lac", lambda c: c["config"]["probe"].update(_target_="probes.artifacts.load_probe"), None,
                        "is a function, not a Probe class"),
    "missing_module": ("lac", lambda c: c["config"]["probe"].update(_target_="probes.nope.Probe"), None,
                       "cannot be imported"),
    "nan_thresholds": ("lac", lambda c: c["conformal"].update(thresholds=[float("nan")] * 2), None,
                       "conformal.thresholds"),
    "threshold_above_one": ("lac", lambda c: c["conformal"].update(thresholds=[7.0, 7.0]), None,
                            "thresholds in [0, 1]"),
    "alpha_out_of_range": ("lac", lambda c: c["conformal"].update(alpha=1.5), None, "conformal.alpha=1.5"),
    "nan_reference_scores": ("reference", lambda c: c["conformal"]["calibration_scores"].__setitem__(0, float("nan")),
                             None, "conformal.calibration_scores"),
    "unsorted_reference_scores": ("reference", lambda c: c["conformal"]["calibration_scores"].reverse(), None,
                                  "not sorted"),
    "no_conformal": ("lac", lambda c: c.pop("conformal"), None, "no conformal block"),
    "bad_score_map": ("lac", lambda c: c["calibration"].update(map={"x": 1}), None, "not a score map"),
    "nan_score_map": ("lac", lambda c: c["calibration"]["map"].update(intercept=[float("nan")]), None,
                      "NaN or inf scores or probabilities"),
}


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_a_crafted_pair_with_a_consistent_hash_is_refused_in_one_line(cells, tmp_path, case):
    which, edit_cell, edit_tensors, needle = CRAFTED[case]
    path = crafted_pair(cells[which], tmp_path / case, edit_cell, edit_tensors)
    with pytest.raises(CellError, match=re.escape(needle)) as err:
        load_probe(path)
    assert "\n" not in str(err.value) and str(path) in str(err.value)


def test_apply_probe_refuses_a_crafted_pair_and_writes_nothing(dirs, cells, tmp_path):
    """NaN thresholds used to make every statement abstain, exit 0; NaN weights likewise."""
    for case in ("nan_thresholds", "nan_weights", "no_probe_params"):
        _, edit_cell, edit_tensors, needle = CRAFTED[case]
        path = crafted_pair(cells["lac"], tmp_path / case, edit_cell, edit_tensors)
        with pytest.raises(CellError, match=re.escape(needle)):
            apply_to_store(path, "city_locations", dirs / "activations", tmp_path / "results")
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize("case,needle", [("nan_thresholds", "conformal.thresholds"),
                                         ("function_target", "not a Probe class")])
def test_cli_crafted_pair_is_one_line_exit_1(dirs, cells, tmp_path, case, needle):
    _, edit_cell, edit_tensors, _ = CRAFTED[case]
    path = crafted_pair(cells["lac"], tmp_path / "pair", edit_cell, edit_tensors)
    done = run_module("apply_probe", f"probe={path}", "data=csv", "data.name=city_locations",
                      f"store_dir={dirs / 'activations'}", f"results_dir={tmp_path / 'results'}", cwd=tmp_path)
    assert_one_error_line(done, needle)
    assert not (tmp_path / "results").exists()


def test_overwrite_goes_through_the_typed_schema(dirs, cells, tmp_path):
    """overwrite=no used to be a truthy string (the transfer cell was recomputed); overwrite=maybe is
    refused in one line before any work."""
    base = (f"probe={cells['lac']}", "data=csv", "data.name=city_locations", f"store_dir={dirs / 'activations'}",
            f"results_dir={tmp_path / 'results'}")
    path = apply(compose_apply(*base))
    before = path.read_bytes(), path.stat().st_mtime_ns
    for value in ("no", "false", "off"):
        assert apply(compose_apply(*base, f"overwrite={value}")) == path
        assert (path.read_bytes(), path.stat().st_mtime_ns) == before, value
    with pytest.raises(ToolkitError, match="overwrite: .*'maybe'.*true or false") as err:
        apply(compose_apply(*base, "overwrite=maybe"))
    assert "\n" not in str(err.value) and (path.read_bytes(), path.stat().st_mtime_ns) == before
    fresh = tmp_path / "fresh"
    with pytest.raises(ToolkitError, match="batch_tokens"):
        apply(compose_apply(*base[:-1], f"results_dir={fresh}", "batch_tokens=abc"))
    assert not fresh.exists()
    assert apply(compose_apply(*base, "overwrite=true")) == path and path.stat().st_mtime_ns != before[1]


def test_cli_overwrite_maybe_is_one_line_exit_1(dirs, cells, tmp_path):
    done = run_module("apply_probe", f"probe={cells['lac']}", "data=csv", "data.name=city_locations",
                      f"store_dir={dirs / 'activations'}", f"results_dir={tmp_path / 'results'}", "overwrite=maybe",
                      cwd=tmp_path)
    assert_one_error_line(done, "overwrite")
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize("text,needle", [("[1, null, {a: b}]", "item 1 is 1 (int)"),
                                         ("['Paris is in France.', null]", "item 2 is None"),
                                         ("['Paris is in France.', {a: b}]", "item 2 is {'a': 'b'} (dict)")])
def test_text_items_that_are_not_strings_are_refused(cells, tmp_path, text, needle):
    """They used to be scored as "1", "None", "{'a': 'b'}"."""
    with pytest.raises(ToolkitError, match=re.escape(needle)) as err:
        apply(compose_apply(f"probe={cells['lac']}", f"text={text}", f"results_dir={tmp_path / 'results'}"))
    assert "\n" not in str(err.value) and not (tmp_path / "results").exists()


def test_an_explicit_bad_name_is_refused_before_any_work(cells, tmp_path):
    with pytest.raises(ToolkitError, match="name='my scores'") as err:
        apply(compose_apply(f"probe={cells['lac']}", "text=Paris is in France.", "name=my scores",
                            f"results_dir={tmp_path / 'results'}"))
    assert "\n" not in str(err.value) and not (tmp_path / "results").exists()


# ---------------------------------------------------------------------------------------------------
# fit_probe / FittedProbe: inputs checked at the API's edge
# ---------------------------------------------------------------------------------------------------
def _fit_cases(X, labels, groups, split):
    train, cal = split.train, split.calibration
    nan_X = X.copy()
    nan_X[train[3], 5] = np.nan
    return {
        "1-D X": (("mean_diff", X[:, 0], labels, train, cal), {}, "X has shape"),
        "NaN X": (("mean_diff", nan_X, labels, train, cal), {}, f"NaN or inf in 1 statement.*rows {train[3]}"),
        "short y": (("mean_diff", X, labels[:100], train, cal), {}, "y has shape \\(100,\\)"),
        "NaN y": (("mean_diff", X, labels + np.nan, train, cal), {}, "whole-number labels"),
        "short groups": (("mean_diff", X, labels, train, cal), {"groups": groups[:10]}, "groups has shape \\(10,\\)"),
        "row past the end": (("mean_diff", X, labels, np.r_[train, len(X)], cal), {}, f"train holds row {len(X)}"),
        "negative row": (("mean_diff", X, labels, train, np.r_[cal, -1]), {}, "cal holds row -1"),
        "fractional rows": (("mean_diff", X, labels, train + 0.5, cal), {}, "whole row numbers"),
        "no cal rows": (("mean_diff", X, labels, train, []), {}, "cal must be a non-empty"),
        "train and cal overlap": (("mean_diff", X, labels, train, train[:20]), {}, "share 20 row"),
        "decreasing offsets": (("samil", (X, np.array([0, 5, 3, len(X)])), labels[:3], [0], [1]), {},
                               "offsets decrease"),
        "offsets short of the tokens": (("samil", (X, np.array([0, 5, 10])), labels[:2], [0], [1]), {},
                                        f"run from 0 to 10.*end at {len(X)}"),
        "vectors for a bag probe": (("samil", X, labels, train, cal), {}, "reads token bags"),
        "bags of one NaN token": (("samil", (np.r_[X, np.full((1, D), np.nan)], np.r_[np.arange(len(X)), len(X) + 1]),
                                   labels, train, cal), {}, f"rows {len(X) - 1}\\)"),
        "function target": (({"_target_": "probes.artifacts.load_probe"}, X, labels, train, cal), {},
                            "not a Probe class"),
        "missing module": (({"_target_": "probes.nope.Probe"}, X, labels, train, cal), {}, "cannot be imported"),
        "missing class": (({"_target_": "probes.linear.Nope"}, X, labels, train, cal), {}, "no Nope in probes.linear"),
        "one fold": (("mean_diff", X, labels, train, cal), {"calibration_folds": 1}, "calibration_folds=1"),
    }


def test_fit_probe_checks_its_inputs_in_one_line(data):
    """Each case used to fail deep inside numpy / torch (or, for negative and fractional rows and
    overlapping splits, to fit silently on the wrong rows)."""
    for name, (args, kwargs, needle) in _fit_cases(*data).items():
        with pytest.raises(ProbeError, match=needle) as err:
            fit_probe(*args, **kwargs)
        assert "\n" not in str(err.value), name


def test_a_fitted_probe_refuses_what_it_cannot_score(data, cells):
    X, labels, groups, split = data
    fitted = fit_probe("mean_diff", X, labels, split.train, split.calibration, classes=[1], groups=groups, layer=1)
    loaded = load_probe(cells["lac"])
    nan_rows = X[:6].copy()
    nan_rows[[1, 4], 0] = np.nan
    for probe in (fitted, loaded):
        assert probe.n_features == D
        for bad, needle in [(X[:, :5], f"X has 5 columns but the probe reads {D}: give layer 1's vectors"),
                            (X[0], "X has shape \\(24,\\).*X\\[None, :\\]"),
                            (nan_rows, "NaN or inf in 2 statement.*rows 1, 4")]:
            for method in (probe.predict, probe.predict_proba, probe.score_all):
                with pytest.raises(ProbeError, match=needle) as err:
                    method(bad)   # NaN rows used to abstain silently (pred -1), a wrong width a torch error
                assert "\n" not in str(err.value)
        assert probe.predict(X[:6]).shape == (6,)
    samil = fit_probe("samil", (X, np.arange(len(X) + 1)), labels, split.train, split.calibration, classes=[1],
                      groups=groups, C=100.0)
    with pytest.raises(ProbeError, match="reads token bags"):
        samil.predict(X[:3])
    assert samil.predict((X[:3], np.arange(4))).shape == (3,)


def test_a_saved_probe_still_round_trips(data, tmp_path):
    """The checks refuse only what is wrong: a fitted probe saved and loaded scores as before."""
    X, labels, groups, split = data
    probe = fit_probe("linear", X, labels, split.train, split.calibration, classes=[1], groups=groups, layer=1)
    loaded = load_probe(probe.save(tmp_path / "mine.json"))
    np.testing.assert_array_equal(loaded.decision_function(X), probe.decision_function(X))
    assert loaded.predict(X).tolist() == probe.predict(X).tolist()
