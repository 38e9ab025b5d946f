"""TruthfulQA as a probing datapack: its statement table, extraction on the tiny model, the
question-disjoint split, probe MC1 / MC2 against a direct computation, train_probe end to end and
the knows-vs-says report."""
from __future__ import annotations

import json
from functools import partial

import numpy as np
import pandas as pd
import pytest

from evaluation.cells import read_cell, write_cell
from evaluation.splits import entity_groups, make_split
from evaluation.tasks import TaskError, task_targets
from experiments.truthfulqa_report import write_truthfulqa
from toolkit.config import compose_config
from extract.models import load_model
from extract.run import extract
from extract.statements import COLUMNS, load_statements
from extract.store import KIND_CONTEXT, KIND_STATEMENT, ActivationStore
from probes.pipeline import train_probes
from extract.truthfulqa_pack import load_questions
from evaluation.multiple_choice import mc_scores, probe_mc

probe_config = partial(compose_config, "train_probe")
LIMIT = 150   # limit=150: a label-stratified subset of whole questions, at most 150 statements


# ------------------------------------------------------------------------ the table
def test_table_holds_every_mc2_choice_best_answer_first():
    table = load_statements("truthfulqa")
    questions = load_questions()
    assert list(table.columns) == COLUMNS and len(table) == sum(len(q.mc2_choices) for q in questions)
    assert (table["object_2"] == "").all() and not table["negation"].any()
    by_row = table.groupby("source_row").indices
    for q in questions:
        part = table.iloc[by_row[q.row]]
        labels, answers = part["label"].to_numpy(), part["statement"].tolist()
        assert sorted(zip(answers, labels)) == sorted(zip(q.mc2_choices, q.mc2_labels))  # duplicates kept
        assert answers[0] == q.best and labels[0] == 1
        assert [answers[0], *part["statement"][labels == 0]] == q.mc1_choices       # MC1 from the table
        assert (part["object_1"] == q.question).all() and (part["context"] == f"Q: {q.question}\nA: ").all()
    assert table["label"].isin([0, 1]).all()


def test_entity_groups_are_questions():
    table = load_statements("truthfulqa")
    groups = entity_groups(table)
    assert len(np.unique(groups)) == table["source_row"].nunique()
    assert (pd.Series(groups).groupby(table["source_row"]).nunique() == 1).all()


# ------------------------------------------------------------------------ extraction
@pytest.fixture(scope="module")
def tqa_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tqa")
    extract(compose_config("extract", "model=tiny", "data=truthfulqa", f"limit={LIMIT}", "layers=[1,4]",
                           f"store_dir={root / 'activations'}"))
    return root


def test_answer_tokens_are_the_statement_and_the_question_is_context(tqa_dirs):
    tok = load_model(compose_config("extract", "model=tiny").model).tokenizer
    with ActivationStore(tqa_dirs / "activations" / "tiny" / "truthfulqa.h5") as store:
        table, off, kind, ids = store.table, store.offsets, store.token_kind, store.token_ids
        assert 0 < len(table) <= LIMIT and store.attrs["datapack"] == "truthfulqa"
        for i in range(len(table)):
            own, k = ids[off[i]:off[i + 1]], kind[off[i]:off[i + 1]]
            assert tok.decode(own[k == KIND_STATEMENT]).strip() == table["statement"].iat[i]
            assert tok.decode(own[k == KIND_CONTEXT]) == table["context"].iat[i]
            assert np.flatnonzero(k == KIND_CONTEXT).max() < np.flatnonzero(k == KIND_STATEMENT).min()
            # the tiny model's byte tokenizer: the answer's ids are those of the answer alone
            assert own[k == KIND_STATEMENT].tolist() == tok(table["statement"].iat[i], add_special_tokens=False)["input_ids"]


