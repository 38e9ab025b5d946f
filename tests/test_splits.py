"""Splits: the reference split row for row, and the entity-disjoint split (evaluation/splits.py)."""
from __future__ import annotations

import hashlib
import inspect
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from omegaconf import OmegaConf

from toolkit.config import compose_config

from extract.statements import load_statements
from evaluation.splits import Split, SplitError, make_split

PACKS = ["city_locations", "med_indications", "word_definitions"]
CONF = Path(__file__).resolve().parent.parent / "conf" / "split"

# Fingerprints obtained by running the reference algorithm itself (the unmodified data_handler.py
# of carlomarxdk/trilemma-of-truth: DataHandler(with_calibration=True).assemble(exclusive_split=
# True, test_size=0.25, calibration_size=0.25, seed=42) on the vendored CSVs, with polars, under
# both numpy 1.26 / pandas 2.2 / polars 1.9 and numpy 2.4 / pandas 3.1 / polars 2.1, which agreed).
# test_sha256: sha256 of the test indices as little-endian int64 in the reference's (shuffled)
# order; calibration_sha256: of the sorted calibration indices.
REFERENCE = {
    "city_locations": dict(
        sizes=(3999, 1398, 1855), first_test=[6170, 2661, 5994, 2171, 6286, 2345, 4181, 3271, 1591, 5183],
        test_sha256="376a0552bba7887d6ba81e594969954694a8df22a2074c460d06f8a0c2b2af4e",
        calibration_sha256="a523fe95ca3ca4c1dcc2546efeac32032c73ebf5e476e0e313fff6e7a49afa97"),
    "med_indications": dict(
        sizes=(3849, 1327, 1727), first_test=[377, 5382, 3667, 2442, 6866, 1264, 2179, 5244, 2331, 4801],
        test_sha256="77e809fa9c43ea7b774af15f570169d905e67d3d2cb55d21886873bce9369432",
        calibration_sha256="39eba4c4c3659596640262a9df0aea3cd89b78f9fb0dc7994a2fc33531595bf8"),
    "word_definitions": dict(
        sizes=(4717, 1628, 2155), first_test=[2212, 965, 8026, 4790, 8239, 1111, 3386, 1583, 1033, 1095],
        test_sha256="f3e73413a46f23dbe1e03cea061aadb123d3990b67bbea3aadc31b5127563204",
        calibration_sha256="7bd995f49b4e69780a8d6cbe81d5ad9f17b2c91aa3de02384d5d262774037c1d"),
}
# entity_disjoint: every part within this absolute distance of 55 / 20 / 25 % of the kept rows
FRACTION_TOLERANCE = 0.02


def sha(values) -> str:
    return hashlib.sha256(np.asarray(values, dtype="<i8").tobytes()).hexdigest()


@pytest.fixture(scope="module")
def tables():
    return {name: load_statements(name) for name in PACKS}


@pytest.fixture(scope="module")
def disjoint_splits(tables):
    return {name: make_split(t, kind="entity_disjoint", seed=0) for name, t in tables.items()}


def entities(table, rows, columns=("object_1", "object_2")) -> set:
    found = set()
    for c in columns:
        found.update(table[c].to_numpy()[rows].tolist())
    found.discard("")
    return found


def assert_partition(split: Split, n: int):
    parts = [split.train, split.calibration, split.test, split.dropped]
    assert all(p.dtype == np.int64 for p in parts)
    joined = np.concatenate(parts)
    assert len(joined) == n and np.array_equal(np.sort(joined), np.arange(n))


# --- reference ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", PACKS)
def test_reference_split_matches_reference_code(tables, name):
    cfg = OmegaConf.to_container(OmegaConf.load(CONF / "reference.yaml"))
    split = make_split(tables[name], **cfg)
    expected = REFERENCE[name]
    assert (len(split.train), len(split.calibration), len(split.test)) == expected["sizes"]
    assert split.test[:10].tolist() == expected["first_test"]
    assert sha(split.test) == expected["test_sha256"]
    assert sha(np.sort(split.calibration)) == expected["calibration_sha256"]
    assert len(split.dropped) == 0 and split.order == "reference"
    assert_partition(split, len(tables[name]))
    # the reference split is not entity-disjoint: most test rows share an entity with training
    assert split.summary()["test_rows_sharing_train_entity"] > 0.6


# --- entity_disjoint ------------------------------------------------------------------------

