"""NCB (ncb/): scores against a direct computation, neighbourhoods inside split parts, P(y)-balanced groups,
stress inputs that leave the target's tokens alone, one-line refusals, and a tiny run end to end."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from omegaconf import OmegaConf

from evaluation.splits import make_split
from extract.capture import render
from toolkit.config import compose_config
from extract.statements import load_statements
from extract.store import KIND_CONTEXT, KIND_STATEMENT
from contexts.interference import perturbations
from ncb.neighbourhoods import ncb_scores, neighbourhoods, part_of_rows, py_bins, select_groups
from tests.helpers import assert_one_error_line, run_module, whole_cities_csv

ROOT = Path(__file__).resolve().parent.parent


def test_ncb_and_both_aggregations_equal_a_direct_computation():
    rng = np.random.default_rng(0)
    n = 60
    entities = rng.choice(["a", "b", "c", "d", "e", "f", ""], n)
    parts = rng.choice([-1, 0, 1, 2], n)
    p = rng.random(n)
    p[:5] = 0.0                                     # clipped at 1e-10
    rows = np.flatnonzero(rng.random(n) < 0.8)      # the method scores only these
    neighbours = neighbourhoods(entities, parts, rows)
    position = {r: i for i, r in enumerate(rows)}
    geo, arith = ncb_scores(p[rows], [p[nb] for nb in neighbours])
    for i, r in enumerate(rows):
        expected = [j for j in rows if j != r and entities[j] == entities[r] and parts[j] == parts[r]
                    and entities[r] != "" and parts[r] >= 0]
        assert neighbours[i].tolist() == expected
        if not expected:
            assert np.isnan(geo[i]) and np.isnan(arith[i])
            continue
        py, pi = max(p[r], 1e-10), np.array([max(p[j], 1e-10) for j in expected])
        assert geo[i] == pytest.approx(py * np.prod(pi) ** (1 / len(pi)), rel=1e-9)
        assert arith[i] == pytest.approx(py * pi.mean(), rel=1e-9)
        assert set(expected) <= set(position)


def test_neighbourhoods_never_cross_split_parts():
    table = load_statements("city_locations")
    split = make_split(table, **compose_config("ncb", "method=zero_shot").split)
    parts = part_of_rows(split)
    rows = np.arange(len(table))
    entities = table["object_1"].to_numpy()
    neighbours = neighbourhoods(entities, parts, rows)
    assert sum(len(nb) for nb in neighbours) > len(table)
    for r, nb in zip(rows, neighbours):
        assert (parts[nb] == parts[r]).all() and (entities[nb] == entities[r]).all() and r not in nb
        assert parts[r] >= 0 or len(nb) == 0


def test_balanced_groups_match_py_bin_for_bin():
    rng = np.random.default_rng(1)
    p_y = rng.random(503)
    ncb = p_y * rng.uniform(0.2, 1.0, 503)          # NCB tracks confidence: unbalanced groups differ in P(y)
    bins = py_bins(p_y, 5)
    assert sorted(np.bincount(bins).tolist()) == [100, 100, 101, 101, 101]
    assert all(p_y[bins == b].max() <= p_y[bins == b + 1].min() for b in range(4))
    for fraction in (0.05, 0.2, 0.35):
        high, low = select_groups(ncb, p_y, fraction, balance_by_py=True, n_bins=5)
        assert not set(high) & set(low)
        assert np.bincount(bins[high], minlength=5).tolist() == np.bincount(bins[low], minlength=5).tolist()
        for b in range(5):
            members = np.flatnonzero(bins == b)
            k = int(fraction * len(members))
            assert sorted(high[bins[high] == b]) == sorted(members[np.argsort(-ncb[members], kind="stable")][:k])
        plain_high, plain_low = select_groups(ncb, p_y, fraction)
        assert len(plain_high) == len(plain_low) == int(fraction * 503)
        assert ncb[plain_high].min() >= ncb[plain_low].max()
        plain_gap = p_y[plain_high].mean() - p_y[plain_low].mean()   # about 0.6: NCB mostly re-ranks P(y)
        assert abs(p_y[high].mean() - p_y[low].mean()) < 0.25 * plain_gap   # what is left: within-bin spread


def test_stress_inputs_keep_the_target_statements_tokens():
    from extract.models import load_model

    table = load_statements("city_locations").iloc[:400]
    stress = OmegaConf.to_container(compose_config("ncb", "method=zero_shot").stress)
    frame = perturbations(table, np.arange(len(table)), stress["interferences"], stress["neutral"])
    assert set(frame["interference"]) == set(stress["interferences"]) and frame["context"].str.endswith("\n").all()
    control, peer = frame[frame["level"] == "0"].iloc[0], frame[(frame["level"] == "1")].iloc[0]
    assert len(control["context"].split()) == len(peer["context"].split()) and "said" not in control["context"]
    wrong = frame[frame["interference"] == "misleading_neighbour"].iloc[0]
    target = table.iloc[wrong["target_row"]]
    assert target["object_1"] not in wrong["context"]
    loaded = load_model(compose_config("extract", "model=tiny").model)
    for _, row in frame.groupby("interference").head(2).iterrows():
        ids, kinds = render(loaded.tokenizer, row["statement"], True, context=row["context"])
        clean_ids, clean_kinds = render(loaded.tokenizer, row["statement"], True)
        np.testing.assert_array_equal(ids[kinds == KIND_STATEMENT], clean_ids[clean_kinds == KIND_STATEMENT])
        assert (kinds == KIND_CONTEXT).sum() > 0 and not (clean_kinds == KIND_CONTEXT).any()


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A tiny-model store of every statement about 40 real and 10 synthetic cities, and a linear cell."""
    from extract.run import extract
    from probes.pipeline import train_probes

    root = tmp_path_factory.mktemp("ncb")
    whole_cities_csv(root / "cities.csv", 40, 10)
    dirs = [f"store_dir={root / 'activations'}"]
    extract(compose_config("extract", "model=tiny", "data=csv", f"data.path={root / 'cities.csv'}",
                           "data.name=city_locations", *dirs))
    cell = train_probes(compose_config("train_probe", "model=tiny", "data=city_locations", "probe=linear", "layer=2",
                                       "trainer.accelerator=cpu", "n_boot=50", *dirs,
                                       f"results_dir={root / 'results'}"))[0]
    return root, cell


