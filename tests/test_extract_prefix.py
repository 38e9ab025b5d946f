"""The shared prefix computed once and stored once (schema 2): a store made with it reads, through
ActivationStore, probe.tokens=all bags and the plain-h5py recipe of docs/store.md, like the schema-1
store of the same statements made without it (prefix_cache=false), to float16 rounding; it resumes
after an interruption identically and refuses a resume in the other layout."""
from __future__ import annotations

import re
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from extract.run import extract
from extract.store import ActivationStore, StoreError
from extract.store_writer import StoreWriter
from probes.features import layer_features
from tests.helpers import extract_config
from tests.test_extract import assert_fp16_close

ROOT = Path(__file__).resolve().parent.parent
TINY = ["model=tiny", "data=city_locations", "limit=40", "batch_tokens=300", "window_tokens=700"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    """(schema-2 store, schema-1 store) of the same 40 city statements, tiny model."""
    root = tmp_path_factory.mktemp("pair")
    return (extract(extract_config(*TINY, f"store_dir={root / 'v2'}")),
            extract(extract_config(*TINY, f"store_dir={root / 'v1'}", "prefix_cache=false")))


def assert_same_reads(new: Path, old: Path) -> None:
    """Same statements, tokens and offsets; every layer equal to float16 rounding."""
    with ActivationStore(new) as a, ActivationStore(old) as b:
        assert a.table.equals(b.table)
        for name in ("offsets", "token_ids", "token_kind"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
        assert a.layers == b.layers
        for k in a.layers:
            assert_fp16_close(a.layer(k), b.layer(k))


def test_prefix_is_stored_once_and_reads_as_schema_1(pair):
    new, old = pair
    with h5py.File(new) as f, h5py.File(old) as g:
        assert f.attrs["schema_version"] == 2 and g.attrs["schema_version"] == 1 and "prefix" not in g
        p, n = int(f.attrs["prefix_len"]), int(f.attrs["n_statements"])
        assert p >= 2 and f.attrs["n_tokens"] == g.attrs["n_tokens"]
        assert f["layers/1"].shape[0] == g["layers/1"].shape[0] - n * p   # the prefix's rows are not repeated
        assert f["prefix/layers/1"].shape == (p, f.attrs["hidden_size"])
        np.testing.assert_array_equal(f["prefix/ids"][:], g["tokens/ids"][:p])
    assert_same_reads(new, old)


def test_row_selections_read_the_prefix_rows(pair):
    """layer(k, rows) with int and bool rows equals layer(k)[rows], prefix rows included."""
    with ActivationStore(pair[0]) as a:
        full = a.layer(3)
        rows = np.random.default_rng(0).integers(0, len(full), 200)
        np.testing.assert_array_equal(a.layer(3, rows), full[rows])
        mask = a.token_kind != 2
        np.testing.assert_array_equal(a.layer(3, mask), full[mask])


@pytest.mark.parametrize("representation", ["bags", "last", "mean"])
def test_probe_features_with_every_token_are_the_same(pair, representation):
    """probe.tokens=all (BOS and template tokens, the shared prefix's included) reads the same bags."""
    with ActivationStore(pair[0]) as a, ActivationStore(pair[1]) as b:
        fa, fb = (layer_features(s, 2, representation, "all") for s in (a, b))
    if representation == "bags":
        assert torch.equal(fa.offsets, fb.offsets)
    assert_fp16_close(fa.X.numpy(), fb.X.numpy())


def store_recipe() -> str:
    """The plain-h5py recipe of docs/store.md (its second python block)."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "store.md").read_text(), re.S)
    return next(b for b in blocks if "prefix/layers" in b)


def test_h5py_recipe_reads_both_schemas_alike(pair):
    for path in pair:
        scope = {}
        code = re.sub(r'^path, k = .*$', f'path, k = {str(path)!r}, 2', store_recipe(), flags=re.M)
        exec(compile(code, "docs/store.md", "exec"), scope)
        with ActivationStore(path) as store:
            np.testing.assert_array_equal(scope["ids"], store.token_ids)
            np.testing.assert_array_equal(scope["off"], store.offsets)
            np.testing.assert_array_equal(scope["X"], store.layer(2))
            np.testing.assert_array_equal(scope["features"], store.last_token(2))
            np.testing.assert_array_equal(scope["labels"], store.table["label"])


def test_interrupted_prefix_store_resumes_identically_and_other_layout_is_refused(tmp_path, monkeypatch):
    """Interrupted after its first window, resumed: equal to an uninterrupted run, bit for bit; resumed
    with prefix_cache=false (or a schema-1 store with the default): refused in one line."""
    args = [*TINY, "window_tokens=300"]
    real_write = StoreWriter.write

    def write_then_interrupt(self, *window):
        real_write(self, *window)
        raise KeyboardInterrupt

    monkeypatch.setattr(StoreWriter, "write", write_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        extract(extract_config(*args, f"store_dir={tmp_path / 'a'}"))
    monkeypatch.undo()
    with pytest.raises(StoreError, match="prefix_cache=true to resume it") as err:
        extract(extract_config(*args, f"store_dir={tmp_path / 'a'}", "prefix_cache=false"))
    assert "\n" not in str(err.value)
    resumed = extract(extract_config(*args, f"store_dir={tmp_path / 'a'}"))
    clean = extract(extract_config(*args, f"store_dir={tmp_path / 'b'}"))
    with ActivationStore(resumed) as a, ActivationStore(clean) as b:
        for k in b.layers:
            np.testing.assert_array_equal(a.layer(k), b.layer(k))
    old = extract(extract_config(*args, f"store_dir={tmp_path / 'c'}", "prefix_cache=false"))
    with pytest.raises(StoreError, match="without a shared prefix .schema 1.: rerun with prefix_cache=false"):
        extract(extract_config(*args, f"store_dir={tmp_path / 'c'}"))
    assert old.exists()


@pytest.mark.slow
def test_smollm2_prefix_store_equals_schema_1_store(tmp_path):
    """SmolLM2 (real weights, its 24-token system turn): every layer of every statement equal to the
    schema-1 store's to float16 rounding; probe.tokens=all bags too."""
    args = ["model=smollm2", "data=city_locations", "limit=60", "batch_tokens=1024"]
    new = extract(extract_config(*args, f"store_dir={tmp_path / 'v2'}"))
    old = extract(extract_config(*args, f"store_dir={tmp_path / 'v1'}", "prefix_cache=false"))
    with ActivationStore(new) as a:
        assert a.prefix_len >= 20
    assert_same_reads(new, old)
    with ActivationStore(new) as a, ActivationStore(old) as b:
        fa, fb = (layer_features(s, 16, "bags", "all") for s in (a, b))
    assert torch.equal(fa.offsets, fb.offsets)
    assert_fp16_close(fa.X.numpy(), fb.X.numpy())