# ------------------------------------------------------------------------ split
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("n", [LIMIT, None])
def test_question_disjoint_never_puts_a_question_in_two_parts(seed, n):
    table = load_statements("truthfulqa").iloc[:n]
    split = make_split(table, kind="question_disjoint", seed=seed)
    parts = [set(table["source_row"].to_numpy()[p]) for p in (split.train, split.calibration, split.test)]
    assert not (parts[0] & parts[1] or parts[0] & parts[2] or parts[1] & parts[2])
    assert sum(split.sizes()[k] for k in ("train", "calibration", "test")) == len(table)   # nothing dropped
    s = split.summary()
    assert s["kind"] == "question_disjoint" and s["test_rows_sharing_train_entity"] == 0.0
    if n is None:
        assert abs(s["fractions_of_kept"]["test"] - 0.25) < 0.01 and abs(s["fractions_of_kept"]["train"] - 0.55) < 0.01


def test_question_disjoint_is_the_default_split_of_truthfulqa_only():
    assert probe_config("data=truthfulqa").split.kind == "question_disjoint"
    assert probe_config("data=truthfulqa", "split=entity_disjoint").split.kind == "entity_disjoint"
    assert probe_config("data=city_locations").split.kind == "entity_disjoint"
    assert "split_default" not in compose_config("extract", "data=truthfulqa")


@pytest.mark.parametrize("task", ["multiclass", "neither_vs_all"])
def test_tasks_needing_neither_are_refused_in_one_line(task):
    with pytest.raises(TaskError, match="needs statements of every class") as err:
        task_targets(load_statements("truthfulqa")["label"].to_numpy(), task)
    assert "\n" not in str(err.value)


# ------------------------------------------------------------------------ probe MC
def _table(questions: list[tuple[int, list[int]]]) -> pd.DataFrame:
    """A truthfulqa-like table: (source_row, labels of its statements, best answer first)."""
    rows = [(r, y) for r, labels in questions for y in labels]
    return pd.DataFrame({"source_row": [r for r, _ in rows], "label": [y for _, y in rows],
                         "object_1": [f"q{r}" for r, _ in rows]})


def test_probe_mc_equals_a_direct_computation():
    table = _table([(5, [1, 1, 0, 0]), (9, [1, 0, 0]), (2, [1, 1]), (7, [1, 0, 0]), (4, [1, 1, 0]), (8, [1, 0, 0])])
    p = {0: .9, 1: .2, 2: .5, 3: .95,   # q5: the best loses to an incorrect answer
         4: .4, 5: .4, 6: .1,           # q9: the best ties with one incorrect answer at the top: 1 / 2
         7: .3, 8: .6,                  # q2: no incorrect answer among its statements (limit): skipped
         9: .8, 10: .1,                 # q7: its last statement is not scored: skipped
         12: 0.0, 13: 0.0, 14: 0.0,     # q4: all zero: MC1 choices 12 and 14 tie (1 / 2), MC2 = 2 / 3
         15: .7, 16: .7 - 1e-12, 17: .1}   # q8: a strict win by a hair scores 1, no tie
    rows = np.array(list(p))[::-1]      # any order
    result = probe_mc(table, rows, np.array([p[r] for r in rows]), seed=0, n_boot=200)
    assert result["probe_mc_questions"] == [4, 5, 8, 9] and result["probe_mc_skipped"] == 2
    mc1 = [1 / 2, 0.0, 1.0, 1 / 2]                      # q4, q5, q8, q9
    mc2 = [2 / 3, (.9 + .2) / (.9 + .2 + .5 + .95), .7 / (.7 + .7 - 1e-12 + .1), .4 / (.4 + .4 + .1)]
    assert result["probe_mc1"] == pytest.approx(np.mean(mc1))
    assert result["probe_mc2"] == pytest.approx(np.mean(mc2))
    assert result["probe_mc1_ties"] == 2                # q4 and q9
    for k in ("probe_mc1", "probe_mc2"):
        lo, hi = result[f"{k}_ci"]
        assert lo <= result[k] <= hi
    assert result == probe_mc(table, rows, np.array([p[r] for r in rows]), seed=0, n_boot=200)


