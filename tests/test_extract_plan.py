"""dry_run=true: the plan's numbers (statements, tokens read and distinct, bytes) are those of the store
the real run writes (bytes within 2 %), it loads no weights and writes nothing, and a plan the disk
cannot hold is refused in one line."""
from __future__ import annotations

import shutil
from collections import namedtuple

import h5py
import pytest

from toolkit.disk import NoSpace
from extract.run import extract
from tests.helpers import assert_one_error_line, extract_config, run_module

ARGS = ["model=tiny", "data=city_locations", "limit=600"]


@pytest.mark.parametrize("prefix_cache", ["true", "false"])
def test_plan_numbers_match_the_store_written(tmp_path, monkeypatch, prefix_cache):
    args = [*ARGS, f"store_dir={tmp_path / 's'}", f"prefix_cache={prefix_cache}"]
    with monkeypatch.context() as m:
        m.setattr("extract.run.load_model", lambda cfg: pytest.fail("dry_run loaded the model"))
        plan = extract(extract_config(*args, "dry_run=true"))
    assert not (tmp_path / "s").exists()
    path = extract(extract_config(*args))
    with h5py.File(path) as f:
        own = f["layers/0"].shape[0]
        prefix = f["prefix/layers/0"].shape[0] if "prefix" in f else 0
        assert (plan.n_statements, plan.n_tokens, plan.n_distinct, plan.prefix_len, plan.n_layers) == \
               (f.attrs["n_statements"], f.attrs["n_tokens"], own + prefix, prefix, len(f["layers"]))
        assert plan.layer_bytes == (own + prefix) * f["layers/0"].dtype.itemsize * f.attrs["hidden_size"]
    assert abs(path.stat().st_size / plan.total_bytes - 1) <= 0.02, (path.stat().st_size, plan.total_bytes)
    if prefix_cache == "true":
        assert plan.n_distinct < plan.n_tokens and plan.total_bytes < plan.total_without_prefix
    else:
        assert plan.n_distinct == plan.n_tokens and plan.total_bytes == plan.total_without_prefix


def test_plan_the_disk_cannot_hold_is_refused(tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 << 20, 10 << 20, 1 << 20))
    with pytest.raises(NoSpace, match="free but the store needs") as err:
        extract(extract_config(*ARGS, f"store_dir={tmp_path / 's'}", "dry_run=true"))
    assert "\n" not in str(err.value) and not (tmp_path / "s").exists()


def test_dry_run_command_prints_the_plan(tmp_path):
    done = run_module("extract", *ARGS, f"store_dir={tmp_path / 's'}", "dry_run=true", "tokens_per_s=1000",
                      cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    for needle in ("statements      600", "distinct", "bytes per layer", "free disk", "at 1,000 tokens/s"):
        assert needle in done.stdout, done.stdout
    assert "dry run: nothing written" in done.stderr and not (tmp_path / "s").exists()
    bad = run_module("extract", *ARGS, f"store_dir={tmp_path / 's'}", "dry_run=true", "tokens_per_s=-1", cwd=tmp_path)
    assert_one_error_line(bad, "tokens_per_s=-1")
