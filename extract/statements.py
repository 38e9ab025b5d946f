"""Statements: datapacks of the Trilemma data, TruthfulQA, Hugging Face datasets, or user CSVs, validated.

Every loader returns the same table (a pandas DataFrame, one row per statement, in file order):

    statement    str   the text fed to the model
    label        int   0 = false, 1 = true, 2 = neither (the only place this coding is defined)
    object_1     str   first entity (city / drug / word), "" when the source has none
    object_2     str   second entity (country / condition / definition), "" when none
    negation     bool  the statement is negated
    source_file  str   file (or dataset split) the row came from
    source_row   int   0-based data row inside that file
    context      str   text put before the statement in the same model input ("" for none), e.g. a
                       question or a misleading claim; its tokens are stored as kind "context", so
                       the statement's own tokens are what probes read (a CSV may give a `context`
                       column; it is used as written, so end it with a space or newline)

Labels are derived from two columns only (see data/trilemma/README.md): neither when
`real_object` is false, otherwise true / false from `correct`. A user CSV may instead give an
integer label column (0/1/2). Every problem raises `StatementsError` naming file, row and column.

`limit_statements(table, n)` is the `limit=N` option's subset: every label in the table's
proportions, whole subject groups, a fixed seed, table order kept; truthfulqa: the first whole
questions (see its docstring).

The `truthfulqa` datapack (a TruthfulQA CSV, parsed by extract.truthfulqa_pack; `path` gives another
file of that format) has one statement per MC2 choice of each question: the answer, with context
"Q: <question>\nA: " (the likelihood format without the primer). Per question, in this order: the
best answer (true), the other correct answers (true; the best answer's first occurrence among them
is not repeated), the incorrect answers (false), CSV order otherwise, duplicated answers kept as the
lm-evaluation-harness keeps them. object_1 = the question (the group: splits and bootstrap work by
question), object_2 = "", source_row = the question's 0-based CSV data row. So the first statement of
each question is its best answer, and the MC1 choices are that statement and the false ones.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from toolkit.errors import ToolkitError
from extract.truthfulqa_pack import DEFAULT_CSV, load_questions

LABELS = {0: "false", 1: "true", 2: "neither"}
FALSE, TRUE, NEITHER = 0, 1, 2

DATA_DIR = Path(__file__).resolve().parent.parent / "data" / "trilemma"
DATAPACKS = {
    "city_locations": ["city_locations", "city_locations_synthetic"],
    "med_indications": ["med_indications", "med_indications_synthetic"],
    "word_definitions": [
        "word_instances", "word_types", "word_synonyms",
        "word_types_synthetic", "word_instances_synthetic", "word_synonyms_synthetic",
    ],
}
TRILEMMA = tuple(DATAPACKS)   # the three Trilemma datapacks (`all` = them together)
DATAPACKS["all"] = [f for files in DATAPACKS.values() for f in files]
TRUTHFULQA = "truthfulqa"
HF_DATASET = "carlomarxx/trilemma-of-truth"
COLUMNS = ["statement", "label", "object_1", "object_2", "negation", "source_file", "source_row", "context"]
LIMIT_SEED = 0  # the fixed seed of limit_statements' group order: the same limit gives the same rows
_BOOLEANS = {"true": True, "false": False, "1": True, "0": False}


class StatementsError(ToolkitError):
    """Bad statement input; the message is one line naming file, row and column."""


def datapack_table(data) -> pd.DataFrame:
    """load_statements of a `data:` config (conf/data/*.yaml as a DictConfig or dict): the datapack's table, the
    rows an extraction of it stores, in the same order."""
    return load_statements(data.get("name"), source=data.get("source", "csv"), path=data.get("path"),
                           statement_column=data.get("statement_column", "statement"),
                           label_column=data.get("label_column"))


def load_statements(datapack: str = "city_locations", source: str = "csv", path: str | None = None,
                    statement_column: str = "statement", label_column: str | None = None,
                    data_dir: str | Path = DATA_DIR) -> pd.DataFrame:
    """Load and validate one datapack (or a user CSV when `path` is given) -> the table above.
    Datapack truthfulqa: `path` is a TruthfulQA CSV (default the vendored one)."""
    if datapack == TRUTHFULQA:
        if source != "csv":
            raise StatementsError(f"datapack {TRUTHFULQA} reads a TruthfulQA CSV: use data.source=csv")
        return _truthfulqa_table(path)
    if path is not None:
        return _read_csv(Path(path), statement_column, label_column)
    if datapack not in DATAPACKS:
        raise StatementsError(f"unknown datapack {datapack!r}: choose one of {sorted([*DATAPACKS, TRUTHFULQA])} "
                              "or give a CSV with data.path=...")
    if source == "hf":
        return _read_hf(datapack)
    if source != "csv":
        raise StatementsError(f"unknown data source {source!r}: use 'csv' (vendored files) or 'hf'")
    tables = [_read_csv(Path(data_dir) / f"{name}.csv", statement_column, label_column)
              for name in DATAPACKS[datapack]]
    return pd.concat(tables, ignore_index=True)


def limit_statements(table: pd.DataFrame, n: int, whole_groups: bool = False) -> pd.DataFrame:
    """The `limit=N` subset of `table`: n rows (at most n with whole_groups), in table order, with
    a fresh index; the whole table when n >= len(table). Deterministic: the same table and n give
    the same rows (LIMIT_SEED, no global random state).

    Label-stratified: label c gets n * share_c rows, rounded by largest remainders (so the counts
    sum to n and each is within 1 of its exact share). Entity-respecting: rows are grouped by
    subject (`object_1`: a city, drug or word; a row without one is its own group); the groups, in
    a seeded random order, are taken whole while no label exceeds its count, then the labels still
    short are topped up with rows of the next groups in that order (only those few are split).

    whole_groups=True (the truthfulqa datapack, object_1 = the question): the first questions, whole,
    that fit together in n rows, as `python -m truthfulqa limit=K` scores the first K questions; a
    question is never cut (its MC1 / MC2 need all its answers)."""
    if n >= len(table):
        return table.reset_index(drop=True)
    groups = _subject_groups(table)
    if whole_groups:
        fits = np.cumsum([len(rows) for rows in groups]) <= n
        if not fits[0]:
            raise StatementsError(f"limit={n} is smaller than the first question ({len(groups[0])} statements), "
                                  "which is never cut: raise the limit")
        return table.iloc[np.sort(np.concatenate(groups[:fits.sum()]))].reset_index(drop=True)
    values, label = np.unique(table["label"].to_numpy(), return_inverse=True)
    exact = n * np.bincount(label) / len(table)
    target = np.floor(exact).astype(np.int64)
    target[np.argsort(target - exact, kind="stable")[:n - target.sum()]] += 1   # largest remainders
    groups = [groups[g] for g in np.random.default_rng(LIMIT_SEED).permutation(len(groups))]
    taken = np.zeros(len(table), dtype=bool)
    have = np.zeros(len(values), dtype=np.int64)
    for rows in groups:                               # whole groups within every label's count
        need = np.bincount(label[rows], minlength=len(values))
        if np.all(have + need <= target):
            taken[rows] = True
            have += need
    for rows in groups:                               # top up the labels still short
        if have.sum() == n:
            break
        for r in rows[~taken[rows]]:
            if have[label[r]] < target[label[r]]:
                taken[r] = True
                have[label[r]] += 1
    return table.iloc[np.flatnonzero(taken)].reset_index(drop=True)


def _subject_groups(table: pd.DataFrame) -> list[np.ndarray]:
    """Row positions (ascending) of each subject (`object_1`), subjects in order of first
    appearance; each row without a subject ("") is a group of its own."""
    subject = table["object_1"].to_numpy(dtype=object)
    group = pd.factorize(np.where(subject == "", None, subject))[0]   # "" -> -1
    alone = group < 0
    group[alone] = group.max(initial=-1) + 1 + np.arange(alone.sum())
    return np.split(np.argsort(group, kind="stable"), np.cumsum(np.bincount(group))[:-1])


def _read_csv(path: Path, statement_column: str, label_column: str | None) -> pd.DataFrame:
    if not path.is_file():
        raise StatementsError(f"{path}: file not found (give an existing CSV with data.path=...)")
    try:  # everything as text: 'nan' stays the word nan, booleans are parsed by us
        raw = pd.read_csv(path, dtype=str, keep_default_na=False)
    except (pd.errors.ParserError, UnicodeDecodeError, pd.errors.EmptyDataError) as err:
        raise StatementsError(f"{path}: not a readable CSV ({str(err).splitlines()[0]})") from None
    return _to_table(raw, path.name, statement_column, label_column)


def _read_hf(datapack: str) -> pd.DataFrame:
    import datasets  # imported here: only this path needs it (and the hub)

    names = list(TRILEMMA) if datapack == "all" else [datapack]
    tables = []
    for name in names:
        try:
            ds = datasets.load_dataset(HF_DATASET, name)
        except Exception as err:  # hub unreachable, unknown config, ...
            raise StatementsError(f"{HF_DATASET} ({name}): cannot load from the Hugging Face hub "
                                  f"({type(err).__name__}); use data.source=csv for the vendored files") from None
        for split, part in ds.items():
            raw = part.to_pandas().astype(str)
            tables.append(_to_table(raw, f"{HF_DATASET}/{name}/{split}", "statement", None))
    return pd.concat(tables, ignore_index=True)


def _truthfulqa_table(path: str | None) -> pd.DataFrame:
    """The truthfulqa datapack's table (module docstring), one row per (question, answer)."""
    path = Path(path) if path else DEFAULT_CSV
    rows = []
    for q in load_questions(path):
        if q.best not in q.correct:
            raise StatementsError(f"{path} row {q.row} (0-based data row): the best answer is not among the "
                                  "correct answers: add it to them")
        others = list(q.correct)
        others.remove(q.best)
        rows += [(answer, label, q.question, q.row)
                 for answers, label in (([q.best], TRUE), (others, TRUE), (q.incorrect, FALSE)) for answer in answers]
    statement, label, question, row = zip(*rows)
    return pd.DataFrame({
        "statement": statement, "label": np.asarray(label, dtype=np.int64), "object_1": question, "object_2": "",
        "negation": False, "source_file": path.name,
        "source_row": np.asarray(row, dtype=np.int64), "context": [f"Q: {q}\nA: " for q in question],
    }, columns=COLUMNS)


def _to_table(raw: pd.DataFrame, name: str, statement_column: str,
              label_column: str | None) -> pd.DataFrame:
    """Validate one raw all-text table and convert it to the statement table."""
    _require(raw, name, statement_column)
    if len(raw) == 0:
        raise StatementsError(f"{name}: no statements (only a header): add rows below the header")
    text = raw[statement_column].str.strip()
    empty = np.flatnonzero(text == "")
    if len(empty):
        raise StatementsError(f"{name}, row {empty[0]}, column {statement_column!r}: empty statement "
                              "(remove the row or fill in the text)")
    if label_column is not None:
        _require(raw, name, label_column)
        label = _parse_labels(raw[label_column], name, label_column)
    else:
        _require(raw, name, "correct")
        _require(raw, name, "real_object")
        correct = _parse_bools(raw["correct"], name, "correct")
        real = _parse_bools(raw["real_object"], name, "real_object")
        label = np.where(~real, NEITHER, np.where(correct, TRUE, FALSE))
    negation = (_parse_bools(raw["negation"], name, "negation") if "negation" in raw
                else np.zeros(len(raw), dtype=bool))
    return pd.DataFrame({
        "statement": text.to_numpy(),
        "label": label.astype(np.int64),
        "object_1": raw["object_1"].to_numpy() if "object_1" in raw else "",
        "object_2": raw["object_2"].to_numpy() if "object_2" in raw else "",
        "negation": negation,
        "source_file": name,
        "source_row": np.arange(len(raw), dtype=np.int64),
        "context": raw["context"].to_numpy() if "context" in raw else "",
    }, columns=COLUMNS)


def _require(raw: pd.DataFrame, name: str, column: str) -> None:
    if column not in raw.columns:
        raise StatementsError(f"{name}: missing column {column!r} (columns are {list(raw.columns)}); "
                              "rename it or point data.statement_column / data.label_column at the right one")


def _parse_bools(values: pd.Series, name: str, column: str) -> np.ndarray:
    lowered = values.str.strip().str.lower()
    bad = np.flatnonzero(~lowered.isin(list(_BOOLEANS)))
    if len(bad):
        raise StatementsError(f"{name}, row {bad[0]}, column {column!r}: cannot parse "
                              f"{values.iloc[bad[0]]!r} as a boolean (use true/false)")
    return lowered.map(_BOOLEANS).to_numpy(dtype=bool)


def _parse_labels(values: pd.Series, name: str, column: str) -> np.ndarray:
    stripped = values.str.strip()
    bad = np.flatnonzero(~stripped.isin(["0", "1", "2"]))
    if len(bad):
        raise StatementsError(f"{name}, row {bad[0]}, column {column!r}: label {values.iloc[bad[0]]!r} "
                              "is not 0 (false), 1 (true) or 2 (neither)")
    return stripped.astype(np.int64).to_numpy()
