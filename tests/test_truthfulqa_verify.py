"""TruthfulQA by verification (mode=verify): P(yes) of every (question, answer), MC1_verify and MC2_verify
against a direct computation (one forward per prompt, no batching, no cache), resumption, the probe's
MC2_verify, bad input."""
from __future__ import annotations

import json
import logging
from functools import partial

import numpy as np
import pandas as pd
import pytest
import torch

from evaluation.multiple_choice import mc2_verify, probe_mc
from toolkit.config import compose_config
from toolkit.errors import ToolkitError, run_entry
from extract.models import load_model
from extract.truthfulqa_pack import load_questions
from truthfulqa.likelihood import PRIMER
from truthfulqa.run import partial_path, result_path, run
from truthfulqa.verify import VERIFY_QUESTION, yes_no_ids

tqa_config = partial(compose_config, "truthfulqa")


# --------------------------------------------------------------------------- metrics
def test_mc2_verify_is_mean_yes_of_true_minus_false():
    p = [[0.9, 0.7, 0.2], [0.1, 0.4, 0.4, 0.6, 0.8], [0.5, 0.5]]
    y = [[1, 1, 0], [1, 0, 0, 0, 0], [0, 1]]
    np.testing.assert_allclose(mc2_verify(p, y), [0.8 - 0.2, 0.1 - 0.55, 0.0], rtol=1e-12)
    # invariant to the number of answers: repeating every answer of a kind changes nothing
    np.testing.assert_allclose(mc2_verify([[0.9, 0.9, 0.2]], [[1, 1, 0]]), mc2_verify([[0.9, 0.2]], [[1, 0]]))
    with pytest.raises(ToolkitError, match="at least one correct and one incorrect"):
        mc2_verify([[0.3, 0.4]], [[1, 1]])


def _table(questions):
    rows = [(r, y) for r, labels in questions for y in labels]
    return pd.DataFrame({"source_row": [r for r, _ in rows], "label": [y for _, y in rows],
                         "object_1": [f"q{r}" for r, _ in rows]})


def test_probe_mc_carries_the_probe_mc2_verify():
    table = _table([(0, [1, 1, 0, 0]), (1, [1, 0, 0]), (2, [1, 0])])
    q = np.array([.9, .2, .5, .95, .4, .4, .1, .3, .6])
    result = probe_mc(table, np.arange(9), q, n_boot=100)
    per_question = [(.9 + .2) / 2 - (.5 + .95) / 2, .4 - (.4 + .1) / 2, .3 - .6]
    assert result["probe_mc2_verify"] == pytest.approx(np.mean(per_question), abs=1e-12)
    lo, hi = result["probe_mc2_verify_ci"]
    assert lo <= result["probe_mc2_verify"] <= hi


# ------------------------------------------------------------------ direct computation
def direct_text(fmt: str, tokenizer, question: str, answer: str) -> str:
    """The verification prompt written out here, independently of truthfulqa.verify."""
    user = f"Q: {question}\nA: {answer}\n{VERIFY_QUESTION}"
    if fmt == "plain":
        return user + "\nAnswer:"
    if fmt == "lm_eval":
        return PRIMER + "\n\n" + user + "\nAnswer:"
    if "assistant" not in tokenizer.chat_template:   # the tiny model: no generation prompt, the slot is <|assistant|>
        return f"<s><|user|>{user}<|end|><|assistant|>"
    return tokenizer.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True,
                                         tokenize=False)


def direct_p_yes(loaded, fmt: str, question: str, answer: str, yes: list[int], no: list[int]) -> float:
    """One forward of the whole prompt (no batch, no padding, no cache): P(yes ids) / P(yes + no ids)."""
    text = direct_text(fmt, loaded.tokenizer, question, answer)
    ids = loaded.tokenizer.encode(text, **({"add_special_tokens": False} if fmt == "chat" else {}))
    with torch.no_grad():
        logits = loaded.model(input_ids=torch.tensor([ids], device=loaded.device)).logits[0, -1]
    prob = torch.softmax(logits.double(), -1)
    return float(prob[yes].sum() / (prob[yes].sum() + prob[no].sum()))


