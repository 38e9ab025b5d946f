"""Extraction on the tiny model: stored states equal a plain forward, tokens equal the tokenizer's,
resumption after SIGKILL gives identical stores, mismatched stores are refused."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import h5py
import numpy as np
import pandas as pd
import pytest
import torch

from omegaconf import OmegaConf

from extract.capture import plan_batches, plan_windows, render
from toolkit.errors import ToolkitError
from extract.models import decoder_layers, load_model
from extract.run import extract
from extract.statements import StatementsError, limit_statements, load_statements
from extract.store import KIND_CONTEXT, KIND_STATEMENT, KIND_TEMPLATE, ActivationStore, StoreError
from extract.store_writer import StoreWriter
from tests.helpers import extract_config
from zero_shot.scoring import scored_rows

ROOT = Path(__file__).resolve().parent.parent


def reference_states(loaded, ids: np.ndarray) -> list[np.ndarray]:
    """Layers 0..L of one statement from a plain single-statement forward: HF hidden_states for
    0..L-1 and, for L, the last block's output hooked before the final norm. [L+1] x [n, d]."""
    last = {}
    handle = decoder_layers(loaded.model)[-1].register_forward_hook(
        lambda m, a, out: last.setdefault("h", out[0] if isinstance(out, tuple) else out))
    with torch.no_grad():
        out = loaded.model(torch.from_numpy(ids)[None], output_hidden_states=True)
        handle.remove()
        states = [h[0].float().numpy() for h in out.hidden_states[:-1]] + [last["h"][0].float().numpy()]
        # independent check of the hooked layer L: the final norm applied to it gives HF's last entry
        final_norm = loaded.model.model.norm(last["h"])[0].float().numpy()
    np.testing.assert_allclose(final_norm, out.hidden_states[-1][0].float().numpy(), rtol=1e-4, atol=1e-5)
    return states


def assert_fp16_close(got: np.ndarray, ref: np.ndarray) -> None:
    """Equal up to float16 rounding (2 ulp) plus float noise of batched vs single matmuls."""
    scale = np.abs(ref).max()
    assert np.all(np.abs(got - ref) <= 1e-3 * np.abs(ref) + 1e-4 * scale), np.abs(got - ref).max() / scale


def check_against_plain_forward(store_path: Path, loaded, statements: range) -> None:
    with ActivationStore(store_path) as store:
        layers = {k: store.layer(k) for k in store.layers}
        ids, offsets = store.token_ids, store.offsets
        assert store.layers == list(range(loaded.n_layers + 1))
        for i in statements:
            rows = slice(offsets[i], offsets[i + 1])
            for k, ref in enumerate(reference_states(loaded, ids[rows])):
                assert_fp16_close(layers[k][rows], ref)


def test_stored_states_equal_plain_forward(tiny_store):
    loaded = load_model(extract_config("model=tiny").model)
    with ActivationStore(tiny_store) as store:
        lengths = np.diff(store.offsets)
    assert len(set(lengths)) > 3  # the batches really mixed lengths
    check_against_plain_forward(tiny_store, loaded, range(40))


def test_tokens_equal_tokenizer_ids_of_rendered_input(tiny_store):
    loaded = load_model(extract_config("model=tiny").model)
    tok = loaded.tokenizer
    with ActivationStore(tiny_store) as store:
        ids, offsets, kinds, table = store.token_ids, store.offsets, store.token_kind, store.table
        assert offsets[0] == 0 and offsets[-1] == len(ids) == store.layer(0).shape[0]
        assert tok.pad_token_id not in ids
        for i, statement in enumerate(table["statement"]):
            text = tok.apply_chat_template([{"role": "user", "content": statement}], tokenize=False)
            expected = tok(text, add_special_tokens=False)["input_ids"]
            got = ids[offsets[i]:offsets[i + 1]]
            assert got.tolist() == expected
            assert (got == tok.bos_token_id).sum() == 1  # no double BOS
            statement_ids = got[kinds[offsets[i]:offsets[i + 1]] == KIND_STATEMENT]
            assert tok.decode(statement_ids) == statement


