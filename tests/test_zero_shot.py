"""Zero-shot baseline (zero_shot/): prompts, option ids, scores, resumption and evaluation."""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from sklearn.metrics import matthews_corrcoef

from toolkit.config import compose_config
from extract.models import load_model
from extract.statements import load_statements
from evaluation.splits import make_split
from zero_shot.prompts import (ENUMERATIONS, PromptError, PromptRenderer, base_prompt, get_enumeration,
                               option_token_ids)
from zero_shot.run import run
from zero_shot.scoring import ZeroShotError, compute_scores, partial_path, scores_path

ROOT = Path(__file__).resolve().parent.parent
zs_config = partial(compose_config, "zero_shot")
STATEMENT = "The city of Paris is in France."
OPTIONS = ("1. The statement is correct\n"
           "2. The statement is incorrect\n"
           "3. I do not have sufficient knowledge about the statement\n"
           "4. The statement is too ambiguous to provide a reliable answer\n"
           "5. All of the above options are correct\n"
           "6. None of the above options are applicable")


# ------------------------------------------------------------------------------ prompts
def test_enumerations_follow_the_reference():
    assert get_enumeration("default").labels == ("1", "2", "3", "4", "5", "6")
    assert get_enumeration("shuffled").labels == ("2", "6", "1", "5", "3", "4")
    assert get_enumeration("abc").labels == ("A", "B", "C", "D", "E", "F")
    tf = get_enumeration("tf")
    assert tf.answers[:2] == ("The statement is true", "The statement is false")
    assert tf.answers[2:] == get_enumeration("default").answers[2:]
    assert get_enumeration("shuffled").options_text().splitlines()[:3] == [
        "2. The statement is correct", "6. The statement is incorrect",
        "1. I do not have sufficient knowledge about the statement"]
    assert base_prompt("X is Y.", get_enumeration("abc")).endswith(
        "F. None of the above options are applicable\n\n"
        "Please respond with the corresponding uppercase letter. The final answer is letter ")
    with pytest.raises(PromptError, match="unknown enumeration"):
        get_enumeration("roman")
    assert set(ENUMERATIONS) == {"default", "shuffled", "tf", "abc"}


@pytest.fixture(scope="module")
def tiny():
    return load_model(zs_config("model=tiny").model)


def test_tiny_chat_prompt_without_generation_prompt(tiny):
    """The toy template ignores add_generation_prompt: the assistant header comes from a rendered turn."""
    r = PromptRenderer(tiny.tokenizer, get_enumeration("default"), tiny.use_chat_template)
    assert (r.fold_system, r.assistant_header) == (False, "rendered_assistant_turn")
    text = r.text(STATEMENT)
    assert text == ("<s><|system|>You are an expert in fact-checking. Your task is to assist the user by "
                    "answering questions based on your comprehensive knowledge. Please respond with the "
                    "corresponding number.<|end|><|user|>Question: Is the following statement correct? "
                    f"{STATEMENT}\n\n Select one of the following options:\n{OPTIONS}\n<|end|><|assistant|>"
                    "The final answer is number ")
    ids = r.ids(STATEMENT)
    assert (ids == tiny.tokenizer.bos_token_id).sum() == 1 and ids[0] == tiny.tokenizer.bos_token_id
    assert tiny.tokenizer.decode(ids) == text


def test_option_ids_tiny(tiny):
    tok = tiny.tokenizer
    ids = option_token_ids(tok, get_enumeration("default").labels)
    one = tok.encode("1", add_special_tokens=False)
    assert ids[0] == one and len(one) == 1                     # "1" found; " 1" is [space, "1"]
    space = tok.encode(" ", add_special_tokens=False)
    flat = {i for option in ids for i in option}
    assert not flat & (set(space) | set(tok.all_special_ids))  # neither the bare space nor BOS
    with pytest.raises(PromptError, match="no token id of its own"):
        option_token_ids(tok, ["A", "A", "B"])                # shared ids are removed from every option