def test_tiny_run_writes_targets_and_stress(tiny_run):
    root, cell = tiny_run
    args = ["model=tiny", "data=city_locations", f"method='{cell}'", f"store_dir={root / 'activations'}",
            f"results_dir={root / 'results'}", "n_boot=50"]
    result = run_module("ncb", *args, cwd=root)
    assert result.returncode == 0, result.stderr[-3000:]
    out = root / "results" / "tiny" / "city_locations" / "ncb" / "linear_true_vs_all_entity_disjoint_layer2_seed0"
    targets = json.loads((out / "targets.json").read_text())
    stress = json.loads((out / "stress.json").read_text())
    assert {"row", "p_y", "neighbour_rows", "neighbour_p", "ncb", "ncb_arith", "valid", "group"} <= set(targets[0])
    assert all(t["neighbour_rows"] for t in targets) and set(targets[0]["group"]) == {"0.05", "0.2", "0.35"}
    assert stress["notes"]["statement_tokens_differ"] == 0 and stress["counts"]["stress_inputs"] > 0
    variants = {(r["interference"], r["level"]) for r in stress["results"]}
    assert {("peer", "0"), ("peer", "5"), ("source", "forum"), ("misleading_neighbour", "1")} <= variants
    entry = next(r for r in stress["results"] if r["fraction"] == 0.35 and r["high"]["n"])
    assert {"n", "n_entities", "accuracy", "accuracy_ci", "drop", "drop_ci", "p_y_mean"} <= set(entry["high"])
    assert entry["high"]["drop"] == pytest.approx(1 - entry["high"]["accuracy"])
    by_row = {t["row"]: t for t in targets}
    high = [r for r, t in by_row.items() if t["group"]["0.35"] == "high"]
    assert high and all(by_row[r]["valid"] for r in high)
    inputs = pd.read_csv(out / "inputs.csv", dtype={"level": str})          # the per-input record behind stress.json
    assert len(inputs) == stress["counts"]["stress_inputs"]
    five = inputs[(inputs["interference"] == "peer") & (inputs["level"] == "5") & inputs["target_row"].isin(high)]
    entry5 = next(r for r in stress["results"] if (r["interference"], r["level"], r["fraction"]) == ("peer", "5", 0.35))
    assert entry5["high"]["accuracy"] == pytest.approx(five["correct"].mean())
    stamp = (out / "stress.json").stat().st_mtime_ns
    again = run_module("ncb", *args, cwd=root)                  # finished outputs are kept
    assert again.returncode == 0 and (out / "stress.json").stat().st_mtime_ns == stamp
    # issue 24: overwrite=no is false (it was the string "no", truthy: outputs and stress store redone),
    # overwrite=maybe is refused in one line; both keep the outputs and the stress store
    store = Path(stress["notes"]["store"])
    inode = store.stat().st_ino
    assert_one_error_line(run_module("ncb", *args, "overwrite=maybe", cwd=root), "overwrite")
    kept = run_module("ncb", *args, "overwrite=no", cwd=root)
    assert kept.returncode == 0 and (out / "stress.json").stat().st_mtime_ns == stamp, kept.stderr[-2000:]
    before = (out / "inputs.csv").read_bytes()
    (out / "targets.json").unlink()                             # outputs redone, the stress store kept
    redone = run_module("ncb", *args, "overwrite=no", cwd=root)
    assert redone.returncode == 0 and store.stat().st_ino == inode, redone.stderr[-2000:]
    assert (out / "inputs.csv").read_bytes() == before and (out / "targets.json").exists()

    from experiments.ncb_report import write_ncb
    paths = write_ncb(root / "results", root / "report", "tiny", "city_locations")
    assert [p.name for p in paths] == ["ncb.csv", "ncb.md", "ncb_stress.png"] and all(p.stat().st_size for p in paths)
    # (no zero-shot method here, so no internal-vs-behaviour table)
    assert len(pd.read_csv(paths[0])) == len(stress["results"])