def check_against_direct(cfg, yes_tokens: list[str], no_tokens: list[str], tol: float = 1e-5):
    """Run mode=verify and recompute every P(yes), MC1_verify and MC2_verify directly."""
    result = json.loads(run(cfg).read_text())
    loaded = load_model(cfg.model)
    tok = loaded.tokenizer
    yes, no = tok.convert_tokens_to_ids(yes_tokens), tok.convert_tokens_to_ids(no_tokens)
    assert (result["prompt"]["yes_ids"], result["prompt"]["no_ids"]) == (sorted(yes), sorted(no))
    mc1, mc2 = [], []
    for q, rec in zip(load_questions()[:cfg.limit], result["questions"]):
        p = {a: direct_p_yes(loaded, cfg.format, q.question, a, yes, no) for a in dict.fromkeys(q.mc2_choices)}
        np.testing.assert_allclose(rec["p_yes"], [p[a] for a in q.mc2_choices], atol=tol, rtol=0)
        np.testing.assert_allclose(rec["mc1_p_yes"], [p[a] for a in q.mc1_choices], atol=tol, rtol=0)
        best, others = p[q.best], [p[a] for a in q.incorrect]
        mc1.append(0.0 if max(others) > best else 1.0 / (1 + sum(o == best for o in others)))
        mc2.append(np.mean([p[a] for a in q.correct]) - np.mean([p[a] for a in q.incorrect]))
    assert result["mc1_verify"] == pytest.approx(np.mean(mc1), abs=1e-12)
    assert result["mc2_verify"] == pytest.approx(np.mean(mc2), abs=tol)
    assert result["n_questions"] == cfg.limit and result["mode"] == "verify"
    assert result["prompt"]["yes_tokens"] == [tok.decode([i]) for i in sorted(yes)]
    return result


@pytest.mark.parametrize("fmt", ["plain", "chat", "lm_eval"])
def test_tiny_verify_matches_a_direct_computation(tmp_path, fmt):
    cfg = tqa_config("model=tiny", "mode=verify", f"format={fmt}", "limit=2", "batch_size=5", "n_boot=50",
                     f"results_dir={tmp_path}")
    result = check_against_direct(cfg, ["Y"], ["N"])      # a byte tokenizer: "Yes" / " Yes" start with "Y"
    assert result_path(cfg).name == f"verify-{fmt}-limit2.json" and not partial_path(result_path(cfg)).exists()
    assert "{question}" in result["prompt"]["template"] and VERIFY_QUESTION in result["prompt"]["template"]


class _Interrupt(Exception):
    pass


def test_verify_resumes_to_the_uninterrupted_result(tmp_path):
    common = ["model=tiny", "mode=verify", "format=plain", "limit=4", "batch_size=4", "save_every=2", "n_boot=50"]
    whole = json.loads(run(tqa_config(*common, f"results_dir={tmp_path / 'a'}")).read_text())
    cfg = tqa_config(*common, f"results_dir={tmp_path / 'b'}")

    def stop(batch):
        if batch == 2:
            raise _Interrupt

    with pytest.raises(_Interrupt):
        run(cfg, on_batch=stop)
    assert not result_path(cfg).exists() and partial_path(result_path(cfg)).exists()
    resumed = json.loads(run(cfg).read_text())
    assert resumed["resumed_after_requests"] == 8
    for key in ("mc1_verify", "mc2_verify", "mc1_verify_ci", "mc2_verify_ci", "questions", "prompt"):
        assert resumed[key] == whole[key], key


def test_yes_no_ids_of_the_tiny_tokenizer():
    tok = load_model(tqa_config("model=tiny").model).tokenizer
    ids = yes_no_ids(tok)
    assert ids["tokens"] == {"yes": ["Y"], "no": ["N"]}


@pytest.mark.parametrize("override, message", [("mode=mc3", "mode='mc3': use one of likelihood, verify, generate"),
                                               ("format=qa", "format='qa'")])
def test_bad_verify_input_is_one_line_and_writes_nothing(tmp_path, caplog, override, message):
    cfg = tqa_config("model=tiny", "mode=verify", override, f"results_dir={tmp_path / 'r'}")
    with caplog.at_level(logging.ERROR), pytest.raises(SystemExit):
        run_entry(run, cfg, log=logging.getLogger("truthfulqa.test"))
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and message in errors[0] and "\n" not in errors[0]
    assert not (tmp_path / "r").exists()


# ------------------------------------------------------------------- real model (slow)
@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["chat", "plain"])
def test_smollm2_verify_matches_a_direct_computation(tmp_path, fmt):
    cfg = tqa_config("model=smollm2", "mode=verify", f"format={fmt}", "limit=2", "batch_size=6", "n_boot=50",
                     f"results_dir={tmp_path}")
    result = check_against_direct(cfg, ["Yes", "ĠYes"], ["No", "ĠNo"])
    assert result["model_label"] == "SmolLM2-135M-Instruct (GGUF Q4_1, dequantised to float32)"