# ------------------------------------------------------------------------------- scores
def test_tiny_scores_are_probabilities_and_match_a_plain_forward(tiny, tmp_path):
    cfg = zs_config("model=tiny", "limit=16", "batch_size=8", f"results_dir={tmp_path}", "evaluate=false")
    path = compute_scores(cfg)
    assert path == tmp_path / "tiny" / "city_locations" / "zero_shot" / "scores-default-limit16.npy"
    scores = np.load(path)
    assert scores.shape == (7252, 7) and scores.dtype == np.float32
    done = scores[:16]
    assert np.isnan(scores[16:]).all()
    assert (done >= 0).all()
    np.testing.assert_allclose(done.sum(1), 1.0, atol=1e-5)
    # independent: one unpadded prompt at a time, full logits, no prefix cache
    r = PromptRenderer(tiny.tokenizer, get_enumeration("default"), True)
    ids = option_token_ids(tiny.tokenizer, r.enum.labels)
    statements = load_statements("city_locations")["statement"].tolist()
    for i in (0, 7, 15):
        with torch.inference_mode():
            p = tiny.model(input_ids=torch.from_numpy(r.ids(statements[i]))[None]).logits[0, -1].float().softmax(-1)
        expected = [float(p[o].sum()) for o in ids]
        np.testing.assert_allclose(done[i, :6], expected, atol=1e-6)
        np.testing.assert_allclose(done[i, 6], 1.0 - sum(expected), atol=1e-5)
    meta = json.loads(path.with_suffix(".json").read_text())
    assert meta["prompt"]["example"].endswith("<|assistant|>The final answer is number ")
    # a matching file is reused; one made with another model is refused
    assert compute_scores(cfg) == path
    with pytest.raises(ZeroShotError, match="overwrite=true"):
        compute_scores(zs_config("model=tiny", "model.seed=1", "limit=16", f"results_dir={tmp_path}"))


class _Interrupt(Exception):
    pass


def test_resume_gives_identical_scores(tmp_path):
    common = ["model=tiny", "limit=16", "batch_size=4", "save_every=2", "evaluate=false"]
    whole = np.load(compute_scores(zs_config(*common, f"results_dir={tmp_path / 'a'}")))

    cfg = zs_config(*common, f"results_dir={tmp_path / 'b'}")

    def stop(batch):
        if batch == 1:
            raise _Interrupt

    with pytest.raises(_Interrupt):
        compute_scores(cfg, on_batch=stop)
    final = scores_path(cfg, "-limit16")
    assert not final.exists()
    with np.load(partial_path(final)) as z:
        assert int(z["n_done"]) == 8                   # 2 batches of 4 (saved every 2), then stopped
    resumed = np.load(compute_scores(cfg))
    assert not partial_path(final).exists()
    assert json.loads(final.with_suffix(".json").read_text())["resumed_after"] == 8
    np.testing.assert_array_equal(np.isnan(resumed), np.isnan(whole))
    np.testing.assert_array_equal(resumed[:16], whole[:16])   # bit-identical


# --------------------------------------------------------------------------- evaluation
GROUP_COLUMNS = {0: [1], 1: [0], 2: [2, 3], -1: [4, 5]}   # class (-1 = abstain) -> option columns


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    """Scores of known answers for city_locations: each row names one group (false / true / neither /
    abstain), right 60 % of the time."""
    table = load_statements("city_locations")
    y = table["label"].to_numpy()
    rng = np.random.default_rng(7)
    answer = np.where(rng.random(len(y)) < 0.6, y, rng.choice([0, 1, 2, -1], size=len(y)))
    scores = rng.uniform(0.0, 0.05, size=(len(y), 7)).astype(np.float32)
    for i, a in enumerate(answer):
        cols = GROUP_COLUMNS[int(a)]
        scores[i, cols] += rng.uniform(0.5, 0.8) / len(cols)
    scores /= scores.sum(1, keepdims=True)
    folder = tmp_path_factory.mktemp("synthetic")
    np.save(folder / "scores.npy", scores)
    return table, y, answer, scores, folder


def _cell(results: Path, enumeration, mode, task, split="reference"):
    path = results / "synthetic-model" / "city_locations" / f"zero_shot_{enumeration}_{mode}" / task / split \
        / "layer=none" / "seed=0.json"
    return json.loads(path.read_text())