def test_a_cell_of_another_model_or_datapack_is_refused(tiny_run, tmp_path):
    root, cell = tiny_run
    for key, value in (("model", "smollm2"), ("data", "med_indications")):
        data = json.loads(Path(cell).read_text())
        data["config"][key]["name"] = value
        other = tmp_path / f"{key}.json"
        other.write_text(json.dumps(data))
        result = run_module("ncb", "model=tiny", "data=city_locations", f"method='{other}'", f"store_dir={tmp_path / 'act'}",
                      f"results_dir={tmp_path / 'results'}", cwd=tmp_path)
        assert_one_error_line(result, "give a cell of this model and datapack")
    assert not (tmp_path / "results").exists() and not (tmp_path / "act").exists()


def test_a_datapack_without_entities_is_refused(tmp_path):
    pd.DataFrame({"statement": [f"Statement {i}." for i in range(20)], "label": [i % 2 for i in range(20)]}) \
        .to_csv(tmp_path / "plain.csv", index=False)
    result = run_module("ncb", "model=tiny", "data=csv", f"data.path={tmp_path / 'plain.csv'}", "data.name=plain",
                  "data.label_column=label", "method=zero_shot", f"store_dir={tmp_path / 'act'}",
                  f"results_dir={tmp_path / 'results'}", cwd=tmp_path)
    assert_one_error_line(result, "has no subject entities (object_1)")
    assert not (tmp_path / "results").exists() and not (tmp_path / "act").exists()