def test_reader_api_matches_manual_computation(tiny_store):
    with ActivationStore(tiny_store) as store:
        layer, offsets, kind = store.layer(2), store.offsets, store.token_kind
        X, bag_offsets = store.bags(2)
        last, mean = store.last_token(2), store.mean(2)
        for i in range(store.n_statements):
            rows = np.arange(offsets[i], offsets[i + 1])
            rows = rows[kind[rows] == KIND_STATEMENT]
            np.testing.assert_array_equal(X[bag_offsets[i]:bag_offsets[i + 1]], layer[rows])
            np.testing.assert_array_equal(last[i], layer[rows[-1]])
            np.testing.assert_allclose(mean[i], layer[rows].mean(0), rtol=1e-5, atol=1e-6)
        with pytest.raises(StoreError, match="layer 9 is not in"):
            store.layer(9)
        expected = limit_statements(load_statements("city_locations"), 40)   # the fixture's limit=40
        assert store.table["label"].tolist() == expected["label"].tolist()


def test_limit_stores_the_stratified_subset(tiny_store):
    """limit=40 stores limit_statements' rows (all three labels; the first 40 rows have no
    neither statement), in table order, with their source rows."""
    expected = limit_statements(load_statements("city_locations"), 40)
    with ActivationStore(tiny_store) as store:
        table = store.table
    assert sorted(set(table["label"])) == [0, 1, 2]
    for column in ("statement", "object_1", "object_2", "source_file", "source_row"):
        assert table[column].tolist() == expected[column].tolist(), column


def test_store_of_another_limit_selection_is_refused(tmp_path, monkeypatch):
    """A store whose limit=N rows were chosen otherwise (as the first N rows, before limit became
    a stratified subset) is refused on resume, never mixed: its token ids differ."""
    args = ["model=tiny", "data=city_locations", "limit=8", "layers=[1]", f"store_dir={tmp_path}"]
    monkeypatch.setattr("extract.run.limit_statements", lambda table, n, whole_groups: table.iloc[:n])
    extract(extract_config(*args))
    monkeypatch.undo()
    with pytest.raises(StoreError, match="holds other token ids") as err:
        extract(extract_config(*args))
    assert "\n" not in str(err.value)


def test_a_store_of_a_csv_whose_labels_changed_is_refused_not_kept(tmp_path):
    """The same statements with other labels (or metadata) used to be "already complete": the store kept
    the old labels and every later step used them."""
    from tests.helpers import datapack_csv, extract_csv

    csv = datapack_csv(tmp_path / "mine.csv", slice(0, 6), slice(0, 2))
    path = extract_csv(tmp_path, "mine", csv, tmp_path / "s", "layers=[1]")
    extract_csv(tmp_path, "mine", csv, tmp_path / "s", "layers=[1]")              # unchanged: resumes (complete)
    table = pd.read_csv(csv)
    for column, value in (("label", 1 - table["label"].iat[0]), ("object_2", "Atlantis")):
        changed = table.copy()
        changed.loc[0, column] = value
        changed.to_csv(csv, index=False)
        with pytest.raises(StoreError, match="keeps other labels or metadata") as err:
            extract_csv(tmp_path, "mine", csv, tmp_path / "s", "layers=[1]")
        assert "\n" not in str(err.value)
    with ActivationStore(path) as store:
        assert store.table["label"].tolist() == table["label"].tolist()


def test_store_attributes_and_layer_subset(tmp_path):
    path = extract(extract_config("model=tiny", "data=med_indications", "limit=6", "layers=[0,2,4]",
                                  "dtype=bfloat16", f"store_dir={tmp_path}"))
    assert path == tmp_path / "tiny" / "med_indications.h5"
    with h5py.File(path) as f:
        attrs = dict(f.attrs)
        assert sorted(f["layers"]) == ["0", "2", "4"]
        assert f["layers/2"].dtype == np.uint16 and f["layers/2"].attrs["dtype"] == "bfloat16"
    for key in ("schema_version", "model_id", "model_fingerprint", "tokenizer_id", "n_layers", "hidden_size",
                "dtype", "chat_template", "chat_template_text", "toolkit_version", "created", "n_done"):
        assert key in attrs, key
    assert attrs["n_done"] == 6 and attrs["n_layers"] == 4 and attrs["chat_template"]
    loaded = load_model(extract_config("model=tiny").model)
    with ActivationStore(path) as store:
        ids, offsets = store.token_ids, store.offsets
        ref = reference_states(loaded, ids[offsets[0]:offsets[1]])[4]
        got = store.layer(4)[offsets[0]:offsets[1]]
        assert np.abs(got - ref).max() <= 2 ** -7 * np.abs(ref).max()  # bfloat16 rounding


