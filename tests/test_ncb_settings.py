"""Issue 31, parts 1-2 (ncb/settings.py, ncb/self_consistency.py, ncb/stress.py): exact self-consistency equals
the share of seeded samples, unanimity and agreement against a direct simulation, cot / reflection prompts as
documented with the answer read at the right position (against one-prompt-at-a-time forwards and a token-by-
token greedy rationale), paired drops, one-line refusals, and a SIGKILLed run resumed to identical outputs."""
from __future__ import annotations

import json
import signal
from pathlib import Path

import numpy as np
import pytest
import torch

from toolkit.config import compose_config
from toolkit.errors import ToolkitError
from ncb.methods import QUESTION
from ncb.self_consistency import agreement, draw_first_answers
from ncb.settings import COT, REFLECT, Answerer
from ncb.stress import _accuracies
from tests.helpers import whole_cities_csv
from tests.test_entry_faults import cli, killed_run
from zero_shot.prompts import chat_messages, get_enumeration
from zero_shot.scoring import option_matrix

STATEMENT, CONTEXT = "The city of Oslo is located in Norway.", "5 of 5 people I asked said that it is in Chile.\n"


def ncb_cfg(tmp_path: Path, *overrides: str):
    return compose_config("ncb", "model=tiny", "method=zero_shot", "zero_shot.batch_size=2",
                          "zero_shot.rationale_tokens=6", f"results_dir={tmp_path}", *overrides)


@pytest.fixture(scope="module")
def answerer(tmp_path_factory):
    return Answerer(ncb_cfg(tmp_path_factory.mktemp("answerer")), tmp_path_factory.mktemp("checkpoints"))


def last_logits(answerer: Answerer, text: str, extra: list[int] = ()) -> torch.Tensor:
    """float [V] next-token logits after a prompt text (and `extra` token ids): one forward, no batch or cache."""
    ids = answerer.renderer.tokenizer(text, add_special_tokens=False)["input_ids"] + list(extra)
    with torch.inference_mode():
        return answerer.loaded.model(input_ids=torch.tensor([ids]), logits_to_keep=1).logits[0, -1].float()


def option_probs(answerer: Answerer, text: str, temperature: float = 1.0) -> np.ndarray:
    """float [7] option probabilities of one prompt text, one unbatched forward without any cache."""
    logits = last_logits(answerer, text)
    return (torch.softmax(logits / temperature, -1) @ option_matrix(answerer.option_ids, len(logits))).numpy()


def test_exact_self_consistency_equals_the_share_of_seeded_samples(answerer):
    """The option probabilities at temperature T (PromptScorer, batched, prefix cache) equal softmax(logits / T)
    of an unbatched forward, and the share of answer tokens sampled at T by the generation code's sampler
    (truthfulqa.generate.Generator._pick, seeded); the majority option's share is the agreement."""
    from truthfulqa.generate import Generator

    temperature, k = 0.3, 20_000
    statements, contexts = [STATEMENT, "The city of Rome is located in Japan."], [CONTEXT, ""]
    exact = answerer.answer("direct", statements, contexts, "exact", sample=(temperature, 0))[0]
    sampler = Generator(answerer.loaded, answerer.stop, 1, temperature, 1.0, 0)
    column = option_matrix(answerer.option_ids, len(answerer.stop)).argmax(1).numpy()   # token -> option / 6 other
    for s, c, q in zip(statements, contexts, exact):
        logits = last_logits(answerer, answerer.texts("direct", [s], [c])[0])
        np.testing.assert_allclose(q, option_probs(answerer, answerer.texts("direct", [s], [c])[0], temperature),
                                   rtol=1e-4, atol=1e-7)
        drawn = sampler._pick(logits.expand(k, -1), torch.Generator().manual_seed(1)).numpy()
        share = np.bincount(column[drawn], minlength=7) / k
        sigma = np.sqrt(q * (1 - q) / k)
        assert np.all(np.abs(share - q) <= 5 * sigma + 1e-4), (share, q)
        assert abs(share[:6][q[:6].argmax()] - agreement(q[None, None, :6])[0][0]) <= 5 * sigma.max() + 1e-4


