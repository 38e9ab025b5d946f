"""The shared batched, resumable scorer (extract/scorer.py) on the tiny model: an interrupted run resumes
to bit-identical results (with the checkpoint's batch size), a checkpoint of another signature is never
reused, a corrupt one is redone with one warning, and the prefix cache changes results only by float
rounding."""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from toolkit.disk import atomic_write
from toolkit.config import compose_config
from toolkit.errors import ToolkitError
from extract.models import load_model
from extract.scorer import Checkpoint, common_prefix_length, partial_path, score
from truthfulqa.likelihood import LoglikScorer
from zero_shot.prompts import PromptRenderer, get_enumeration, option_token_ids
from zero_shot.scoring import PromptScorer


@pytest.fixture(scope="module")
def tiny():
    return load_model(compose_config("zero_shot", "model=tiny").model)


@pytest.fixture(scope="module")
def prompts(tiny):
    """Zero-shot prompts (int64 ids) of 11 statements of different lengths, and their option ids."""
    renderer = PromptRenderer(tiny.tokenizer, get_enumeration("default"), tiny.use_chat_template)
    statements = [f"The city of {name} is in {country}." for name, country in
                  [("Paris", "France"), ("Oslo", "Chile"), ("Rio de Janeiro", "Brazil"), ("Ulan Bator", "Mongolia"),
                   ("Lima", "Peru"), ("Kuala Lumpur", "Malaysia"), ("Rome", "Japan"), ("Addis Ababa", "Ethiopia"),
                   ("Bern", "Switzerland"), ("Ho Chi Minh City", "Vietnam"), ("Quito", "Ecuador")]]
    return [renderer.ids(s) for s in statements], option_token_ids(tiny.tokenizer, get_enumeration("default").labels)


class _Interrupt(Exception):
    pass


def _stop_after(batch: int):
    def on_batch(b):
        if b == batch:
            raise _Interrupt
    return on_batch


def _run(loaded, prompts, path, batch_size=3, *, signature=None, resume=True, refuse=None, **kwargs):
    """Option probabilities of `prompts` in batches of `batch_size`, checkpointed every 2 batches."""
    seqs, option_ids = prompts
    checkpoint = Checkpoint(path, signature or {"test": 1}, 2, atomic_write, resume=resume, refuse=refuse)
    return score(loaded, seqs, PromptScorer(loaded.model, option_ids, loaded.device), batch_size,
                 checkpoint=checkpoint, **kwargs)


def _no_batch(b):
    pytest.fail(f"batch {b} ran")


@pytest.mark.parametrize("longest_first", [False, True])
def test_interrupted_run_resumes_bit_identical(tiny, prompts, tmp_path, longest_first):
    whole = _run(tiny, prompts, tmp_path / "a.npz", longest_first=longest_first)
    assert whole.resumed_after == 0 and whole.prefix_len > 0
    with np.load(tmp_path / "a.npz") as z:                       # the last checkpoint holds every row
        assert int(z["n_done"]) == 11
        np.testing.assert_array_equal(z["scores"], whole.results)
    path = tmp_path / "b.npz"
    with pytest.raises(_Interrupt):
        _run(tiny, prompts, path, longest_first=longest_first, on_batch=_stop_after(2))
    with np.load(path) as z:                                     # saved every 2 batches of 3
        assert int(z["n_done"]) == 6 and np.isnan(z["scores"]).sum() == 5 * 7
    resumed = _run(tiny, prompts, path, batch_size=5, longest_first=longest_first)   # the checkpoint's size wins
    assert resumed.resumed_after == 6 and resumed.batch_size == 3
    np.testing.assert_array_equal(resumed.results, whole.results)
    again = _run(tiny, prompts, path, longest_first=longest_first, on_batch=_no_batch)
    assert again.resumed_after == 11                              # a complete checkpoint: no batch runs
    np.testing.assert_array_equal(again.results, whole.results)