def test_mismatched_store_is_refused(tmp_path):
    args = ["model=tiny", "data=city_locations", "limit=5", f"store_dir={tmp_path}"]
    extract(extract_config(*args))
    for change, message in [("dtype=float32", "dtype"), ("model.seed=1", "model_fingerprint"),
                            ("layers=[1]", "layers"), ("limit=6", "n_statements=5, not 6")]:
        with pytest.raises(StoreError, match=message) as err:
            extract(extract_config(*args, change))
        assert "np." not in str(err.value) and "\n" not in str(err.value)
    extract(extract_config(*args, "dtype=float32", "overwrite=true"))
    with ActivationStore(tmp_path / "tiny" / "city_locations.h5") as store:
        assert store.attrs["dtype"] == "float32"


def test_planning_covers_every_statement_once():
    lengths = np.random.default_rng(0).integers(3, 40, size=200)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    windows = plan_windows(offsets, 500)
    assert windows[0][0] == 0 and windows[-1][1] == 200
    assert all(b == c for (_, b), (c, _) in zip(windows, windows[1:]))
    assert plan_windows(offsets, 500, start=windows[3][0]) == windows[3:]
    for a, b in windows:
        assert offsets[b] - offsets[a] <= 500 or b == a + 1
        batches = plan_batches(lengths[a:b], 128)
        assert sorted(np.concatenate(batches).tolist()) == list(range(b - a))
        for batch in batches:
            assert len(batch) * lengths[a:b][batch].max() <= 128 or len(batch) == 1


def test_plain_rendering_without_template():
    loaded = load_model(extract_config("model=tiny", "model.chat_template=false").model)
    ids, kinds = render(loaded.tokenizer, "Paris is in France.", False)
    assert kinds[-1] == KIND_STATEMENT and loaded.tokenizer.decode(ids[kinds == KIND_STATEMENT]) == "Paris is in France."


def _extract_command(store_dir: Path) -> list[str]:
    return [sys.executable, "-m", "extract", "model=tiny", "data=city_locations", "limit=600",
            f"store_dir={store_dir}", "batch_tokens=256", "window_tokens=600", "layers=[0,1,4]",
            f"hydra.run.dir={store_dir}/logs"]


def test_sigkill_then_rerun_equals_uninterrupted_run(tmp_path):
    """Kill the extraction subprocess mid-run (SIGKILL), rerun the same command: identical store."""
    killed_dir, clean_dir = tmp_path / "killed", tmp_path / "clean"
    proc = subprocess.Popen(_extract_command(killed_dir), cwd=ROOT, stderr=subprocess.PIPE, text=True)
    seen = []

    def watch():  # tqdm progress "n/N [" on stderr
        for chunk in iter(lambda: proc.stderr.read(64), ""):
            seen.append(chunk)

    threading.Thread(target=watch, daemon=True).start()
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        done = [int(n) for n in re.findall(r"extract city_locations\.h5:[^\r\n]*?\| *(\d+)/600 \[", "".join(seen)[-400:])]
        if done and 100 <= max(done) < 450:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "extraction finished before it could be killed:\n" + "".join(seen)[-2000:]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    with ActivationStore(killed_dir / "tiny" / "city_locations.h5", allow_incomplete=True) as partial:
        assert 0 < partial.n_done < 600
    with pytest.raises(StoreError, match="incomplete"):
        ActivationStore(killed_dir / "tiny" / "city_locations.h5")
    subprocess.run(_extract_command(killed_dir), cwd=ROOT, check=True, capture_output=True)
    subprocess.run(_extract_command(clean_dir), cwd=ROOT, check=True, capture_output=True)
    with ActivationStore(killed_dir / "tiny" / "city_locations.h5") as a, \
            ActivationStore(clean_dir / "tiny" / "city_locations.h5") as b:
        assert a.n_done == b.n_done == 600
        np.testing.assert_array_equal(a.token_ids, b.token_ids)
        for k in (0, 1, 4):
            np.testing.assert_array_equal(a.layer(k), b.layer(k))