@pytest.mark.parametrize("name", PACKS)
def test_entity_disjoint_has_no_shared_entity_and_target_fractions(tables, disjoint_splits, name):
    """By default all three parts are pairwise entity-disjoint (object_1 and object_2, the split's
    entity_columns): the calibration split picks the best layer, so it must not share test's
    subjects (the old row partition of the held-out pool shared them for 69-88 % of test rows)."""
    table, split = tables[name], disjoint_splits[name]
    assert_partition(split, len(table))
    columns = split.params["entity_columns"]
    assert columns == ["object_1", "object_2"] and split.params["disjoint_calibration_test"] is True
    train, cal, test = (entities(table, p, columns) for p in (split.train, split.calibration, split.test))
    assert not train & cal and not train & test and not cal & test
    kept = len(table) - len(split.dropped)
    for part, target in ((split.train, 0.55), (split.calibration, 0.20), (split.test, 0.25)):
        assert abs(len(part) / kept - target) <= FRACTION_TOLERANCE
        assert set(table["label"].to_numpy()[part]) == {0, 1, 2}   # every label in every part
        assert np.all(np.diff(part) > 0)                           # sorted, no repeats
    summary = split.summary()
    assert summary["sizes"]["dropped"] == len(split.dropped) < 0.3 * len(table)
    assert summary["test_rows_sharing_train_entity"] == 0.0
    assert summary["calibration_rows_sharing_train_entity"] == 0.0
    assert summary["test_rows_sharing_calibration_entity"] == 0.0
    restored = Split.from_dict(json.loads(json.dumps(split.to_dict())))
    assert restored.summary() == summary


def test_entity_disjoint_row_partition_option_and_object_1_only(tables):
    # disjoint_calibration_test=False: calibration / test a random row partition of the held-out
    # rows (fewer drops, shared entities), still none shared with train
    table = tables["word_definitions"]
    split = make_split(table, seed=3, disjoint_calibration_test=False)
    assert_partition(split, len(table))
    cal, test = entities(table, split.calibration), entities(table, split.test)
    assert cal & test and not entities(table, split.train) & (cal | test)
    assert len(split.dropped) < len(make_split(table, seed=3).dropped)
    assert split.summary()["test_rows_sharing_calibration_entity"] > 0.5
    # holding out object_1 only: each city is its own component, nothing is dropped
    city = tables["city_locations"]
    only = make_split(city, seed=0, entity_columns=["object_1"])
    assert len(only.dropped) == 0
    assert not entities(city, only.train, ["object_1"]) & entities(city, only.test, ["object_1"])


def test_entity_disjoint_is_deterministic_per_seed(tables, disjoint_splits):
    table = tables["med_indications"]
    again = make_split(table, seed=0)
    other = make_split(table, seed=1)
    first = disjoint_splits["med_indications"]
    for part in ("train", "calibration", "test", "dropped"):
        assert np.array_equal(getattr(again, part), getattr(first, part))
    assert again.fingerprint() == first.fingerprint() != other.fingerprint()
    assert not np.array_equal(other.test, first.test)


def test_entity_disjoint_config_file(tables):
    cfg = OmegaConf.to_container(compose_config("train_probe", "split=entity_disjoint", "split_seed=3").split, resolve=True)
    assert cfg["kind"] == "entity_disjoint" and cfg["seed"] == 3  # the split follows the run's split_seed
    assert cfg["disjoint_calibration_test"] is True                # the same default as make_split's
    assert inspect.signature(make_split).parameters["disjoint_calibration_test"].default is True
    split = make_split(tables["word_definitions"], **cfg)
    json.dumps(split.summary())
    assert split.summary()["params"]["entity_columns"] == ["object_1", "object_2"]


def test_rows_without_entities_are_split_freely():
    table = pd.DataFrame({"object_1": [""] * 60, "object_2": [""] * 60, "label": [0, 1, 2] * 20})
    split = make_split(table, seed=0)
    assert len(split.dropped) == 0
    assert (len(split.train), len(split.calibration), len(split.test)) == (33, 12, 15)


# --- bad input ------------------------------------------------------------------------------

def _one_line_error(match, *args, **kwargs):
    with pytest.raises(ValueError, match=match) as err:
        make_split(*args, **kwargs)
    assert "\n" not in str(err.value)


def test_small_or_unsplittable_input_raises(tables):
    small = tables["city_locations"].head(5)
    _one_line_error("at least 10", small)
    _one_line_error("at least 10", small, kind="reference")
    # every statement mentions France: no entity-disjoint split has both train and test rows
    shared = pd.DataFrame({"object_1": [f"city {i}" for i in range(30)], "object_2": ["France"] * 30})
    _one_line_error("set empty", shared)
    _one_line_error("unknown split kind", tables["city_locations"], kind="random")
    _one_line_error("lacks entity column", tables["city_locations"].drop(columns="object_2"))
    _one_line_error("leaves no training", tables["city_locations"], test_size=0.5, calibration_size=0.5)
    with pytest.raises(SplitError):
        make_split(tables["city_locations"], test_size=0)


@pytest.mark.parametrize("pack", PACKS)
def test_cv_groups_give_folds_with_every_class(pack):
    """The groups of grouped CV inside the training split (one per subject entity) are small, so
    every fold holds out statements of every class (linking objects too made two giant groups)."""
    from sklearn.model_selection import StratifiedGroupKFold
    from evaluation.splits import entity_groups

    table = load_statements(pack)
    train = make_split(table, kind="entity_disjoint", seed=0).train
    groups, labels = entity_groups(table)[train], table["label"].to_numpy()[train]
    assert np.bincount(groups).max() < 0.02 * len(train)
    for _, held in StratifiedGroupKFold(5, shuffle=True, random_state=0).split(train, labels, groups):
        shares = np.bincount(labels[held], minlength=3) / len(held)
        assert np.abs(shares - np.bincount(labels, minlength=3) / len(labels)).max() < 0.05