def test_evaluation_of_a_synthetic_score_file(synthetic, tmp_path):
    table, y, answer, scores, folder = synthetic
    cfg = zs_config(f"scores={folder / 'scores.npy'}", "model.name=synthetic-model", "split=reference",
                    f"results_dir={tmp_path}", "n_boot=10")
    paths = run(cfg)
    assert len(paths) == 10                                    # 5 tasks x 2 modes
    test = make_split(table, kind="reference", seed=42, test_size=0.25, calibration_size=0.25)
    order = np.sort(test.test)                                 # cells list test rows in table order

    # argmax: the named group wins
    cell = _cell(tmp_path, "default", "argmax", "multiclass")
    assert cell["test"]["table_rows"] == order.tolist() and cell["layer"] is None
    assert cell["config"]["probe"]["name"] == "zero_shot_default_argmax"
    assert cell["config"]["task"]["name"] == "multiclass" and cell["split"]["kind"] == "reference"
    pred, truth = answer[order], y[order]
    accepted = pred != -1
    m = cell["metrics"]
    assert m["acceptance"] == pytest.approx(accepted.mean())
    assert m["mcc"] == pytest.approx(matthews_corrcoef(truth[accepted], pred[accepted]))
    assert m["wmcc"] == pytest.approx(matthews_corrcoef(truth[accepted], pred[accepted]) * accepted.mean())
    assert m["n"] == len(order)

    # binary true_vs_all from the same answers
    b = _cell(tmp_path, "default", "argmax", "true_vs_all")["metrics"]
    bin_pred, bin_truth = (pred[accepted] == 1).astype(int), (truth[accepted] == 1).astype(int)
    assert b["mcc"] == pytest.approx(matthews_corrcoef(bin_truth, bin_pred))
    assert b["acceptance"] == pytest.approx(accepted.mean())

    # conformal: LAC sets on the normalised false / true / neither masses, threshold from calibration
    g = np.stack([scores[:, 1], scores[:, 0], scores[:, 2] + scores[:, 3]], 1).astype(np.float64)
    p = g / g.sum(1, keepdims=True)
    cal = np.sort(test.calibration)
    nonconf = np.sort(1.0 - p[cal, y[cal]])
    k = math.ceil((len(cal) + 1) * 0.9)
    sets = (1.0 - p[order]) <= nonconf[k - 1]
    single = sets.sum(1) == 1
    c_pred = np.where(single, sets.argmax(1), -1)
    c = _cell(tmp_path, "default", "conformal", "multiclass")["metrics"]
    assert c["acceptance"] == pytest.approx(single.mean())
    assert c["mcc"] == pytest.approx(matthews_corrcoef(truth[single], c_pred[single]))
    assert c["wmcc"] == pytest.approx(matthews_corrcoef(truth[single], c_pred[single]) * single.mean())
    assert c["coverage"] == pytest.approx(sets[np.arange(len(order)), truth].mean())


def test_reference_folder_layout_and_row_checks(synthetic, tmp_path):
    """The reference publishes one scores.npy per source file: a folder of them = the concatenation."""
    table, y, answer, scores, folder = synthetic
    ref = tmp_path / "prompt" / "default" / "some-model"
    n_real = int((table["source_file"] == "city_locations.csv").sum())
    for name, part in (("city_locations", scores[:n_real]), ("city_locations_synthetic", scores[n_real:])):
        (ref / name).mkdir(parents=True)
        np.save(ref / name / "scores.npy", part)
    common = ["model.name=synthetic-model", "split=reference", "modes=[argmax]", "tasks=[multiclass]", "n_boot=10"]
    run(zs_config(f"scores={ref}", *common, f"results_dir={tmp_path / 'a'}"))
    run(zs_config(f"scores={folder / 'scores.npy'}", *common, f"results_dir={tmp_path / 'b'}"))
    a = _cell(tmp_path / "a", "default", "argmax", "multiclass")
    b = _cell(tmp_path / "b", "default", "argmax", "multiclass")
    assert a["metrics"] == b["metrics"]
    with pytest.raises(ZeroShotError, match="city_locations.csv 5500"):
        run(zs_config(f"scores={ref / 'city_locations' / 'scores.npy'}", *common, f"results_dir={tmp_path}"))
    holes = scores.copy()
    holes[make_split(table, kind="reference", seed=42, test_size=0.25, calibration_size=0.25).test[:3]] = np.nan
    np.save(tmp_path / "holes.npy", holes)
    with pytest.raises(ZeroShotError, match="3 test rows"):
        run(zs_config(f"scores={tmp_path / 'holes.npy'}", *common, f"results_dir={tmp_path}"))