@pytest.mark.slow
def test_smollm2_stored_states_equal_plain_gguf_forward(tmp_path):
    """SmolLM2 (real GGUF weights): the store equals a plain forward of the model loaded directly
    from the GGUF file by transformers (independent of our converted checkpoint), tokens included."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = extract_config("model=smollm2", "data=word_definitions", "limit=10", f"store_dir={tmp_path}",
                         "batch_tokens=200")
    path = extract(cfg)
    loaded = load_model(cfg.model)
    gguf = Path(loaded.model_id.split("/", 1)[1])
    package_dir = Path(__import__("importlib").util.find_spec(cfg.model.package).submodule_search_locations[0])
    loaded.tokenizer = AutoTokenizer.from_pretrained(str(package_dir), gguf_file=gguf.name)
    loaded.model = AutoModelForCausalLM.from_pretrained(str(package_dir), gguf_file=gguf.name).eval()
    with ActivationStore(path) as store:
        ids, offsets, table = store.token_ids, store.offsets, store.table
        assert len(set(np.diff(offsets))) > 3
        for i, statement in enumerate(table["statement"]):
            text = loaded.tokenizer.apply_chat_template([{"role": "user", "content": statement}], tokenize=False)
            assert ids[offsets[i]:offsets[i + 1]].tolist() == loaded.tokenizer(text, add_special_tokens=False)["input_ids"]
    check_against_plain_forward(path, loaded, range(10))


# ------------------------------------------------------------ resume: same model or refused
def test_resume_with_another_model_or_compute_dtype_is_refused(tmp_path, monkeypatch):
    """A run interrupted after its first window, resumed with another tiny model (seed 1: same
    architecture, other weights) or another compute dtype: refused with one line, nothing mixed;
    resumed with the same settings it ends equal to an uninterrupted run."""
    args = ["model=tiny", "data=city_locations", "limit=30", "window_tokens=400", "batch_tokens=400"]
    real_write = StoreWriter.write

    def write_then_interrupt(self, *window):
        real_write(self, *window)
        raise KeyboardInterrupt  # as Ctrl-C right after the first window reached the disk

    monkeypatch.setattr(StoreWriter, "write", write_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        extract(extract_config(*args, f"store_dir={tmp_path / 'a'}"))
    monkeypatch.undo()
    path = tmp_path / "a" / "tiny" / "city_locations.h5"
    with ActivationStore(path, allow_incomplete=True) as store:
        assert 0 < store.n_done < 30
    for change, key in [("model.seed=1", "model_fingerprint"), ("model.dtype=bfloat16", "compute_dtype")]:
        with pytest.raises(StoreError, match=f"made with {key}=") as err:
            extract(extract_config(*args, f"store_dir={tmp_path / 'a'}", change))
        assert "\n" not in str(err.value) and "overwrite=true" in str(err.value)
    extract(extract_config(*args, f"store_dir={tmp_path / 'a'}"))
    clean = extract(extract_config(*args, f"store_dir={tmp_path / 'b'}"))
    with ActivationStore(path) as a, ActivationStore(clean) as b:
        for k in b.layers:
            np.testing.assert_array_equal(a.layer(k), b.layer(k))


def test_local_checkpoint_is_fingerprinted_by_its_weights(tmp_path):
    """A local folder holding another checkpoint of the same architecture (same file names and
    sizes) is another model: its store is refused."""
    checkpoint = tmp_path / "checkpoint"
    args = ["model=llama", f"model.name_or_path={checkpoint}", "model.name=local", "model.dtype=float32",
            "model.device=cpu", "data=city_locations", "limit=4", f"store_dir={tmp_path / 'stores'}"]
    for seed in (0, 1):
        tiny = load_model(extract_config("model=tiny", f"model.seed={seed}").model)
        tiny.model.save_pretrained(checkpoint)
        tiny.tokenizer.save_pretrained(checkpoint)
        if seed == 0:
            extract(extract_config(*args))
    with pytest.raises(StoreError, match="made with model_fingerprint="):
        extract(extract_config(*args))


# ------------------------------------------------------------- bad limit, layers, statements
@pytest.mark.parametrize("limit", ["0", "-1", "1.5", "abc"])
def test_bad_limit_is_one_line_error(tmp_path, limit):
    with pytest.raises(ToolkitError, match="limit") as err:
        extract(extract_config("model=tiny", f"limit={limit}", f"store_dir={tmp_path / 's'}"))
    assert "\n" not in str(err.value) and not (tmp_path / "s").exists()
    table = load_statements("city_locations")
    value = OmegaConf.create({"limit": limit}).limit  # as the command line parses it
    with pytest.raises(ToolkitError, match="limit=") as err:
        scored_rows(OmegaConf.create({"limit": value, "rows": "all"}), table)
    assert "\n" not in str(err.value)


def test_empty_layer_list_writes_nothing(tmp_path):
    with pytest.raises(ToolkitError, match=r"layers=\[\]: give at least one") as err:
        extract(extract_config("model=tiny", "limit=3", "layers=[]", f"store_dir={tmp_path / 's'}"))
    assert "\n" not in str(err.value) and not (tmp_path / "s").exists()


def csv_of(tmp_path: Path, *statements: str) -> Path:
    path = tmp_path / "mine.csv"
    path.write_text("statement,label\n" + "".join(f"\"{s}\",1\n" for s in statements))
    return path


def test_statement_longer_than_the_context_is_refused(tmp_path):
    """The tiny model has 2048 positions: a 2100-character statement (one token per byte) is refused
    with one line naming its row, before anything is written."""
    csv = csv_of(tmp_path, "Paris is in France.", "x" * 2100)
    with pytest.raises(StatementsError, match=r"mine\.csv, row 1, column 'statement': .* more than the model's 2048 "
                                              "positions") as err:
        extract(extract_config("model=tiny", "data=csv", f"data.path={csv}", "data.name=mine",
                               "data.label_column=label", f"store_dir={tmp_path / 's'}"))
    assert "\n" not in str(err.value) and not (tmp_path / "s").exists()


def test_statement_of_special_tokens_only_is_refused(tmp_path):
    csv = csv_of(tmp_path, "Paris is in France.", "<s>")
    with pytest.raises(StatementsError, match=r"mine\.csv, row 1, .*'<s>' has no text token") as err:
        extract(extract_config("model=tiny", "data=csv", f"data.path={csv}", "data.name=mine",
                               "data.label_column=label", f"store_dir={tmp_path / 's'}"))
    assert "\n" not in str(err.value) and not (tmp_path / "s").exists()


@pytest.mark.parametrize("statement", ["end", "user", ": end", "Paris is in France."])
def test_token_kinds_come_from_offsets_not_text_search(statement):
    """A statement that also occurs in the template's own text (`end` in its closing text) gets
    exactly its own tokens marked as statement, and the template's text stays template."""
    tok = load_model(extract_config("model=tiny").model).tokenizer
    tok.chat_template = "{{ bos_token }}{% for m in messages %}{{ m['role'] + ': ' + m['content'] + ' (end)' }}{% endfor %}"
    ids, kinds = render(tok, statement, True)
    before = len(tok("<s>user: ", add_special_tokens=False)["input_ids"])
    own = tok(statement, add_special_tokens=False)["input_ids"]
    assert np.flatnonzero(kinds == KIND_STATEMENT).tolist() == list(range(before, before + len(own)))
    assert ids[kinds == KIND_STATEMENT].tolist() == own
    assert tok.decode(ids[kinds == KIND_TEMPLATE]) == "user:  (end)"


