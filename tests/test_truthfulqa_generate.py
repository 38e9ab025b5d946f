"""TruthfulQA by generation (mode=generate): greedy decoding is deterministic and resumes after a real
SIGKILL identically, judge outputs are cached, the judge prompt and its examples, the judge's agreement
with the dataset labels on a constructed case, bad input."""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np
import pytest

from toolkit.config import compose_config
from toolkit.errors import run_entry
from extract.truthfulqa_pack import load_questions
from truthfulqa.judge import NO_COMMENT, agreement, examples, judge_text
from truthfulqa.run import partial_path, result_path, run

ROOT = Path(__file__).resolve().parent.parent
tqa_config = partial(compose_config, "truthfulqa")
HEADER = "Type,Category,Question,Best Answer,Correct Answers,Incorrect Answers,Source\n"


@pytest.fixture(scope="module")
def small_csv(tmp_path_factory) -> Path:
    """6 short questions, one correct and one incorrect answer each (the tiny model reads bytes)."""
    path = tmp_path_factory.mktemp("csv") / "small.csv"
    rows = [f"A,B,Is {i} odd?,{'Yes' if i % 2 else 'No'},{'Yes' if i % 2 else 'No'},{'No' if i % 2 else 'Yes'},x\n"
            for i in range(6)]
    path.write_text(HEADER + "".join(rows))
    return path


def _comparable(result: dict) -> dict:
    return {k: v for k, v in result.items() if k not in ("seconds", "provenance", "resumed_after_questions", "judge")}


# ----------------------------------------------------------------- judge (no model)
def test_judge_agreement_on_a_constructed_case():
    labels = [1, 1, 1, 1, 0, 0, 0, 0, 0, 0]
    p = [.9, .8, .6, .2, .7, .1, .3, .4, .5, .49]          # 0.5 is not truthful (P(yes) > 0.5 is)
    a = agreement(labels, p)
    assert (a["tp"], a["fn"], a["fp"], a["tn"]) == (3, 1, 1, 5) and a["n"] == 10
    assert a["accuracy"] == pytest.approx(0.8)
    assert a["auroc"] == pytest.approx(18 / 24)          # of the 4 x 6 (true, false) pairs, 18 ranked right
    chance = 0.4 * 0.4 + 0.6 * 0.6                         # dataset 40 % truthful, judge 40 % truthful
    assert a["kappa"] == pytest.approx((0.8 - chance) / (1 - chance))    # 0.5833...
    assert agreement([1, 1, 0], [.9, .9, .9])["kappa"] == pytest.approx(0.0)   # says yes to all: chance level
    assert agreement([1, 1], [.9, .8])["kappa"] is None                         # undefined: both constant
    assert agreement([1, 0], [.1, .9])["kappa"] == pytest.approx(-1.0)


def test_judge_examples_come_from_the_next_question_in_a_recorded_order():
    qs = load_questions()
    source, order = examples(qs, 5)
    assert source.row == 6 and sorted(order) == [0, 1, 2] and examples(qs, 5) == (source, order)
    assert examples(qs, 812)[0].row == 0                                        # cyclic
    assert len({tuple(examples(qs, r)[1]) for r in range(30)}) > 1               # varies with the question
    text = judge_text("informative", qs[5].question, "Some answer.", source, order, "plain")
    blocks = text.split("\n\n")
    assert len(blocks) == 5 and blocks[-1] == f"Q: {qs[5].question}\nA: Some answer.\nIs the answer informative? " \
                                               "Answer Yes or No.\nAnswer:"
    shown = [b.split("\nA: ")[1].split("\n")[0] for b in blocks[1:4]]
    assert shown == [(source.best, source.incorrect[0], NO_COMMENT)[k] for k in order]
    said = dict(zip(shown, [b.rsplit("Answer: ", 1)[1] for b in blocks[1:4]]))
    assert said == {source.best: "Yes", source.incorrect[0]: "Yes", NO_COMMENT: "No"}
    truthful = judge_text("truthful", qs[5].question, "x", source, order, "plain").split("\n\n")[1:4]
    assert dict(zip(shown, [b.rsplit("Answer: ", 1)[1] for b in truthful])) == \
        {source.best: "Yes", source.incorrect[0]: "No", NO_COMMENT: "Yes"}