PUBLISHED = ROOT / "tests" / "fixtures" / "trilemma_zero_shot" / "default" / "_llama-3.1-8b"
# (MCC, W-MCC, acceptance) of Llama-3.1-8B-Instruct, its published scores, the reference split's test rows, as
# the reference's notebooks/metrics4zeroshot.ipynb computes them (argmax; MulticlassICP(n_classes=4))
REFERENCE_NUMBERS = {
    "city_locations": {"argmax": (0.6669, 0.6669, 1.0), "conformal+reference": (0.5630, 0.5630, 1.0)},
    "med_indications": {"argmax": (0.3627, 0.3627, 1.0), "conformal+reference": (0.3725, 0.3725, 1.0)},
    "word_definitions": {"argmax": (0.1968, 0.1968, 1.0), "conformal+reference": (0.1967, 0.1967, 1.0)},
}


@pytest.mark.parametrize("datapack", sorted(REFERENCE_NUMBERS))
def test_published_scores_give_the_reference_numbers(datapack, tmp_path):
    run(zs_config(f"scores={PUBLISHED}", "model.name=llama-3.1-8b-instruct", f"data={datapack}", "split=reference",
                  "conformal=reference", "tasks=[multiclass]", "n_boot=10", f"results_dir={tmp_path}"))
    for mode, want in REFERENCE_NUMBERS[datapack].items():
        cell = json.loads((tmp_path / "llama-3.1-8b-instruct" / datapack / f"zero_shot_default_{mode}" / "multiclass"
                           / "reference" / "layer=none" / "seed=0.json").read_text())
        m = cell["metrics"]
        assert (round(m["mcc"], 4), round(m["wmcc"], 4), round(m["acceptance"], 4)) == want
        assert sum(m["accepted_per_label"].values()) == m["n_accepted"]
    assert cell["conformal"]["n_classes"] == 4 and cell["conformal"]["tie_breaking"] is True


def _copy_published(dest: Path, sources: dict[str, str]) -> Path:
    """A score folder whose <name>/ holds the published files of sources[name]."""
    for name, source in sources.items():
        (dest / name).mkdir(parents=True)
        for f in ("scores.npy", "targets.npy"):
            (dest / name / f).write_bytes((PUBLISHED / source / f).read_bytes())
    return dest


def test_misordered_or_short_score_folders_are_refused(tmp_path):
    common = ["model.name=llama-3.1-8b-instruct", "split=reference", "modes=[argmax]", "tasks=[multiclass]",
              "n_boot=10", f"results_dir={tmp_path / 'results'}"]

    def refused(spec, data, match):
        with pytest.raises(ZeroShotError, match=match) as err:
            run(zs_config(f"scores={spec}", f"data={data}", *common))
        assert "\n" not in str(err.value)

    city, synth = "city_locations", "city_locations_synthetic"
    msg = "has 1752 rows but source file city_locations.csv has 5500"
    refused(_copy_published(tmp_path / "swapped", {city: synth, synth: city}), city, msg)   # the city files swapped
    refused(f"[{PUBLISHED / synth / 'scores.npy'},{PUBLISHED / city / 'scores.npy'}]", city, msg)  # a list, misordered
    short = _copy_published(tmp_path / "short", {m: m for m in ("med_indications", "med_indications_synthetic")})
    np.save(short / "med_indications" / "scores.npy", np.load(short / "med_indications" / "scores.npy")[:-1])
    refused(short, "med_indications", "has 5902 rows but source file med_indications.csv has 5903")
    # equal lengths swapped (word_types / word_synonyms: 2000 rows each): targets.npy catches it
    words = {w: w for w in ("word_instances", "word_types_synthetic", "word_instances_synthetic",
                            "word_synonyms_synthetic")}
    crossed = _copy_published(tmp_path / "crossed", {**words, "word_types": "word_synonyms",
                                                     "word_synonyms": "word_types"})
    refused(crossed, "word_definitions", "word_types/targets.npy does not match the `correct` column of word_types.csv")
    refused(f"[{PUBLISHED / 'word_types' / 'scores.npy'},{PUBLISHED / 'word_synonyms' / 'scores.npy'}]",
            "word_definitions", "2 score files for 6 source files")