@pytest.mark.parametrize("chat", [True, False])
def test_context_tokens_are_marked_and_statement_tokens_unchanged(chat):
    """A context before the statement (ending in a newline) gets kind context; the statement keeps
    exactly the token ids it has without the context, marked as statement."""
    tok = load_model(extract_config("model=tiny").model).tokenizer
    tok.chat_template = "{{ bos_token }}{% for m in messages %}{{ m['role'] + ': ' + m['content'] + ' (end)' }}{% endfor %}"
    statement, context = "Paris is in France.", "3 of 5 people said that Paris is in Spain.\n"
    clean_ids, clean_kinds = render(tok, statement, chat)
    ids, kinds = render(tok, statement, chat, context=context)
    assert ids[kinds == KIND_STATEMENT].tolist() == clean_ids[clean_kinds == KIND_STATEMENT].tolist()
    assert tok.decode(ids[kinds == KIND_CONTEXT]) == context
    assert np.array_equal(np.flatnonzero(kinds == KIND_STATEMENT),
                          np.arange(len(ids))[np.flatnonzero(kinds == KIND_CONTEXT)[-1] + 1:][
                              : int((kinds == KIND_STATEMENT).sum())])


def test_context_column_is_stored_and_read_back(tmp_path):
    csv = tmp_path / "ctx.csv"
    csv.write_text('statement,label,context\n"Paris is in France.",1,"Q: where is Paris?\nA: "\n'
                   '"Rome is in Spain.",0,\n')
    path = extract(extract_config("model=tiny", "data=csv", f"data.path={csv}", "data.name=ctx",
                                  "data.label_column=label", f"store_dir={tmp_path / 's'}", "layers=[1]"))
    with ActivationStore(path) as store:
        assert store.table["context"].tolist() == ["Q: where is Paris?\nA: ", ""]
        kinds = store.token_kind[store.offsets[0]:store.offsets[1]]
        assert (kinds == KIND_CONTEXT).any()
        assert not (store.token_kind[store.offsets[1]:] == KIND_CONTEXT).any()