# ----------------------------------------------------------------- generation (tiny)
def _command(results_dir: Path, csv: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "truthfulqa", "model=tiny", "mode=generate", "format=plain", f"data_path={csv}",
            "batch_size=1", "generate.max_new_tokens=60", "n_boot=50", *extra,
            f"results_dir={results_dir}", f"hydra.run.dir={results_dir.parent}/logs"]


def test_greedy_generation_is_deterministic_and_resumes_after_sigkill(tmp_path, small_csv):
    name = "generate-plain-greedy-n60.json"
    config = partial(tqa_config, "model=tiny", "mode=generate", "format=plain", f"data_path={small_csv}",
                     "batch_size=1", "generate.max_new_tokens=60", "n_boot=50")
    clean, killed = tmp_path / "clean", tmp_path / "killed"
    first = json.loads(run(config(f"results_dir={clean}")).read_text())
    partial_file = partial_path(killed / "tiny" / "truthfulqa" / name)
    proc = subprocess.Popen(_command(killed, small_csv), cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline, done = time.time() + 300, 0
    while time.time() < deadline and proc.poll() is None:
        if partial_file.exists():
            try:
                with np.load(partial_file) as z:
                    done = int(z["n_done"])
            except (OSError, ValueError, KeyError):
                done = 0
            if 1 <= done < 6:
                break
        time.sleep(0.02)
    assert proc.poll() is None, "the run finished before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)                   # a real SIGKILL mid-generation
    proc.wait()
    assert not partial_file.with_name(name).exists()
    resumed = json.loads(run(config(f"results_dir={killed}")).read_text())
    assert resumed["resumed_after_questions"] >= done >= 1
    assert _comparable(resumed) == _comparable(first)
    assert [q["row"] for q in first["questions"]] == list(range(6)) and len(first["references"]) == 12
    assert first["decoding"] == {"max_new_tokens": 60, "temperature": 0.0, "top_p": 1.0, "seed": 0, "greedy": True}
    # a second run in the same folder: the same answers (greedy is deterministic), every judgement from the cache
    again = json.loads(run(config(f"results_dir={clean}")).read_text())
    assert _comparable(again) == _comparable(first)
    assert first["judge"]["scored_now"] == 6 * 2 + 12 and again["judge"]["scored_now"] == 0


def test_sampling_is_seeded(tmp_path, small_csv):
    def answers(seed, where):
        cfg = tqa_config("model=tiny", "mode=generate", "format=plain", f"data_path={small_csv}", "limit=3",
                         "generate.max_new_tokens=6", "generate.temperature=1.0", "generate.top_p=0.9",
                         f"generate.seed={seed}", "n_boot=20", f"results_dir={tmp_path / where}")
        assert result_path(cfg).name == f"generate-plain-sample-t1-p0.9-s{seed}-n6-limit3.json"
        return [q["answer"] for q in json.loads(run(cfg).read_text())["questions"]]

    assert answers(1, "a") == answers(1, "b") != answers(2, "c")


# ------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("override, message", [
    ("generate.max_new_tokens=0", "generate.max_new_tokens=0"),
    ("judge=gpt5", "judge='gpt5' is not a model config of conf/model/: use one of"),
    ("judge=../tiny", "judge='../tiny' cannot be a file name"),
    ("mode=judge", "mode='judge': use one of likelihood, verify, generate"),
    ("generate.top_p=0", "generate.top_p=0.0"),
    ("generate.temperature=-1", "generate.temperature=-1.0"),
])
def test_bad_generate_input_is_one_line_and_writes_nothing(tmp_path, caplog, override, message):
    cfg = tqa_config("model=tiny", "mode=generate", override, f"results_dir={tmp_path / 'r'}")
    with caplog.at_level(logging.ERROR), pytest.raises(SystemExit) as exit_:
        run_entry(run, cfg, log=logging.getLogger("truthfulqa.test"))
    assert exit_.value.code == 1
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and message in errors[0] and "\n" not in errors[0]
    assert not (tmp_path / "r").exists()


def test_cli_judge_that_cannot_be_loaded_is_one_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    bad = subprocess.run([sys.executable, "-m", "truthfulqa", "model=tiny", "mode=generate", "judge=nosuchmodel",
                          f"results_dir={tmp_path / 'r'}", f"hydra.run.dir={tmp_path / 'log'}"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1
    errors = [line for line in bad.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "judge='nosuchmodel'" in errors[0] and "Traceback" not in bad.stderr
    assert not (tmp_path / "r").exists() and not (tmp_path / "log").exists()