def test_a_checkpoint_of_another_signature_is_not_reused(tiny, prompts, tmp_path, caplog):
    path = tmp_path / "c.npz"
    with pytest.raises(_Interrupt):
        _run(tiny, prompts, path, on_batch=_stop_after(1))
    whole = _run(tiny, prompts, tmp_path / "w.npz")
    other = load_model(compose_config("zero_shot", "model=tiny", "model.seed=1").model)
    with pytest.raises(ValueError, match="model_fingerprint"):
        _run(other, prompts, path, refuse=ValueError)
    for kwargs, key in (({"longest_first": True}, "longest_first"), ({"prefix_cache": False}, "prefix_len")):
        with pytest.raises(ValueError, match=rf"other settings \({key}\)"):
            _run(tiny, prompts, path, refuse=ValueError, **kwargs)
    seqs, option_ids = prompts
    changed = (seqs[:4] + [seqs[4][:-1]] + seqs[5:], option_ids)
    with pytest.raises(ValueError, match="inputs_sha256"):
        _run(tiny, changed, path, refuse=ValueError)
    with pytest.raises(ValueError, match=r"other settings \(test\)"):
        _run(tiny, prompts, path, signature={"test": 2}, refuse=ValueError)
    with caplog.at_level(logging.WARNING):                       # without refuse: redone from the start
        redone = _run(tiny, prompts, path, signature={"test": 2})
    warned = [r.getMessage() for r in caplog.records if path.name in r.getMessage()]
    assert len(warned) == 1 and "other settings (test)" in warned[0] and redone.resumed_after == 0
    np.testing.assert_array_equal(redone.results, whole.results)
    assert _run(tiny, prompts, path, signature={"test": 2}, on_batch=_no_batch).resumed_after == 11
    assert _run(tiny, prompts, path, signature={"test": 2}, resume=False).resumed_after == 0   # overwrite=true


def test_a_corrupt_checkpoint_is_redone_with_one_warning(tiny, prompts, tmp_path, caplog):
    whole = _run(tiny, prompts, tmp_path / "w.npz")
    path = tmp_path / "bad.npz"
    path.write_bytes(b"not an npz")
    with caplog.at_level(logging.WARNING):
        redone = _run(tiny, prompts, path)
    warned = [r.getMessage() for r in caplog.records if path.name in r.getMessage()]
    assert len(warned) == 1 and "discarding" in warned[0] and redone.resumed_after == 0
    np.testing.assert_array_equal(redone.results, whole.results)


def test_prefix_cache_changes_results_only_by_rounding(tiny, prompts):
    seqs, option_ids = prompts
    reduce = PromptScorer(tiny.model, option_ids, tiny.device)
    cached, plain = (score(tiny, seqs, reduce, 4, prefix_cache=c) for c in (True, False))
    assert cached.prefix_len == common_prefix_length(seqs, 1) > 0 and plain.prefix_len == 0
    np.testing.assert_allclose(cached.results, plain.results, atol=1e-6)
    with torch.inference_mode():                                 # one unpadded prompt, whole logits
        p = tiny.model(input_ids=torch.from_numpy(seqs[3])[None]).logits[0, -1].float().softmax(-1)
    np.testing.assert_allclose(cached.results[3, :6], [float(p[o].sum()) for o in prompts[1]], atol=1e-6)
    n_cont = [2] * len(seqs)
    logliks = [score(tiny, seqs, LoglikScorer(n_cont), 4, longest_first=True, prefix_cache=c) for c in (True, False)]
    assert logliks[0].prefix_len == common_prefix_length(seqs, 3)
    np.testing.assert_allclose(logliks[0].results, logliks[1].results, atol=1e-5, rtol=1e-6)


def test_common_prefix_leaves_keep_tokens_and_partial_path():
    seqs = [np.array([1, 2, 3, 4, 5]), np.array([1, 2, 3, 9]), np.array([1, 2, 3, 4, 5, 6])]
    assert common_prefix_length(seqs, 1) == 3
    assert common_prefix_length(seqs, [3, 1, 1]) == 2
    assert common_prefix_length(seqs[:1] * 2, 1) == 4
    assert partial_path(Path("r/scores-x.npy")) == Path("r/scores-x.partial.npz")


def test_a_sequence_past_the_models_context_is_refused_before_any_batch(tiny, prompts, tmp_path):
    """truthfulqa and ncb's zero-shot scored 650-840-token prompts on a model of fewer positions, results
    written and no warning; extract refused such statements. Every score() call now does."""
    seqs, option_ids = prompts
    long = np.concatenate([seqs[0], np.full(tiny.max_positions, seqs[0][-1])])
    with pytest.raises(ToolkitError, match=rf"1 of 3 sequences are longer than the model's {tiny.max_positions} "
                                           rf"positions \(the first, #1, has {len(long)} tokens\)") as err:
        score(tiny, [seqs[0], long, seqs[1]], PromptScorer(tiny.model, option_ids, tiny.device), 2,
              on_batch=_no_batch, desc="zero-shot")
    assert "\n" not in str(err.value) and str(err.value).startswith("zero-shot: ")
