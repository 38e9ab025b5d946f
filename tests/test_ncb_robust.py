"""Issue 31, parts 3-4: structure-aware probe training and its neutral control (probes/augment.py, `train_probe
augment=structure_aware | neutral`) and the paired comparison of their stress drops and clean metrics with the
plain probe's (experiments/ncb_robust.py)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from omegaconf import OmegaConf
from sklearn.metrics import matthews_corrcoef, roc_auc_score

from evaluation.selective import cluster_bootstrap_indices
from evaluation.splits import Split, make_split
from toolkit.config import compose_config
from toolkit.errors import ToolkitError
from extract.statements import load_statements
from probes.augment import training_inputs
from contexts.interference import as_clause, control_text
from probes.features import Features
from probes.pipeline import training_rows
from tests.helpers import whole_cities_csv

DATAPACKS = ("city_locations", "med_indications", "word_definitions")


def _augment_config(*overrides: str):
    cfg = compose_config("train_probe", "augment=structure_aware", *overrides)
    return cfg, OmegaConf.to_container(cfg.augment.stress)


@pytest.mark.parametrize("datapack", DATAPACKS)
def test_training_set_holds_no_calibration_or_test_entity(datapack):
    """From the statement table and the split alone: every target and every statement a context quotes is a
    training statement, a context is its template and those clauses and nothing else, and no calibration or
    test entity is named in any context once the training entities it quotes are blanked out (a held-out
    name may be part of a training one: "heartburn" in "nocturnal heartburn"). The neutral control has the
    same inputs, each context the neutral passage at the same word count."""
    cfg, stress = _augment_config()
    table = load_statements(datapack)
    split = make_split(table, **cfg.split)
    frame = training_inputs(table, split, stress["interferences"], stress["neutral"], "structure_aware")
    train = set(split.train.tolist())
    held = np.concatenate([split.calibration, split.test])
    held_entities = (set(table["object_1"].to_numpy()[held]) | set(table["object_2"].to_numpy()[held])) - {""}
    quoted = {r for rows in frame["claim_rows"] for r in rows}
    assert frame.groupby("target_row").size().median() >= 10
    assert set(frame["interference"]) == set(stress["interferences"])
    assert set(frame["target_row"]) <= train and quoted <= train
    used = table.iloc[sorted(quoted | set(frame["target_row"]))]
    assert not (set(used["object_1"]) | set(used["object_2"])) & held_entities

    skeleton = {(i, str(level)): t for i, levels in stress["interferences"].items() for level, t in levels.items()}
    held_names = {tuple(_words(e)) for e in held_entities}
    longest = max(len(n) for n in held_names)
    statements, object_1, object_2 = (table[c].to_numpy() for c in ("statement", "object_1", "object_2"))
    for row in frame.itertuples():
        template = skeleton[row.interference, row.level]
        if template == "control":
            n_words = len(row.context.split())
            assert row.claim_rows == [] and row.context == control_text(stress["neutral"], n_words) + "\n"
            continue
        text = row.context.lower()
        for clause in sorted((as_clause(statements[r]).lower() for r in row.claim_rows), key=len, reverse=True):
            assert clause in text
            text = text.replace(clause, "", 1)
        assert text == template.format(false="", true="", neighbour="").lower() + "\n"
        blanked = row.context
        quoted_train = [r for r in row.claim_rows if r in train]
        for name in sorted({n for r in quoted_train for n in (object_1[r], object_2[r]) if n}, key=len, reverse=True):
            blanked = blanked.replace(name, " ")
        words = _words(blanked)
        named = {tuple(words[i:i + n]) for n in range(1, longest + 1) for i in range(len(words) - n + 1)} & held_names
        assert not named, (row.context, named)


def _words(text: str) -> list[str]:
    """Lower-cased words: what is between spaces and the marks . , ( ) /."""
    return re.findall(r"[^\s.,()/]+", text.lower())


def test_neutral_control_and_per_statement_draws():
    """neutral: the structure-aware inputs, each context the neutral passage at its word count, quoting nothing;
    per_statement=k keeps k inputs of each statement, the same ones for both kinds."""
    cfg, stress = _augment_config()
    table = load_statements("city_locations").iloc[:600]
    split = make_split(table, **cfg.split)
    every = training_inputs(table, split, stress["interferences"], stress["neutral"], "structure_aware")
    neutral = training_inputs(table, split, stress["interferences"], stress["neutral"], "neutral")
    keys = ["target_row", "interference", "level", "statement", "label"]
    assert len(every) > 100 and neutral[keys].equals(every[keys]) and (neutral["claim_rows"].map(len) == 0).all()
    lengths = every["context"].str.split().map(len)
    assert neutral["context"].tolist() == [control_text(stress["neutral"], n) + "\n" for n in lengths]
    kinds = [training_inputs(table, split, stress["interferences"], stress["neutral"], kind, 2, seed=3)
             for kind in ("structure_aware", "neutral")]
    keys = ["target_row", "interference", "level"]
    assert kinds[0][keys].equals(kinds[1][keys])
    assert (kinds[0].groupby("target_row").size() == every.groupby("target_row").size().clip(upper=2)).all()
    assert kinds[0].merge(every, on=keys + ["context"]).shape[0] == len(kinds[0])   # a subset of every input


def test_bad_augment_options_are_one_line_errors():
    from probes.schema import validate

    assert "augment" not in validate(compose_config("train_probe"))        # a plain run's cells hold no augment key
    for option, needle in (("augment.per_statement=0", "augment.per_statement=0"),
                           ("augment.kind=angry", "augment.kind"), ("augment.extract.window_mb=0", "window_mb")):
        with pytest.raises(ToolkitError) as err:
            validate(_augment_config(option)[0])
        assert needle in str(err.value) and "\n" not in str(err.value)
    cfg, stress = _augment_config()
    table = load_statements("city_locations").iloc[:300]
    with pytest.raises(ToolkitError, match="stress.interferences.peer.1"):
        training_inputs(table, make_split(table, **cfg.split), {"peer": {"1": "{lie}"}}, stress["neutral"],
                        "structure_aware")


def test_training_rows_add_the_copies_of_the_tasks_statements_to_training_only():
    split = Split(kind="entity_disjoint", seed=0, n_rows=10, train=np.arange(5), calibration=np.array([5, 6]),
                  test=np.array([7, 8, 9]), dropped=np.zeros(0, dtype=np.int64))
    rows = np.array([0, 2, 3, 5, 7, 8, 9])                 # a task without rows 1, 4 and 6
    bank, parts, copied = training_rows(rows, split, np.zeros(0, dtype=np.int64), 10)
    assert bank.tolist() == rows.tolist() and copied.tolist() == []
    assert {k: v.tolist() for k, v in parts.items()} == {"train": [0, 1, 2], "calibration": [3], "test": [4, 5, 6]}
    bank, parts, copied = training_rows(rows, split, np.array([2, 1, 0, 2, 3]), 10)   # inputs 10..14 copy these
    assert bank.tolist() == [0, 2, 3, 5, 7, 8, 9, 10, 12, 13, 14] and copied.tolist() == [1, 0, 1, 2]
    assert parts["train"].tolist() == [0, 1, 2, 7, 8, 9, 10] and parts["test"].tolist() == [4, 5, 6]


@pytest.mark.parametrize("bags", [False, True])
def test_extended_features_hold_both_parts_in_order(bags):
    rng = np.random.default_rng(0)

    def part(n, groups):
        if not bags:
            return Features(torch.from_numpy(rng.standard_normal((n, 3)).astype(np.float32)), None, np.array(groups))
        lengths = rng.integers(1, 4, n)
        offsets = torch.from_numpy(np.r_[0, np.cumsum(lengths)])
        return Features(torch.from_numpy(rng.standard_normal((int(lengths.sum()), 3)).astype(np.float32)), offsets,
                        np.array(groups))

    a, b = part(3, [0, 1, 2]), part(2, [5, 6])
    both = a.extend(b)
    assert len(both) == 5 and both.groups.tolist() == [0, 1, 2, 5, 6]
    for whole, rows in ((a, [0, 1, 2]), (b, [3, 4])):
        torch.testing.assert_close(both.subset(np.array(rows)).X, whole.X)


def test_augmented_fit_trains_on_the_copies_and_its_cells_carry_the_option(tmp_path, monkeypatch):
    """On a synthetic store, with the augmented store replaced by its statements' vectors moved along one axis
    (the extraction is the slow test's): the cells go under linear+structure_aware with the option, the
    augmentation and the same test rows as the plain cell's; the plain cell holds no augment key."""
    from extract.store import ActivationStore
    from probes.augment import Augmentation
    from probes.artifacts import load_probe
    from probes.features import layer_features
    from probes.pipeline import train_probes
    from tests.helpers import make_synthetic_store

    clean = ActivationStore(make_synthetic_store(tmp_path / "activations", n_real=300, n_neither=100))

    class Inputs:
        path = tmp_path / "inputs.h5"

        def __init__(self, rows):
            self.rows = rows

        def last_token(self, layer, kinds):
            x = clean.last_token(layer, kinds)[self.rows]
            x[:, 5] += 3.0
            return x

    monkeypatch.setattr(Augmentation, "store", lambda self, *_: Inputs(self.frame["target_row"].to_numpy()))
    common = ["model.name=synthetic", "probe=linear", "layer=1", "n_boot=20", "trainer.accelerator=cpu",
              f"store_dir={tmp_path / 'activations'}", f"results_dir={tmp_path / 'results'}"]
    plain = json.loads(train_probes(compose_config("train_probe", *common))[0].read_text())
    path = train_probes(compose_config("train_probe", *common, "augment=structure_aware", "augment.per_statement=2"))[0]
    cell = json.loads(path.read_text())
    assert "augment" not in plain and "augment" not in plain["config"] and "augment" not in plain["method"]
    assert path.parts[-5] == "linear+structure_aware" and cell["method"]["augment"] == "structure_aware"
    assert cell["config"]["augment"]["kind"] == "structure_aware" and cell["config"]["augment"]["per_statement"] == 2
    record = cell["augment"]
    assert record["n_training_inputs"] == record["inputs"] > 0 and record["per_statement"] == 2
    assert record["inputs"] <= 2 * record["statements"] and sum(record["by_interference"].values()) == record["inputs"]
    assert cell["test"]["rows"] == plain["test"]["rows"] and cell["split"] == plain["split"]
    assert cell["calibration"]["n_rows"] > plain["calibration"]["n_rows"]    # out-of-fold scores of the copies too
    assert cell["test"]["scores"] != plain["test"]["scores"]
    probs = load_probe(path).predict_proba(layer_features(clean, 1, "last"))
    assert probs.shape == (len(clean.table), 2)


# ----------------------------------------------------------------------------------------- the comparison

def _folder(root: Path, name: str, targets: list[dict], inputs: pd.DataFrame, cell: Path) -> None:
    out = root / "m" / "d" / "ncb" / name
    out.mkdir(parents=True)
    (out / "targets.json").write_text(json.dumps(targets))
    inputs.to_csv(out / "inputs.csv", index=False)
    stress = {"peer": {"0": "control", "5": "5 said {false}."}, "source": {"forum": "A forum says {false}."}}
    (out / "stress.json").write_text(json.dumps({"method": name, "info": {"kind": "probe", "cell": str(cell),
                                                                          "task": "true_vs_all"},
                                                 "options": {"stress": {"interferences": stress}}, "results": []}))


@pytest.fixture(scope="module")
def ncb_outputs(tmp_path_factory):
    """NCB outputs of a plain, a structure-aware and a neutral probe: 60 test targets of 20 entities (and 10
    train ones), each under three contexts, with random validity, correctness and p_y; and their cells."""
    root = tmp_path_factory.mktemp("robust")
    rng = np.random.default_rng(7)
    rows = np.arange(100, 170)
    y = rng.integers(0, 2, 60)
    for name, skill in (("linear", 0.6), ("linear+structure_aware", 0.8), ("linear+neutral", 0.7)):
        targets = [{"row": int(r), "part": "test" if i < 60 else "train", "p_y": float(rng.random()),
                    "valid": bool(rng.random() < 0.8)} for i, r in enumerate(rows)]
        inputs = pd.DataFrame([{"target_row": int(r), "entity": f"e{i % 20}", "interference": i_, "level": level,
                                "p_y": float(rng.random()), "correct": bool(rng.random() < skill)}
                               for i, r in enumerate(rows) for i_, level in (("peer", "0"), ("peer", "5"),
                                                                             ("source", "forum"))])
        scores = y + rng.normal(0, 1.5 - skill, 60)
        probs = 1 / (1 + np.exp(-(scores - 0.5) * 3))
        cell = root / f"{name}.json"
        cell.write_text(json.dumps({"config": {}, "metrics": {}, "test": {
            "rows": list(range(60)), "y": y.tolist(), "groups": [i % 20 for i in range(60)],
            "scores": scores[:, None].tolist(), "probs": np.c_[1 - probs, probs].tolist()}}))
        _folder(root, f"{name}_true_vs_all_entity_disjoint_layer2_seed0", targets, inputs, cell)
    return root


def _holm(p: np.ndarray) -> np.ndarray:
    order = np.argsort(p)
    adjusted = np.maximum.accumulate((len(p) - np.arange(len(p))) * p[order])
    out = np.empty_like(p)
    out[order] = np.minimum(adjusted, 1.0)
    return out


def _bootstrap(stat, groups, n_boot=1000, seed=0):
    draws = np.array([stat(i) for i in cluster_bootstrap_indices(groups, n_boot, np.random.default_rng(seed),
                                                                 n=len(groups))])
    draws = draws[~np.isnan(draws)]
    return np.percentile(draws, [2.5, 97.5]), min(1.0, 2 * (1 + min(sum(draws <= 0), sum(draws >= 0))) / (len(draws) + 1))


def test_comparison_equals_a_direct_recomputation(ncb_outputs):
    from experiments.ncb_robust import POOLED, clean_table, robust_table

    table = robust_table(ncb_outputs, "m", "d", n_boot=200)
    assert set(table["comparison"]) == {"structure_aware - plain", "neutral - plain", "structure_aware - neutral"}
    assert len(table) == 3 * 4                            # three contexts and the pooled row, for each pair
    folder = ncb_outputs / "m" / "d" / "ncb"
    for _, r in table.iterrows():
        frames = []
        for name in (r["a"], r["b"]):
            targets = json.loads((folder / name / "targets.json").read_text())
            valid = {t["row"]: t["p_y"] for t in targets if t["valid"] and t["part"] == "test"}
            inputs = pd.read_csv(folder / name / "inputs.csv", dtype={"level": str})
            frames.append(inputs[inputs["target_row"].isin(valid)].assign(
                shift=lambda d: d["p_y"] - d["target_row"].map(valid)))
        both = frames[0].merge(frames[1], on=["target_row", "entity", "interference", "level"])
        if r["interference"] == POOLED:
            both = both[both["level"] != "0"]
        else:
            both = both[(both["interference"] == r["interference"]) & (both["level"] == r["level"])]
        a, b = 1.0 - both["correct_x"].to_numpy(float), 1.0 - both["correct_y"].to_numpy(float)
        assert (r["n"], r["n_entities"]) == (len(both), both["entity"].nunique())
        assert r["drop_a"] == pytest.approx(a.mean()) and r["drop_b"] == pytest.approx(b.mean())
        assert r["difference"] == pytest.approx(a.mean() - b.mean())
        assert r["relative"] == pytest.approx(a.mean() / b.mean() - 1)
        assert r["shift_a"] == pytest.approx(both["shift_x"].mean())
        ci, p = _bootstrap(lambda i: a[i].mean() - b[i].mean(), both["entity"].to_numpy(), n_boot=200)
        assert [r["difference_lo"], r["difference_hi"]] == pytest.approx(ci.tolist()) and r["difference_p_raw"] == p
    np.testing.assert_allclose(table["difference_p_holm"], _holm(table["difference_p_raw"].to_numpy()))

    clean = clean_table(ncb_outputs, "m", "d", n_boot=200)
    assert len(clean) == 6 and set(clean["estimand"]) == {"mcc_all", "auroc"}
    for _, r in clean.iterrows():
        tests = [json.loads((ncb_outputs / f"{n.split('_true_vs_all')[0]}.json").read_text())["test"]
                 for n in (r["a"], r["b"])]
        y = np.array(tests[0]["y"])
        direct = [matthews_corrcoef(y, np.argmax(t["probs"], 1)) if r["estimand"] == "mcc_all"
                  else roc_auc_score(y, np.array(t["scores"])[:, 0]) for t in tests]
        assert [r["value_a"], r["value_b"]] == pytest.approx(direct)
        assert r["difference"] == pytest.approx(direct[0] - direct[1])
    for _, family in clean.groupby("estimand"):
        np.testing.assert_allclose(family["difference_p_holm"], _holm(family["difference_p_raw"].to_numpy()))


# ----------------------------------------------------------------------------------------- end to end

@pytest.mark.slow
def test_augmented_probes_train_on_the_tiny_model_and_ncb_compares_them(tmp_path):
    """A tiny-model store of every statement about 30 real and 6 synthetic cities: the plain, structure-aware
    and neutral linear probes (cells under their own method names, carrying the option; the plain cell
    without it), NCB of each, and the report's comparison tables."""
    from experiments.ncb_report import write_ncb
    from experiments.ncb_robust import POOLED
    from extract.run import extract
    from ncb.run import run
    from probes.pipeline import train_probes

    whole_cities_csv(tmp_path / "c.csv", 30, 6)
    dirs = [f"store_dir={tmp_path / 'activations'}", f"results_dir={tmp_path / 'results'}"]
    extract(compose_config("extract", "model=tiny", "data=csv", f"data.path={tmp_path / 'c.csv'}",
                           "data.name=city_locations", dirs[0]))
    common = ["model=tiny", "data=city_locations", "probe=linear", "layer=2", "trainer.accelerator=cpu", "n_boot=50",
              *dirs]
    cells = {kind: train_probes(compose_config("train_probe", *common, *([f"augment={kind}"] if kind else [])))[0]
             for kind in (None, "structure_aware", "neutral")}
    plain = json.loads(cells[None].read_text())
    assert "augment" not in plain["config"] and "augment" not in plain and "augment" not in plain["method"]
    for kind in ("structure_aware", "neutral"):
        cell = json.loads(cells[kind].read_text())
        assert cells[kind].parts[-5] == f"linear+{kind}" and cell["config"]["probe"]["name"] == f"linear+{kind}"
        assert cell["config"]["augment"]["kind"] == kind and cell["method"]["augment"] == kind
        record = cell["augment"]
        assert record["kind"] == kind and record["n_training_inputs"] == record["inputs"] > 0
        assert Path(record["store"]).name == f"city_locations.augment-{kind}.entity_disjoint-seed0.L2.h5"
        assert cell["test"]["rows"] == plain["test"]["rows"] and cell["split"] == plain["split"]
        assert cell["test"]["scores"] != plain["test"]["scores"]
    for cell in cells.values():
        run(compose_config("ncb", "model=tiny", "data=city_locations", f"method='{cell}'", *dirs, "n_boot=50"))
    paths = write_ncb(tmp_path / "results", tmp_path / "report", "tiny", "city_locations")
    assert [p.name for p in paths][-4:] == ["ncb_robust.csv", "ncb_robust.md", "ncb_robust_clean.csv",
                                            "ncb_robust_clean.md"]
    table = pd.read_csv(paths[-4], dtype={"level": str})
    assert set(table["comparison"]) == {"structure_aware - plain", "neutral - plain", "structure_aware - neutral"}
    pooled = table[(table["comparison"] == "structure_aware - plain") & (table["interference"] == POOLED)]
    assert len(pooled) == 1 and pooled["n"].iloc[0] > 0