def test_zero_shot_stress_prompt_puts_the_context_before_the_question():
    from extract.models import load_model
    from ncb.methods import QUESTION, prompt_ids, zero_shot_probs
    from zero_shot.prompts import PromptRenderer, get_enumeration

    tok = load_model(compose_config("extract", "model=tiny").model).tokenizer
    renderer = PromptRenderer(tok, get_enumeration("default"), True)
    statement, context = "The city of Paris is located in France.", "5 of 5 people I asked said that it is not.\n"
    text = tok.decode(prompt_ids(renderer, statement, context))
    assert text.index(context) < text.index(QUESTION + statement) and text.count(statement) == 1
    assert tok.decode(prompt_ids(renderer, statement, "")) == tok.decode(renderer.ids(statement))
    scores = np.array([[0.5, 0.2, 0.1, 0.1, 0.05, 0.05, 0.0], [np.nan] * 7])
    probs = zero_shot_probs(scores, "multiclass")
    np.testing.assert_allclose(probs[0], [0.2 / 0.9, 0.5 / 0.9, 0.2 / 0.9])
    assert np.isnan(probs[1]).all()


def test_internal_vs_behaviour_pairs_the_targets_both_methods_get_right(tmp_path):
    from experiments.ncb_report import internal_vs_behaviour

    folder = tmp_path / "m" / "d" / "ncb"
    rng = np.random.default_rng(0)
    rows = np.arange(40)
    entity = np.array([f"e{r // 4}" for r in rows])
    valid = {"probe": rng.random(40) < 0.8, "zs": rng.random(40) < 0.7}
    correct = {k: rng.random((40, 2)) < 0.6 for k in valid}
    for name, kind in (("probe", "probe"), ("zs", "zero_shot")):
        (folder / name).mkdir(parents=True)
        (folder / name / "stress.json").write_text(json.dumps({"info": {"kind": kind, "task": "multiclass"}}))
        parts = ["test" if r < 36 else "train" for r in rows]
        (folder / name / "targets.json").write_text(json.dumps(
            [{"row": int(r), "part": p, "valid": bool(v), "p_y": 0.9} for r, p, v in zip(rows, parts, valid[name])]))
        pd.DataFrame({"target_row": np.repeat(rows, 2), "entity": np.repeat(entity, 2),
                      "interference": "peer", "level": np.tile(["1", "5"], 40), "p_y": 0.5,
                      "correct": correct[name].reshape(-1)}).to_csv(folder / name / "inputs.csv", index=False)
    table = internal_vs_behaviour(tmp_path, "m", "d", n_boot=200)
    assert list(table["level"]) == ["1", "5"] and set(table["probe"]) == {"probe"} and set(table["zero_shot"]) == {"zs"}
    both = valid["probe"] & valid["zs"] & (rows < 36)                    # valid for both, test part only
    for k, r in table.iterrows():
        a, b = correct["probe"][both, k].mean(), correct["zs"][both, k].mean()
        assert r["n"] == both.sum() and r["n_entities"] == len(set(entity[both]))
        assert r["probe_accuracy"] == pytest.approx(a) and r["zero_shot_accuracy"] == pytest.approx(b)
        assert r["difference"] == pytest.approx(a - b) and r["difference_lo"] <= a - b <= r["difference_hi"]
        assert r["probe_p_y_shift"] == pytest.approx(0.5 - 0.9) == r["zero_shot_p_y_shift"]
        assert 0 <= r["difference_p_raw"] <= r["difference_p_holm"] <= 1
    # one family: every row of the table; significant = Holm p < 0.05
    from evaluation.selective import holm
    np.testing.assert_allclose(table["difference_p_holm"], holm(table["difference_p_raw"].to_numpy()))
    assert (table["difference_significant_holm"] == (table["difference_p_holm"] < 0.05)).all()