def test_existing_zero_shot_cells_are_kept_unless_overwrite(synthetic, tmp_path):
    _, _, _, scores, folder = synthetic
    common = ["model.name=synthetic-model", "split=reference", "modes=[argmax]", "tasks=[multiclass]", "n_boot=10",
              f"results_dir={tmp_path}"]
    [path] = run(zs_config(f"scores={folder / 'scores.npy'}", *common))
    before = path.read_text()
    flipped = tmp_path / "flipped.npy"
    np.save(flipped, scores[:, ::-1].copy())
    assert run(zs_config(f"scores={flipped}", *common)) == [path] and path.read_text() == before
    run(zs_config(f"scores={flipped}", *common, "overwrite=true"))
    assert path.read_text() != before


@pytest.mark.slow  # two interpreter starts (torch, transformers, lightning): slow on a busy machine
def test_cli_evaluates_a_score_file_and_reports_errors_in_one_line(synthetic, tmp_path):
    _, _, _, _, folder = synthetic
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    ok = subprocess.run([sys.executable, "-m", "zero_shot", f"scores={folder / 'scores.npy'}", "enumeration=tf",
                         "model.name=synthetic-model", "split=reference", "modes=[conformal]",
                         "tasks=[multiclass]", f"results_dir={tmp_path}", f"hydra.run.dir={tmp_path / 'log'}",
                         "n_boot=10"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr
    assert "W-MCC" in ok.stderr
    assert _cell(tmp_path, "tf", "conformal", "multiclass")["method"]["name"] == "zero_shot_tf_conformal"
    bad = subprocess.run([sys.executable, "-m", "zero_shot", f"scores={tmp_path / 'missing.npy'}",
                          f"results_dir={tmp_path}", f"hydra.run.dir={tmp_path / 'log2'}"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1
    errors = [line for line in bad.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "missing.npy not found" in errors[0]
    assert "Traceback" not in bad.stderr


# ------------------------------------------------------------------- real models (slow)
@pytest.fixture(scope="module")
def smollm2():
    return load_model(zs_config("model=smollm2").model)


@pytest.fixture(scope="module")
def gemma():
    return load_model(zs_config("model=gemma3-270m").model)


SMOLLM2_PROMPT = (
    "<|im_start|>system\n"
    "You are an expert in fact-checking. Your task is to assist the user by answering questions based on "
    "your comprehensive knowledge. Please respond with the corresponding number.<|im_end|>\n"
    "<|im_start|>user\n"
    "Question: Is the following statement correct? The city of Paris is in France.\n"
    "\n"
    " Select one of the following options:\n"
    "1. The statement is correct\n"
    "2. The statement is incorrect\n"
    "3. I do not have sufficient knowledge about the statement\n"
    "4. The statement is too ambiguous to provide a reliable answer\n"
    "5. All of the above options are correct\n"
    "6. None of the above options are applicable\n"
    "<|im_end|>\n"
    "<|im_start|>assistant\n"
    "The final answer is number ")

GEMMA_PROMPT = (
    "Question: Is the following statement correct? The city of Paris is in France.\n"
    "\n"
    "Select one of the following options:\n"
    "2. The statement is correct\n"
    "6. The statement is incorrect\n"
    "1. I do not have sufficient knowledge about the statement\n"
    "5. The statement is too ambiguous to provide a reliable answer\n"
    "3. All of the above options are correct\n"
    "4. None of the above options are applicable\n"
    "\n"
    "Please respond with the corresponding number. The final answer is number ")


@pytest.mark.slow
def test_rendered_prompts_smollm2_chat(smollm2):
    tok = smollm2.tokenizer
    r = PromptRenderer(tok, get_enumeration("default"), smollm2.use_chat_template)
    assert smollm2.use_chat_template and not r.fold_system and r.assistant_header == "generation_prompt"
    assert r.text(STATEMENT) == SMOLLM2_PROMPT
    ids = r.ids(STATEMENT)
    assert tok.decode(ids) == SMOLLM2_PROMPT                         # nothing truncated or added
    start = tok.convert_tokens_to_ids("<|im_start|>")
    assert ids[0] == start and (ids == start).sum() == 3             # system, user, assistant; no extra BOS
    assert tok.convert_tokens_to_ids("<|im_end|>") not in ids[-8:]   # the assistant turn is left open
    assert tok.decode(ids[-6:]) == "The final answer is number "


@pytest.mark.slow
def test_rendered_prompts_gemma_base(gemma):
    tok = gemma.tokenizer
    r = PromptRenderer(tok, get_enumeration("shuffled"), gemma.use_chat_template)
    assert not gemma.use_chat_template
    assert r.text(STATEMENT) == GEMMA_PROMPT
    ids = r.ids(STATEMENT)
    assert ids[0] == tok.bos_token_id and (ids == tok.bos_token_id).sum() == 1
    assert tok.decode(ids[1:]) == GEMMA_PROMPT


@pytest.mark.slow
@pytest.mark.parametrize("which", ["smollm2", "gemma"])
def test_option_ids_real_tokenizers(which, request):
    tok = request.getfixturevalue(which).tokenizer
    ids = option_token_ids(tok, get_enumeration("default").labels)
    for label, option in zip("123456", ids):
        plain = tok.encode(label, add_special_tokens=False)
        assert len(plain) == 1 and plain[0] in option                # the id of "1"
        spaced = tok.encode(" " + label, add_special_tokens=False)   # " 1" = [space, "1"] in both
        assert spaced[-1] in option and spaced[0] not in option
    letters = option_token_ids(tok, get_enumeration("abc").labels)
    for label, option in zip("ABCDEF", letters):                     # "A" and " A" are two tokens
        assert set(option) == {tok.encode(label, add_special_tokens=False)[0],
                               tok.encode(" " + label, add_special_tokens=False)[0]}
    flat = {i for option in ids + letters for i in option}
    assert not flat & set(tok.all_special_ids)


@pytest.mark.slow
def test_smollm2_run_writes_scores_and_cells(tmp_path):
    """CLI end to end on SmolLM2: the held-out rows among the first 96 statements, both modes."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "zero_shot", "model=smollm2", "data=city_locations", "split=reference",
           "rows=heldout", "limit=96", f"results_dir={tmp_path}", f"hydra.run.dir={tmp_path / 'log'}", "n_boot=10"]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stderr[-3000:]
    base = tmp_path / "smollm2" / "city_locations"
    scores = np.load(base / "zero_shot" / "scores-default-limit96-heldout-reference-seed42.npy")
    done = ~np.isnan(scores).any(1)
    assert 20 < done.sum() < 96 and not done[96:].any()
    np.testing.assert_allclose(scores[done].sum(1), 1.0, atol=1e-5)
    for mode in ("argmax", "conformal"):
        for task in ("multiclass", "true_vs_all", "false_vs_all", "neither_vs_all", "true_vs_false"):
            cell = json.loads((base / f"zero_shot_default_{mode}" / task / "reference" / "layer=none"
                               / "seed=0.json").read_text())
            assert {"mcc", "wmcc", "acceptance"} <= set(cell["metrics"])


@pytest.mark.slow
def test_killed_run_resumes_to_identical_scores(tmp_path):
    """SIGKILL a CLI run once its first checkpoint is on disk; the rerun equals an uninterrupted run."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    common = ["model=tiny", "limit=48", "batch_size=4", "save_every=1", "evaluate=false"]
    whole = np.load(compute_scores(zs_config(*common, f"results_dir={tmp_path / 'a'}")))
    cmd = [sys.executable, "-m", "zero_shot", *common, f"results_dir={tmp_path / 'b'}",
           f"hydra.run.dir={tmp_path / 'log'}"]
    final = scores_path(zs_config(*common, f"results_dir={tmp_path / 'b'}"), "-limit48")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not partial_path(final).exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert partial_path(final).exists() and not final.exists()
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, timeout=600)
    resumed = np.load(final)
    assert json.loads(final.with_suffix(".json").read_text())["resumed_after"] > 0
    np.testing.assert_array_equal(resumed[:48], whole[:48])