def test_agreement_and_unanimity_equal_a_simulation():
    rng = np.random.default_rng(0)
    q = rng.dirichlet([8, 1, 1, 0.5, 0.5, 0.5], size=(3, 4)) * 0.9        # 3 targets, 4 answer distributions
    agree, unanimous, majority = agreement(q)
    cdf = np.cumsum(np.concatenate([q, np.full((3, 4, 1), 0.1)], -1), -1)   # 6 = no option
    draws = (rng.random((20_000, 3, 4, 1)) > cdf).sum(-1)                  # [draw, target, sample]
    same = (draws == draws[..., :1]).all(-1) & (draws[..., 0] < 6)
    np.testing.assert_allclose(same.mean(0), unanimous, atol=0.015)
    np.testing.assert_allclose((draws == majority[None, :, None]).mean((0, 2)), agree, atol=0.01)
    direct = np.repeat(q[:, :1], 30, axis=1)                                # one exact distribution, n = 30
    np.testing.assert_allclose(agreement(direct)[1], (q[:, 0] ** 30).sum(1), rtol=1e-9)
    first = draw_first_answers(q[:, 0], 5000, 3)
    np.testing.assert_allclose([np.bincount(f, minlength=6) / 5000 for f in first],
                               q[:, 0] / q[:, 0].sum(1, keepdims=True), atol=0.025)
    np.testing.assert_array_equal(first, draw_first_answers(q[:, 0], 5000, 3))          # seeded


def test_cot_prompt_and_rationale_as_documented(answerer):
    """cot: the prompt without its continuation, COT, a greedy rationale (token by token, full forwards, up
    to the turn's end), then "<rationale>\\n<continuation>"; the answer read at the last token."""
    scores, rationales = answerer.answer("cot", [STATEMENT, STATEMENT], [CONTEXT, ""], "cot")
    tok, continuation = answerer.renderer.tokenizer, answerer.renderer.enum.continuation
    for context, got, rationale in zip([CONTEXT, ""], scores, rationales):
        text = answerer.renderer.text(STATEMENT)
        at = text.index(QUESTION)
        head = text[:at] + context + text[at:-len(continuation)] + COT
        new = []
        for _ in range(6):
            new.append(int(last_logits(answerer, head, new).argmax()))
            if answerer.stop[new[-1]]:
                break
        expected = tok.decode(new, skip_special_tokens=True).strip()
        assert rationale == expected
        full = f"{head} {expected}".rstrip() + "\n" + continuation
        assert answerer.texts("cot", [STATEMENT], [context], rationales=[rationale])[0] == full
        np.testing.assert_allclose(got, option_probs(answerer, full), rtol=1e-4, atol=1e-6)


def test_reflection_prompt_as_documented(answerer):
    """reflection: the first answer as the assistant's turn, REFLECT as the user's, the assistant's turn opened
    with the continuation (tiny's template written out by hand); the answer read at its last token."""
    enum = get_enumeration("default")
    scores = answerer.answer("reflection", [STATEMENT, STATEMENT], [CONTEXT, ""], "reflection", first=[1, 4])[0]
    for context, label, got in zip([CONTEXT, ""], ["2", "5"], scores):
        system, user = (m["content"] for m in chat_messages(STATEMENT, enum))
        expected = (f"<s><|system|>{system}<|end|><|user|>{context}{user}<|end|><|assistant|>The final answer is "
                    f"number {label}.<|end|><|user|>{REFLECT.format(unit='number')}<|end|><|assistant|>"
                    "The final answer is number ")
        text = answerer.texts("reflection", [STATEMENT], [context], first=[int(label) - 1])[0]
        assert text == expected
        np.testing.assert_allclose(got, option_probs(answerer, expected), rtol=1e-4, atol=1e-6)
    from zero_shot.prompts import PromptRenderer, base_prompt
    base = PromptRenderer(answerer.renderer.tokenizer, enum, False)
    expected = base_prompt(STATEMENT, enum) + "3.\n\nSure? The final answer is number "
    assert base.text(STATEMENT, ("3", "Sure?")) == expected