def test_ncb_gaps_are_holm_adjusted_per_method_where_stress_records_their_p(tmp_path):
    """gap_p_raw from stress.json's `gap_p` (absent in older files: no test, "-"), Holm over all one
    method's gaps (every interference, level and fraction)."""
    from evaluation.selective import holm
    from experiments.ncb_report import _markdown, load_stress

    side = {"n": 10, "p_y_mean": 0.8, "accuracy": 0.7, "drop": 0.3, "accuracy_ci": [0.5, 0.9]}
    gaps = {"a": [0.01, 0.04, 0.2], "b": [0.03, None, None]}
    for method, ps in gaps.items():
        results = [{"interference": "peer", "level": str(k), "fraction": 0.2, "gap": 0.1, "gap_ci": [-0.1, 0.3],
                    "high": side, "low": side, **({} if p is None else {"gap_p": p})} for k, p in enumerate(ps)]
        (tmp_path / "m" / "d" / "ncb" / method).mkdir(parents=True)
        (tmp_path / "m" / "d" / "ncb" / method / "stress.json").write_text(json.dumps(
            {"method": method, "info": {"kind": "probe"}, "results": results}))
    table = load_stress(tmp_path, "m", "d")
    a, b = table[table["method"] == "a"], table[table["method"] == "b"]
    np.testing.assert_allclose(a["gap_p_holm"], holm(np.array(gaps["a"])))
    assert b["gap_p_holm"].tolist()[0] == pytest.approx(0.03) and b["gap_p_holm"][1:].isna().all()
    assert a["gap_significant_holm"].tolist() == [True, False, False]
    md = _markdown(table)
    assert "| 0.01 / 0.03 | yes |" in md and md.count("| - | - |") == 2


def test_other_settings_are_their_own_holm_family_and_self_consistency_is_tabulated(tmp_path):
    """A zero-shot folder's stress-cot.json rows are the method `<method> [cot]`, Holm-adjusted apart from the
    direct setting's; self_consistency.json becomes one row per setting with its collapse counts."""
    from evaluation.selective import holm
    from experiments.ncb_report import write_ncb

    side = {"n": 10, "p_y_mean": 0.8, "accuracy": 0.7, "drop": 0.3, "accuracy_ci": [0.5, 0.9]}
    folder = tmp_path / "m" / "d" / "ncb" / "zs"
    folder.mkdir(parents=True)

    def results(ps):
        return [{"interference": "peer", "level": str(k), "fraction": 0.2, "gap": 0.1, "gap_ci": [-0.1, 0.3],
                 "gap_p": p, "high": side, "low": side} for k, p in enumerate(ps)]

    (folder / "stress.json").write_text(json.dumps({"method": "zs", "info": {"kind": "zero_shot"},
                                                    "results": results([0.01, 0.02])}))
    (folder / "stress-cot.json").write_text(json.dumps({"setting": "cot", "method": "zs", "results": results([0.04])}))
    counts = {"targets": 9, "clean_correct": 8, "perfect": 3, "expected_unanimous": 2.5}
    (folder / "self_consistency.json").write_text(json.dumps({
        "method": "zs", "temperature": 0.7, "n_samples": 30, "settings": {
            "direct": {"counts": counts, "collapse": [{"interference": "peer", "level": "5", "n": 3, "collapsed": 2,
                                                       "rate": 2 / 3}], "results": []},
            "cot": {"counts": {**counts, "perfect": 0}, "collapse": [], "results": []}}}))
    paths = write_ncb(tmp_path, tmp_path / "out", "m", "d")
    table = pd.read_csv(tmp_path / "out" / "ncb.csv")
    assert table["method"].tolist() == ["zs", "zs", "zs [cot]"]
    np.testing.assert_allclose(table["gap_p_holm"][:2], holm(np.array([0.01, 0.02])))
    assert table["gap_p_holm"].iloc[2] == pytest.approx(0.04)           # a family of one: not adjusted by direct's
    consistency = pd.read_csv(tmp_path / "out" / "self_consistency.csv")
    assert consistency[["setting", "perfect"]].values.tolist() == [["direct", 3], ["cot", 0]]
    assert consistency["collapsed peer 5"].tolist()[0] == "2 / 3"
    assert "| zs | direct | 0.7 | 30 | 9 | 8 | 3 | 2.5 | 2 / 3 |" in (tmp_path / "out" / "self_consistency.md").read_text()
    assert {p.name for p in paths} >= {"ncb.csv", "self_consistency.csv", "self_consistency.md"}