def test_a_constant_probe_scores_chance_not_one():
    labels = [[1, 0], [1, 1, 0, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0, 0]]
    table = _table(list(enumerate(labels)))
    result = probe_mc(table, np.arange(len(table)), np.full(len(table), 0.37), n_boot=50)
    k = [1 + labels_.count(0) for labels_ in labels]   # MC1 choices: the best answer and the incorrect ones
    assert result["probe_mc1"] == pytest.approx(np.mean([1 / n for n in k]))   # (1/2 + 1/4 + 1/4 + 1/7) / 4
    assert result["probe_mc1_ties"] == len(labels)
    assert result["probe_mc2"] == pytest.approx(np.mean([y.count(1) / len(y) for y in labels]))


def test_a_tie_below_the_top_or_between_others_is_no_tie_of_the_best():
    table = _table([(0, [1, 0, 0, 0]), (1, [1, 0, 0, 0])])
    q = np.array([.9, .3, .3, .1,       # best strictly first; two incorrect answers tie below it: 1
                  .2, .6, .6, .1])      # two incorrect answers tie above the best: 0
    result = probe_mc(table, np.arange(8), q, n_boot=50)
    assert result["probe_mc1"] == 0.5 and result["probe_mc1_ties"] == 0


def test_probe_mc_refuses_what_it_cannot_score():
    table = _table([(0, [1, 0]), (1, [0, 1])])
    with pytest.raises(Exception, match="does not start with its best answer"):
        probe_mc(table, np.arange(4), np.full(4, .5))
    with pytest.raises(Exception, match="no question has all its answers"):
        probe_mc(table, np.array([0]), np.array([.5]))
    with pytest.raises(Exception, match="one probability each"):
        probe_mc(table, np.arange(2), np.full(3, .5))


# ---------------------------------------------------------------- train_probe + report
@pytest.fixture(scope="module")
def tqa_cells(tqa_dirs):
    run = partial(probe_config, "model=tiny", "data=truthfulqa", f"store_dir={tqa_dirs / 'activations'}",
                  f"results_dir={tqa_dirs / 'results'}", "n_boot=50", "layer=all", "task=true_vs_false")
    paths = train_probes(run("probe=linear")) + train_probes(run("probe=mean_diff"))
    with ActivationStore(tqa_dirs / "activations" / "tiny" / "truthfulqa.h5") as store:
        table = store.table
    rows, _ = task_targets(table["label"].to_numpy(), "true_vs_false")
    for path in paths:   # the probe MC a truthfulqa cell carries (computed here until the pipeline adds it)
        cell = read_cell(path)
        test = cell["test"]
        expected = probe_mc(table, rows[test["rows"]], np.array(test["probs"])[:, 1], seed=0, n_boot=50)
        if "probe_mc1" in cell["metrics"]:
            assert {k: cell["metrics"][k] for k in expected} == expected
        else:
            cell["metrics"].update(expected)
            write_cell(path, cell)
    return paths, table


def test_train_probe_on_truthfulqa_end_to_end(tqa_cells):
    paths, table = tqa_cells
    assert len(paths) == 4
    for path in paths:
        cell = read_cell(path)
        assert cell["split"]["kind"] == "question_disjoint" and "/question_disjoint/" in str(path)
        test_questions = set(table["source_row"].to_numpy()[cell["test"]["rows"]])
        assert set(cell["metrics"]["probe_mc_questions"]) <= test_questions
        assert 0 <= cell["metrics"]["probe_mc1"] <= 1 and 0 < cell["metrics"]["probe_mc2"] < 1


