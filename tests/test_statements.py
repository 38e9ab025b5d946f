"""Statements: label counts equal data/trilemma/README.md; bad input gives one-line errors and no store;
limit=N is a stratified, deterministic subset of whole subjects."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from evaluation.splits import make_split
from extract.run import extract
from extract.statements import DATA_DIR, StatementsError, limit_statements, load_statements
from tests.helpers import extract_config


def readme_table() -> dict[str, tuple[int, int, int, int]]:
    """datapack -> (rows, false, true, neither), parsed from the vendored README's table."""
    text = (DATA_DIR / "README.md").read_text()
    rows = re.findall(r"^\| (\w+) \| [^|]+ \| (\d+) \| (\d+) / (\d+) / (\d+) \|$", text, flags=re.M)
    return {name: tuple(int(v) for v in values) for name, *values in rows}


def test_label_counts_equal_readme_table():
    table = readme_table()
    assert set(table) == {"city_locations", "med_indications", "word_definitions"}
    total = [0, 0, 0, 0]
    for name, (n, n_false, n_true, n_neither) in table.items():
        s = load_statements(name)
        counts = s["label"].value_counts()
        assert (len(s), counts[0], counts[1], counts[2]) == (n, n_false, n_true, n_neither), name
        total = [t + v for t, v in zip(total, (n, n_false, n_true, n_neither))]
    everything = load_statements("all")
    assert [len(everything), *everything["label"].value_counts().sort_index()] == total


def test_table_columns_and_quirks():
    words = load_statements("word_definitions")
    assert "nan" in set(words["object_2"])  # the literal word, not a missing value
    city = load_statements("city_locations")
    assert city["source_file"].iloc[0] == "city_locations.csv" and city["source_row"].iloc[0] == 0
    assert city["negation"].iloc[1] and not city["negation"].iloc[0]
    assert city.iloc[-1]["source_file"] == "city_locations_synthetic.csv" and city.iloc[-1]["label"] == 2


def write_csv(path: Path, header: str, *rows: str) -> Path:
    path.write_text("\n".join([header, *rows]) + "\n")
    return path


GOOD = "The city of Paris is located in France.,Paris,France,TRUE,FALSE,TRUE"
HEADER = "statement,object_1,object_2,correct,negation,real_object"


@pytest.mark.parametrize("header,rows,pattern", [
    ("statement,object_1,object_2,negation,real_object", ["The city of Paris is located in France.,Paris,France,FALSE,TRUE"],
     r"bad\.csv: missing column 'correct'"),
    (HEADER, [GOOD, " ,Paris,France,TRUE,FALSE,TRUE"], r"bad\.csv, row 1, column 'statement': empty statement"),
    (HEADER, [GOOD, GOOD, "Paris is in France.,Paris,France,maybe,FALSE,TRUE"],
     r"bad\.csv, row 2, column 'correct': cannot parse 'maybe' as a boolean"),
    (HEADER, [], r"bad\.csv: no statements \(only a header\)"),
])
def test_bad_csv_gives_one_line_error_and_no_store(tmp_path, header, rows, pattern):
    csv = write_csv(tmp_path / "bad.csv", header, *rows)
    with pytest.raises(StatementsError, match=pattern) as err:
        extract(extract_config("model=tiny", "data=csv", f"data.path={csv}", "data.name=bad",
                               f"store_dir={tmp_path / 'store'}"))
    assert "\n" not in str(err.value)
    assert not (tmp_path / "store").exists()


def test_unknown_datapack_and_bad_label_column(tmp_path):
    with pytest.raises(StatementsError, match="unknown datapack 'cities'") as err:
        extract(extract_config("model=tiny", "data.name=cities", f"store_dir={tmp_path}"))
    assert "\n" not in str(err.value) and not any(tmp_path.iterdir())
    csv = write_csv(tmp_path / "lab.csv", "statement,label", "A is B.,1", "C is D.,3")
    with pytest.raises(StatementsError, match=r"lab\.csv, row 1, column 'label': label '3'"):
        load_statements(path=str(csv), label_column="label")


def test_user_csv_with_integer_labels(tmp_path):
    csv = write_csv(tmp_path / "mine.csv", "text,y", "A is B.,1", "C is D.,0", "E is F.,2")
    s = load_statements(path=str(csv), statement_column="text", label_column="y")
    assert s["label"].tolist() == [1, 0, 2] and s["object_1"].tolist() == ["", "", ""]


def test_unreachable_hub_gives_one_line_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(StatementsError, match="use data.source=csv") as err:
        load_statements("city_locations", source="hf")
    assert "\n" not in str(err.value)


# ------------------------------------------------------------------------ limit=N
def cut_subjects(table, part) -> list[str]:
    """Subjects (object_1) of which `part` holds some but not all of the table's statements."""
    have, full = part.groupby("object_1").size(), table.groupby("object_1").size()
    return have.index[have != full[have.index]].tolist()


@pytest.mark.parametrize("pack", ["city_locations", "med_indications", "word_definitions"])
def test_limit_is_label_stratified_deterministic_and_splittable(pack):
    """limit=60 is no longer the first 60 rows (city_locations': no neither statement): every label
    in the datapack's proportions (within 1 row), the same rows every time, in table order, whole
    subjects but for the few groups that top up a label, and still entity-disjointly splittable."""
    table = load_statements(pack)
    part = limit_statements(table, 60)
    assert len(part) == 60 and part.index.tolist() == list(range(60))
    exact = 60 * np.bincount(table["label"], minlength=3) / len(table)
    assert np.abs(np.bincount(part["label"], minlength=3) - exact).max() < 1
    again = limit_statements(load_statements(pack), 60)
    pd.testing.assert_frame_equal(part, again)
    key = list(zip(table["source_file"], table["source_row"]))
    position = {k: i for i, k in enumerate(key)}
    rows = [position[k] for k in zip(part["source_file"], part["source_row"])]
    assert rows == sorted(set(rows))                                       # table order, no repeats
    pd.testing.assert_frame_equal(part, table.iloc[rows].reset_index(drop=True))
    assert len(cut_subjects(table, part)) <= 3                             # subjects kept whole
    split = make_split(part)                                               # the default split works
    assert min(split.sizes()[k] for k in ("train", "calibration", "test")) > 0
    assert limit_statements(table, len(table)).equals(table)


def test_limit_keeps_truthfulqa_questions_whole():
    """truthfulqa: the first whole questions that fit (as `python -m truthfulqa limit=K` takes the
    first K questions); the old limit=150 cut the 16th question after 6 of its 10 answers."""
    table = load_statements("truthfulqa")
    part = limit_statements(table, 150, whole_groups=True)
    sizes = table.groupby("object_1", sort=False).size()
    assert len(part) == sizes.iloc[:15].sum() == 144 and not cut_subjects(table, part)
    pd.testing.assert_frame_equal(part, table.iloc[:144].reset_index(drop=True))
    assert set(part["label"]) == {0, 1}
    pd.testing.assert_frame_equal(part, limit_statements(table, 150, whole_groups=True))
    with pytest.raises(StatementsError, match="limit=3 is smaller than the first question") as err:
        limit_statements(table, 3, whole_groups=True)
    assert "\n" not in str(err.value)
