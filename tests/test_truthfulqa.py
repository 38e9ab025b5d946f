"""TruthfulQA MC1 / MC2 (truthfulqa/): answer parsing, metrics, log-likelihoods, prefix cache,
resumption and bad input."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch

from toolkit.config import compose_config
from toolkit.errors import ToolkitError, run_entry
from extract.models import load_model
from extract.scorer import score
from extract.truthfulqa_pack import (count_duplicate_choices, load_questions, split_answers)
from truthfulqa.likelihood import PRIMER, LoglikScorer, context_text, question_requests
from evaluation.multiple_choice import mc_scores, question_ci
from truthfulqa.run import build_requests, partial_path, result_path, run

ROOT = Path(__file__).resolve().parent.parent
tqa_config = partial(compose_config, "truthfulqa")
HEADER = "Type,Category,Question,Best Answer,Correct Answers,Incorrect Answers,Source\n"


# ------------------------------------------------------------------------------ data
def test_split_answers_handles_missing_spaces_and_empty_answers():
    assert split_answers("A; B;C;") == ["A", "B", "C"]
    assert split_answers(" A ;; ;B") == ["A", "B"]
    assert split_answers("No; No") == ["No", "No"]


def test_vendored_csv_choices_and_duplicates():
    qs = load_questions()
    assert len(qs) == 813 and [q.row for q in qs] == list(range(813))
    q = qs[396]                                       # its incorrect cell ends in ';' with no space
    assert q.incorrect[-1] == '"Port of Melbourne"'
    for q in qs:
        assert q.mc1_choices == [q.best, *q.incorrect]
        assert q.mc2_choices == [*q.correct, *q.incorrect]
        assert q.mc2_labels == [1] * len(q.correct) + [0] * len(q.incorrect)
    assert qs[808].mc1_choices.count("The population of the country is 1.4 billion") == 2   # kept
    assert count_duplicate_choices(qs) == {"mc1": 1, "mc2": 5}


def _csv(tmp_path: Path, body: str, header: str = HEADER) -> Path:
    path = tmp_path / "bad.csv"
    path.write_text(header + body)
    return path


# --------------------------------------------------------------------------- metrics
def test_mc_scores_match_a_direct_computation():
    rng = np.random.default_rng(1)
    mc1_ll = [rng.normal(-20, 5, size=n) for n in (3, 5, 2)] + [np.array([-5.0, -5.0, -9.0])]  # a tie
    labels = [[1, 0, 0], [1, 1, 0, 0, 0], [1, 0], [1, 1, 0]]
    mc2_ll = [rng.normal(-30, 8, size=len(y)) for y in labels]
    mc1, mc2 = mc_scores(mc1_ll, mc2_ll, labels)
    np.testing.assert_array_equal(mc1, [float(max(range(len(ll)), key=lambda i: (ll[i], -i)) == 0)
                                        for ll in mc1_ll])
    assert mc1[-1] == 1.0                             # np.argmax: a tie goes to the first choice
    direct = [sum(np.exp(v) for v, y in zip(ll, ys) if y) / sum(np.exp(v) for v in ll)
              for ll, ys in zip(mc2_ll, labels)]
    np.testing.assert_allclose(mc2, direct, rtol=1e-12)


def test_likelihood_mc1_keeps_the_harness_first_index_argmax():
    mc1_ll = [[-5.0, -5.0, -9.0], [-7.0, -5.0, -5.0], [-1.0, -2.0], [-3.0, -3.0, -3.0, -3.0]]
    labels = [[1, 0, 0], [1, 0, 0], [1, 0], [1, 0, 0, 0]]
    first, _ = mc_scores(mc1_ll, mc1_ll, labels)             # truthfulqa.run's call: the default rule
    np.testing.assert_array_equal(first, [float(np.argmax(ll) == 0) for ll in mc1_ll])
    np.testing.assert_array_equal(first, mc_scores(mc1_ll, mc1_ll, labels, ties="first")[0])
    expected, _ = mc_scores(mc1_ll, mc1_ll, labels, ties="expected")   # the probe's rule differs on ties only
    np.testing.assert_array_equal(expected, [0.5, 0.0, 1.0, 0.25])
    with pytest.raises(Exception, match="ties='last' is not one of first, expected"):
        mc_scores(mc1_ll, mc1_ll, labels, ties="last")


def test_bootstrap_is_seeded_and_brackets_the_mean():
    values = np.random.default_rng(0).random(50)
    a, b = question_ci(values, 200, 3), question_ci(values, 200, 3)
    assert a == b and a[0] < values.mean() < a[1]
    assert question_ci(values, 200, 4) != a


# ---------------------------------------------------------------------- likelihoods
@pytest.fixture(scope="module")
def tiny():
    return load_model(tqa_config("model=tiny").model)


def test_prompts():
    assert PRIMER.startswith("Q: What is human life expectancy in the United States?\nA: Human life")
    assert PRIMER.endswith("\n\nQ: Where were the 1992 Olympics held?\nA: The 1992 Olympics were held in "
                           "Barcelona, Spain.") and PRIMER.count("Q: ") == 6
    assert context_text("lm_eval", "Why?") == PRIMER + "\n\nQ: Why?\nA:"
    assert context_text("plain", "Why?") == "Q: Why?\nA:"


def test_tiny_chat_context(tiny):
    assert context_text("chat", "Why?", tiny.tokenizer) == "<s><|user|>Why?<|end|><|assistant|>"
    assert context_text("chat", "Why?", tiny.tokenizer, "Be brief.") == \
        "<s><|system|>Be brief.<|end|><|user|>Why?<|end|><|assistant|>"


def plain_loglik(loaded, context: str, continuation: str, chat: bool = False) -> float:
    """Reference: full forward of context + continuation (no cache, no padding), log_softmax, sum."""
    kwargs = {"add_special_tokens": False} if chat else {}
    tok = loaded.tokenizer
    ctx = tok.encode(context, **kwargs)
    cont = tok.encode(context + continuation, **kwargs)[len(ctx):]
    ids = torch.tensor([ctx + cont], device=loaded.device)
    with torch.no_grad():
        logits = loaded.model(input_ids=ids).logits[0].float()
    logp = torch.log_softmax(logits[len(ctx) - 1: -1], dim=-1)
    return float(logp.gather(1, torch.tensor(cont, device=loaded.device)[:, None]).sum())


def _check_logliks(loaded, fmt: str, questions, n_choices: int = 3):
    seqs, n_cont, _, _ = build_requests(loaded.tokenizer, fmt, questions)
    cached, uncached = (score(loaded, seqs, LoglikScorer(n_cont), len(seqs), prefix_cache=c) for c in (True, False))
    assert cached.prefix_len > 0 and uncached.prefix_len == 0
    cached, uncached = cached.results, uncached.results
    # 1e-5 absolute, or 1e-6 relative for long sums (tiny's byte tokens: ~-450, float32 ulp 3e-5)
    np.testing.assert_allclose(cached, uncached, atol=1e-5, rtol=1e-6)
    where = {(tuple(x), c): i for i, (x, c) in enumerate(zip(seqs, n_cont))}
    for q in questions:
        context = context_text(fmt, q.question, loaded.tokenizer)
        for choice in list(dict.fromkeys(q.mc1_choices + q.mc2_choices))[:n_choices]:
            ref = plain_loglik(loaded, context, choice if fmt == "chat" else " " + choice, fmt == "chat")
            ctx, cont = question_requests(loaded.tokenizer, fmt, q.question, [choice])[0]
            i = where[(tuple(ctx + cont), len(cont))]
            assert abs(cached[i] - ref) < 1e-4 and abs(uncached[i] - ref) < 1e-4


@pytest.mark.parametrize("fmt", ["lm_eval", "plain", "chat"])
def test_tiny_logliks_match_a_plain_forward_with_and_without_cache(tiny, fmt):
    _check_logliks(tiny, fmt, load_questions()[:3])


class _Interrupt(Exception):
    pass


def test_resume_gives_the_uninterrupted_result(tmp_path):
    common = ["model=tiny", "format=plain", "limit=4", "batch_size=4", "save_every=2", "n_boot=50"]
    whole = json.loads(run(tqa_config(*common, f"results_dir={tmp_path / 'a'}")).read_text())
    cfg = tqa_config(*common, f"results_dir={tmp_path / 'b'}")

    def stop(batch):
        if batch == 2:
            raise _Interrupt

    with pytest.raises(_Interrupt):
        run(cfg, on_batch=stop)
    final = result_path(cfg)
    assert not final.exists() and final.name == "likelihood-plain-limit4.json"
    with np.load(partial_path(final)) as z:
        assert int(z["n_done"]) == 8                  # 2 batches of 4 (saved every 2), then stopped
    resumed = json.loads(run(cfg).read_text())
    assert not partial_path(final).exists() and resumed["resumed_after_requests"] == 8
    for key in ("mc1", "mc2", "mc1_ci", "mc2_ci", "questions", "n_questions", "format"):
        assert resumed[key] == whole[key], key
    assert [q["row"] for q in whole["questions"]] == [0, 1, 2, 3]
    assert set(whole) >= {"n_duplicate_choices", "model_id", "model_fingerprint", "seconds"}


# ------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("body, header, message", [
    ("A,B,Q?,best,c1; c2,i1\n", HEADER.replace("Correct Answers,", ""), "lacks the column(s) Correct Answers"),
    ("A,B,Q1?,best,c1,i1\nA,B,Q2?,best,c1,\n", HEADER, "row 1 (0-based data row) has no incorrect answer"),
    ("A,B,Q1?,best, ; ,i1\n", HEADER, "row 0 (0-based data row) has no correct answer"),
])
def test_bad_csv_is_one_line_and_writes_nothing(tmp_path, caplog, body, header, message):
    cfg = tqa_config("model=tiny", f"data_path={_csv(tmp_path, body, header)}", f"results_dir={tmp_path / 'r'}")
    log = logging.getLogger("truthfulqa.test")
    with caplog.at_level(logging.ERROR), pytest.raises(SystemExit) as exit_:
        run_entry(run, cfg, log=log)
    assert exit_.value.code == 1
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and message in errors[0] and "\n" not in errors[0]
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("body, header, message", [
    ("A,B,Q?,best,c1; c2,i1\n", HEADER.replace("Correct Answers,", ""), "lacks the column(s) Correct Answers"),
    ("A,B,Q1?,best,best,i1\nA,B,Q2?,best,best,\n", HEADER, "row 1 (0-based data row) has no incorrect answer"),
    ("A,B,Q1?,best, ; ,i1\n", HEADER, "row 0 (0-based data row) has no correct answer"),
    ("A,B,Q1?,best,c1; c2,i1\n", HEADER, "row 0 (0-based data row): the best answer is not among the correct"),
    (None, HEADER, "no such file"),
])
def test_bad_csv_for_the_probing_datapack_is_one_line_and_writes_nothing(tmp_path, body, header, message):
    from extract.run import extract

    path = _csv(tmp_path, body, header) if body is not None else tmp_path / "missing.csv"
    cfg = compose_config("extract", "model=tiny", "data=truthfulqa", f"data.path={path}",
                         f"store_dir={tmp_path / 's'}")
    with pytest.raises(ToolkitError) as err:
        extract(cfg)
    assert message in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "s").exists()


def test_cli_unknown_format_exits_1_with_one_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    bad = subprocess.run([sys.executable, "-m", "truthfulqa", "model=tiny", "format=mc3",
                          f"results_dir={tmp_path / 'r'}", f"hydra.run.dir={tmp_path / 'log'}"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1
    errors = [line for line in bad.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "format='mc3'" in errors[0]
    assert "Traceback" not in bad.stderr and not (tmp_path / "r").exists()


@pytest.mark.parametrize("limit", ["0", "abc"])
def test_limit_must_be_a_positive_number(tmp_path, limit):
    with pytest.raises(ToolkitError, match="limit="):
        run(tqa_config("model=tiny", f"limit={limit}", f"results_dir={tmp_path}"))


# ------------------------------------------------------------------- real model (slow)
@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["lm_eval", "chat"])
def test_smollm2_logliks_match_a_plain_forward(fmt):
    smollm2 = load_model(tqa_config("model=smollm2").model)
    if fmt == "chat":
        assert context_text("chat", "Why?", smollm2.tokenizer).endswith(
            "<|im_start|>user\nWhy?<|im_end|>\n<|im_start|>assistant\n")
    _check_logliks(smollm2, fmt, load_questions()[:2], n_choices=2)
