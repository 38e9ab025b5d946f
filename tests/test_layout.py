"""The layout's promises: every probe's state_dict round trip restores it; names that become paths are
checked; nothing is built from a nested `_target_` on the command line; the report names a bad cell
in one line; zero_shot imports nothing from probes; no project file is over 460 lines."""
from __future__ import annotations

from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch

from toolkit.config import compose_config
from probes.features import Features
from probes.pipeline import make_probe
from tests.helpers import assert_one_error_line, run_module
from tests.helpers import make_synthetic_store

ROOT = Path(__file__).resolve().parent.parent


def _bags(n=120, d=16, seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(3, 8, n)
    offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]))
    y = (rng.random(n) < 0.5).astype(np.int64)
    X = rng.standard_normal((int(offsets[-1]), d)).astype(np.float32)
    X[offsets[1:].numpy()[y == 1] - 1, 0] += 4.0  # the last token of a positive bag
    return Features(torch.from_numpy(X), offsets, rng.integers(0, 30, n)), y


@pytest.mark.parametrize("name", ["linear", "mlp", "mean_diff", "samil", "ttpd", "spca", "ccs"])
def test_state_dict_round_trip_restores_every_probe(name):
    overrides = {"linear": ["probe.cv_folds=2"], "mlp": ["probe.max_epochs=5", "probe.depth=2"],
                 "mean_diff": [], "samil": ["probe.C=100"], "ttpd": [], "spca": [], "ccs": ["probe.epochs=20"]}[name]
    cfg = compose_config("train_probe", f"probe={name}", "trainer.accelerator=cpu", *overrides)
    bags, y = _bags()
    rows = np.arange(len(y))   # statement 2i and its negation 2i + 1 (ttpd, ccs)
    data = bags if name == "samil" else Features(bags.X[bags.offsets[1:] - 1], None, bags.groups, rows % 2 == 1, rows // 2)
    L.seed_everything(0, verbose=False)
    fitted = make_probe(cfg).fit(data, y)
    fresh = make_probe(cfg)
    fresh.load_state_dict(fitted.state_dict())
    np.testing.assert_array_equal(fresh.decision_function(data), fitted.decision_function(data))
    assert fresh.params() == fitted.params()


def _files(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if p.is_file() and "logs" not in p.relative_to(root).parts}


def test_names_that_become_paths_are_checked(tmp_path):
    assert_one_error_line(run_module("extract", "model=tiny", "model.name=../escape", "limit=4", f"store_dir={tmp_path / 's'}",
                         cwd=tmp_path), "model.name='../escape'")
    make_synthetic_store(tmp_path / "activations", n_real=200, n_neither=100)
    before = _files(tmp_path)
    common = ["model.name=synthetic", f"store_dir={tmp_path / 'activations'}", f"results_dir={tmp_path / 'results'}",
              "layer=1", "probe=mean_diff"]
    for args, needle in ((["probe.name=/abs"], "probe.name='/abs'"), (["data.name=a/b"], "data.name='a/b'"),
                         (["task.name=.."], "task='..'")):
        assert_one_error_line(run_module("train_probe", *common, *args, cwd=tmp_path), needle)
    assert _files(tmp_path) == before and not (tmp_path / "results").exists()
    assert not list(tmp_path.parent.glob("escape*"))


def test_nested_target_on_the_command_line_is_never_built(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    make_synthetic_store(tmp_path / "activations", n_real=200, n_neither=100)
    result = run_module("train_probe", "model.name=synthetic", f"store_dir={tmp_path / 'activations'}",
                  f"results_dir={tmp_path / 'results'}", "layer=1", "probe=mean_diff",
                  "+probe.x._target_=builtins.open", f"+probe.x.file={victim}", "+probe.x.mode=w", cwd=tmp_path)
    assert_one_error_line(result, "probe.x")
    assert victim.read_text() == "keep me"
    result = run_module("train_probe", "model.name=synthetic", f"store_dir={tmp_path / 'activations'}",
                  "probe._target_=builtins.print", "layer=1", cwd=tmp_path)
    assert_one_error_line(result, "probe._target_='builtins.print'")


def test_report_names_a_truncated_cell_in_one_line(tmp_path):
    make_synthetic_store(tmp_path / "activations", n_real=200, n_neither=100)
    from probes.pipeline import train_probes

    path = train_probes(compose_config("train_probe", "model.name=synthetic", "probe=mean_diff", "layer=1",
                                       "n_boot=10", f"store_dir={tmp_path / 'activations'}",
                                       f"results_dir={tmp_path / 'results'}"))[0]
    path.write_text(path.read_text()[:100])
    result = run_module("experiments.report", "model.name=synthetic", f"results_dir={tmp_path / 'results'}",
                  f"reports_dir={tmp_path / 'reports'}", cwd=tmp_path)
    assert_one_error_line(result, str(path))


def test_layering_and_file_sizes():
    zero_shot = "\n".join(p.read_text() for p in (ROOT / "zero_shot").glob("*.py"))
    assert "from probes" not in zero_shot and "import probes" not in zero_shot
    lower = "\n".join(p.read_text() for p in (ROOT / "extract").glob("*.py"))
    lower += "\n".join(p.read_text() for p in (ROOT / "evaluation").glob("*.py"))
    assert "from probes" not in lower and "from zero_shot" not in lower
    sizes = {p: len(p.read_text().splitlines()) for p in ROOT.glob("**/*.py")
             if ".venv" not in p.parts and "tests" not in p.parts}
    assert max(sizes.values()) <= 460, max(sizes.items(), key=lambda kv: kv[1])