def test_knows_vs_says_report(tqa_cells, tqa_dirs, tmp_path):
    paths, _ = tqa_cells
    rng = np.random.default_rng(0)
    questions = [{"row": q.row, "mc1_logliks": rng.normal(-20, 3, len(q.mc1_choices)).tolist(),
                  "mc2_logliks": rng.normal(-20, 3, len(q.mc2_choices)).tolist(), "mc2_labels": q.mc2_labels}
                 for q in load_questions()[:30]]
    mc1, mc2 = mc_scores(*zip(*[(q["mc1_logliks"], q["mc2_logliks"], q["mc2_labels"]) for q in questions]))
    likelihood = {"format": "lm_eval", "n_questions": 30, "mc1": mc1.mean(), "mc2": mc2.mean(),
                  "mc1_ci": [0.1, 0.9], "mc2_ci": [0.2, 0.8], "questions": questions}
    (tqa_dirs / "results" / "tiny" / "truthfulqa" / "likelihood-lm_eval.json").write_text(json.dumps(likelihood))
    verify = {"format": "chat", "n_questions": 30, "mc1_verify": 0.3, "mc2_verify": 0.01, "mc1_verify_ci": [0.1, 0.5],
              "mc2_verify_ci": [-0.02, 0.04],
              "questions": [{"row": q.row, "p_yes": rng.random(len(q.mc2_choices)).tolist(), "mc2_labels": q.mc2_labels}
                            for q in load_questions()[:30]]}
    for q, rec in zip(load_questions()[:30], verify["questions"]):     # MC1 choices: the best and the incorrect
        p = dict(zip(q.mc2_choices, rec["p_yes"]))
        rec["mc1_p_yes"] = [p[a] for a in q.mc1_choices]
    (tqa_dirs / "results" / "tiny" / "truthfulqa" / "verify-chat.json").write_text(json.dumps(verify))
    csv, md, csv_all, md_all, png = write_truthfulqa(tqa_dirs / "results", tmp_path, "tiny")
    table = pd.read_csv(csv_all)
    assert len(table) == len(paths) and png.stat().st_size > 0
    assert md_all.read_text().startswith("All layers, not a selection") and "| probe | task |" in md_all.read_text()
    assert "Likelihood (lm_eval, all 30 questions)" in md.read_text()
    by_row = {q["row"]: q for q in questions}
    for path in paths:
        cell = read_cell(path)
        m = cell["metrics"]
        r = table[(table["probe"] == cell["config"]["probe"]["name"]) & (table["layer"] == cell["layer"])].iloc[0]
        assert (r["probe_mc1"], r["probe_mc2"], r["mcc"]) == pytest.approx((m["probe_mc1"], m["probe_mc2"], m["mcc"]))
        assert (r["probe_mc1_lo"], r["probe_mc2_hi"]) == pytest.approx((m["probe_mc1_ci"][0], m["probe_mc2_ci"][1]))
        assert r["probe_mc1_ties"] == m["probe_mc1_ties"]
        same = [by_row[q] for q in m["probe_mc_questions"]]
        s1, s2 = mc_scores(*zip(*[(q["mc1_logliks"], q["mc2_logliks"], q["mc2_labels"]) for q in same]))
        assert (r["likelihood_mc1_same"], r["likelihood_mc2_same"]) == pytest.approx((s1.mean(), s2.mean()))
        assert r["probe_mc2_verify"] == pytest.approx(m["probe_mc2_verify"])
        v = {q["row"]: q for q in verify["questions"]}
        v1 = [(lambda x: float(x[0] == max(x)) / sum(y == max(x) for y in x))(v[row]["mc1_p_yes"])
              for row in m["probe_mc_questions"]]
        v2 = [np.mean([p for p, y in zip(v[row]["p_yes"], v[row]["mc2_labels"]) if y])
              - np.mean([p for p, y in zip(v[row]["p_yes"], v[row]["mc2_labels"]) if not y])
              for row in m["probe_mc_questions"]]
        assert (r["verify_mc1_same"], r["verify_mc2_same"]) == pytest.approx((np.mean(v1), np.mean(v2)))
    assert "Verification (chat, all 30 questions): MC1 0.300" in md.read_text()


def test_the_report_shows_one_layer_per_probe_chosen_on_calibration(tqa_cells, tqa_dirs, tmp_path):
    paths, _ = tqa_cells
    cal = {}                            # probe -> {layer: calibration MCC}
    for path in paths:
        cell = read_cell(path)
        cal.setdefault(cell["config"]["probe"]["name"], {})[cell["layer"]] = cell["calibration_metrics"]["mcc_all"]
    chosen = pd.read_csv(write_truthfulqa(tqa_dirs / "results", tmp_path, "tiny")[0])
    assert sorted(chosen["probe"]) == sorted(cal)                 # one row per probe (one seed)
    for probe, by_layer in cal.items():
        assert chosen.set_index("probe").loc[probe, "layer"] == max(by_layer, key=by_layer.get)