def test_drop_is_the_paired_clean_minus_stressed_accuracy():
    rng = np.random.default_rng(2)
    stressed, clean = rng.random(40) < 0.5, rng.random(40) < 0.8
    entities = np.repeat(np.arange(20), 2).astype(str)
    out = _accuracies(stressed[:25], stressed[25:], clean[:25], clean[25:], entities[:25], entities[25:], 200, 0)
    assert out["high"]["drop"] == pytest.approx(clean[:25].mean() - stressed[:25].mean())
    assert out["low"]["clean_accuracy"] == pytest.approx(clean[25:].mean())
    assert out["high"]["drop_ci"][0] <= out["high"]["drop"] <= out["high"]["drop_ci"][1]
    valid = _accuracies(stressed[:25], stressed[25:], np.ones(25, bool), np.ones(15, bool), entities[:25],
                        entities[25:], 200, 0)                              # direct: clean accuracy 1
    assert valid["high"]["drop"] == 1 - valid["high"]["accuracy"] and valid["high"]["clean_accuracy"] == 1
    np.testing.assert_allclose(valid["high"]["drop_ci"], [1 - valid["high"]["accuracy_ci"][1],
                                                          1 - valid["high"]["accuracy_ci"][0]], atol=1e-12)


@pytest.mark.parametrize("option, needle", [
    ("zero_shot.settings=[cot]", "direct is the baseline"), ("zero_shot.settings=[direct,cot,cot]", "each once"),
    ("zero_shot.settings=[direct,bogus]", "zero_shot.settings"), ("zero_shot.rationale_tokens=0", "rationale_tokens"),
    ("zero_shot.self_consistency.temperature=0", "temperature"), ("zero_shot.self_consistency.n_samples=0",
                                                                  "n_samples"),
    ("zero_shot.self_consistency.seed=abc", "seed")])
def test_settings_options_are_refused_in_one_line(tmp_path, option, needle):
    from ncb.schema import validate

    with pytest.raises(ToolkitError) as err:
        validate(ncb_cfg(tmp_path / "r", option))
    assert needle in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ToolkitError, match="is for method=zero_shot"):
        validate(ncb_cfg(tmp_path / "r", "method='r/seed=0.json'", "zero_shot.settings=[direct,reflection]"))
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_settings_resume_after_sigkill_identical(tmp_path):
    whole_cities_csv(tmp_path / "cities.csv", 8, 2)
    common = ["model=tiny", "data=csv", f"data.path={tmp_path / 'cities.csv'}", "data.name=mini", "method=zero_shot",
              "n_boot=20", "zero_shot.batch_size=4", "zero_shot.save_every=1", "zero_shot.task=true_vs_false",
              "zero_shot.settings=[direct,cot,reflection]", "zero_shot.rationale_tokens=4",
              "zero_shot.self_consistency.n_samples=3"]
    whole = cli("ncb", *common, f"results_dir={tmp_path / 'a'}", logs=tmp_path / "logs")
    assert whole.returncode == 0, whole.stderr[-3000:]
    args = [*common, f"results_dir={tmp_path / 'b'}"]
    killed = killed_run("ncb.settings.atomic_write", 3, "ncb", *args, logs=tmp_path / "logs1")   # a rationale batch
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    out = Path("tiny") / "mini" / "ncb" / "zero_shot_default_true_vs_false_entity_disjoint"
    assert not (tmp_path / "b" / out / "self_consistency.json").exists()
    done = cli("ncb", *args, logs=tmp_path / "logs2")
    assert done.returncode == 0 and "resuming" in done.stderr, done.stderr[-3000:]
    files = sorted(p.name for p in (tmp_path / "a" / out).iterdir())
    assert files == sorted(p.name for p in (tmp_path / "b" / out).iterdir())
    assert {"stress-cot.json", "inputs-reflection.csv", "self_consistency.json"} <= set(files)
    for name in files:
        a, b = (tmp_path / d / out / name for d in "ab")
        if name.endswith(".json"):                 # the same but for the folder and the provenance (time)
            a, b = (json.loads(p.read_text().replace(str(tmp_path / "a"), str(tmp_path / "b"))) for p in (a, b))
            assert without_provenance(a) == without_provenance(b), name
        elif name.endswith(".npz"):
            with np.load(a) as za, np.load(b) as zb:
                np.testing.assert_array_equal(za["scores"], zb["scores"])
        else:
            assert a.read_bytes() == b.read_bytes(), name


def without_provenance(record):
    return {k: v for k, v in record.items() if k != "provenance"} if isinstance(record, dict) else record
