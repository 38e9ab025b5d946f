"""Saved probes: a cell's artifact, loaded in a fresh process with the Python API, scores the store's
test rows exactly as the cell did (scores and probabilities to 1e-6, the same conformal sets)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import numpy as np
import pytest

from evaluation.cells import CellError, read_cell
from toolkit.config import compose_config
from probes.artifacts import load_probe
from probes.saved_pair import artifact_path
from probes.pipeline import train_probes
from tests.helpers import make_synthetic_store

ROOT = Path(__file__).resolve().parent.parent
CASES = [("linear", "true_vs_all", []), ("linear", "multiclass", []), ("mlp", "true_vs_all", []),
         ("mean_diff", "neither_vs_all", []), ("samil", "true_vs_false", ["probe.C=100"]),
         ("mean_diff", "true_vs_all", ["conformal=reference"])]

# what a user runs in a notebook: no Hydra, no pipeline, only the store and the saved probe
SCORE_IN_FRESH_PROCESS = """
import json, sys
import numpy as np
from evaluation.tasks import task_targets
from extract.store import ActivationStore
from probes.artifacts import load_probe
from probes.features import TOKEN_KINDS
store_path, out = sys.argv[1], {}
store = ActivationStore(store_path)
for cell_path in sys.argv[2:]:
    probe = load_probe(cell_path)
    cell = json.load(open(cell_path))
    rows, _ = task_targets(store.table["label"].to_numpy(), cell["config"]["task"]["name"])
    test_rows = rows[cell["test"]["rows"]]
    kinds = TOKEN_KINDS[probe.tokens]
    if probe.representation == "bags":
        X, offsets = store.bags(probe.layer, kinds)
        starts, ends = offsets[:-1][test_rows], offsets[1:][test_rows]
        X = np.concatenate([X[a:b] for a, b in zip(starts, ends)])
        data = (X, np.concatenate([[0], np.cumsum(ends - starts)]))
    else:
        data = store.last_token(probe.layer, kinds)[test_rows]
    out[cell_path] = {"scores": probe.decision_function(data).tolist(), "probs": probe.predict_proba(data).tolist(),
                      "sets": probe.predict_set(data).astype(int).tolist(),
                      "pred": probe.predict_with_abstention(data).tolist()}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("artifacts")
    store = make_synthetic_store(root / "activations", n_real=400, n_neither=200)
    run = partial(compose_config, "train_probe", "model.name=synthetic", f"store_dir={root / 'activations'}",
                  f"results_dir={root / 'results'}", "n_boot=20", "layer=1")
    cells = [train_probes(run(f"probe={p}", f"task={t}", *extra))[0] for p, t, extra in CASES]
    return store, cells


def test_loaded_probe_scores_the_test_rows_as_the_cell(trained):
    store, cells = trained
    for cell in cells:
        assert artifact_path(cell).stat().st_size < 200_000   # a few KB per linear head; the MLP ~150 KB
    done = subprocess.run([sys.executable, "-c", SCORE_IN_FRESH_PROCESS, str(store), *map(str, cells)], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    fresh = json.loads(done.stdout.strip().splitlines()[-1])
    for cell in cells:
        test, got = read_cell(cell)["test"], fresh[str(cell)]
        np.testing.assert_allclose(got["scores"], test["scores"], atol=1e-6, rtol=1e-6)
        np.testing.assert_allclose(got["probs"], test["probs"], atol=1e-6)
        assert got["sets"] == test["sets"] and got["pred"] == test["pred"], cell


def test_saving_a_probe_over_an_evaluated_cell_is_refused(trained, tmp_path):
    _, cells = trained
    cell, before = cells[-1], cells[-1].read_bytes()
    probe = load_probe(cell)
    with pytest.raises(CellError, match="evaluated result cell"):
        probe.save(cell)
    assert cell.read_bytes() == before and read_cell(cell)["metrics"]          # the evaluation is kept
    again = probe.save(tmp_path / "mine.json")                                # elsewhere: saved, and resaved
    assert probe.save(again) == again and load_probe(again).layer == probe.layer


def test_loading_takes_either_file_and_refuses_a_missing_probe(trained):
    _, cells = trained
    a, b = load_probe(cells[0]), load_probe(artifact_path(cells[0]))
    X = np.random.default_rng(0).standard_normal((5, a.heads[0].mean.numel())).astype(np.float32)
    np.testing.assert_array_equal(a.decision_function(X), b.decision_function(X))
    artifact_path(cells[0]).unlink()
    with pytest.raises(CellError, match="no saved probe"):
        load_probe(cells[0])


def test_a_write_removes_temporaries_of_dead_writers_of_this_host_only(tmp_path):
    import socket

    from toolkit.disk import atomic_write

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()
    stale = tmp_path / f".tmp-{host}-{dead.pid}-abc.json"          # SIGKILLed mid-write
    live = tmp_path / f".tmp-{host}-{os.getpid()}-def.json"        # a writer still running
    remote = tmp_path / f".tmp-{host}x-{dead.pid}-ghi.json"        # another host's (shared file system)
    for p in (stale, live, remote):
        p.write_bytes(b"part")
    atomic_write(tmp_path / "cell.json", lambda f: f.write(b"{}"))
    assert (tmp_path / "cell.json").read_bytes() == b"{}"
    assert not stale.exists() and live.exists() and remote.exists()