def test_the_report_refuses_cells_of_the_old_tie_rule(tqa_cells, tmp_path):
    paths, _ = tqa_cells
    cell = read_cell(paths[0])
    del cell["metrics"]["probe_mc1_ties"]
    stale = tmp_path / "results" / paths[0].relative_to(paths[0].parents[6])
    stale.parent.mkdir(parents=True)
    write_cell(stale, cell)
    with pytest.raises(Exception, match="old tie rule") as err:
        write_truthfulqa(tmp_path / "results", tmp_path / "out", "tiny")
    assert "\n" not in str(err.value)


def test_trilemma_probes_scored_on_truthfulqa_are_on_the_behaviour_page(tqa_dirs, tmp_path):
    from probes.apply import apply_to_store
    from experiments.truthfulqa_report import behaviour_page

    store_dir, results_dir = tqa_dirs / "activations", tmp_path / "results"
    extract(compose_config("extract", "model=tiny", "data=city_locations", "limit=200", "layers=[4]",
                           f"store_dir={store_dir}"))
    [cell_file] = train_probes(probe_config("model=tiny", "data=city_locations", "probe=linear", "task=true_vs_false",
                                            "layer=4", f"store_dir={store_dir}", f"results_dir={results_dir}",
                                            "n_boot=20"))
    transfer = apply_to_store(cell_file, "truthfulqa", store_dir, results_dir)
    assert transfer.parts[-6] == "city_locations->truthfulqa"
    rng = np.random.default_rng(1)
    questions = [{"row": q.row, "mc1_logliks": rng.normal(-20, 3, len(q.mc1_choices)).tolist(),
                  "mc2_logliks": rng.normal(-20, 3, len(q.mc2_choices)).tolist(), "mc2_labels": q.mc2_labels}
                 for q in load_questions()]
    mc1, mc2 = mc_scores(*zip(*[(q["mc1_logliks"], q["mc2_logliks"], q["mc2_labels"]) for q in questions]))
    (results_dir / "tiny" / "truthfulqa").mkdir(parents=True)
    (results_dir / "tiny" / "truthfulqa" / "likelihood-lm_eval.json").write_text(json.dumps(
        {"format": "lm_eval", "n_questions": len(questions), "mc1": mc1.mean(), "mc2": mc2.mean(), "mc1_ci": [0, 1],
         "mc2_ci": [0, 1], "questions": questions, "model_label": "tiny", "seconds": 1.0}))
    page = behaviour_page(results_dir, "tiny")
    m = read_cell(transfer)["metrics"]
    by_row = {q["row"]: q for q in questions}
    same = mc_scores(*zip(*[(by_row[r]["mc1_logliks"], by_row[r]["mc2_logliks"], by_row[r]["mc2_labels"])
                            for r in m["probe_mc_questions"]]))[0].mean()
    row = (f"| city_locations | linear (true_vs_false, 4) | {m['mcc']:.3f} [{m['mcc_ci'][0]:.3f}, {m['mcc_ci'][1]:.3f}] | "
           f"{m['auroc']:.3f} | {m['probe_mc1']:.3f} [{m['probe_mc1_ci'][0]:.3f}, {m['probe_mc1_ci'][1]:.3f}] | "
           f"{m['probe_mc1_ties']} | {len(m['probe_mc_questions'])} | {same:.3f} |")
    assert "## Transfer of the Trilemma probes" in page and row in page
    del m["probe_mc1_ties"]                                   # a transfer cell of the old tie rule: refused
    stale = read_cell(transfer)
    stale["metrics"] = m
    write_cell(transfer, stale)
    with pytest.raises(Exception, match="old tie rule"):
        behaviour_page(results_dir, "tiny")
