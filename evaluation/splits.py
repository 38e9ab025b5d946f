"""Train / calibration / test splits of a statement table (extract.statements.load_statements).

One entry point::

    split = make_split(table, kind="entity_disjoint", seed=0, test_size=0.25, calibration_size=0.2)
    X_train, X_cal, X_test = X[split.train], X[split.calibration], X[split.test]
    cell["split"] = split.summary()          # sizes, fractions, drops, overlap, fingerprint (JSON)

`Split` holds int64 row positions (0..len(table)-1) into the table; rows in `dropped` are in no
split. Three kinds:

``entity_disjoint`` (default, ours)
    Entities are the strings in `object_1` and `object_2`, one shared namespace, compared
    exactly ("" = no entity). No entity of a calibration or test statement occurs in any
    training statement, and (``disjoint_calibration_test=True``, the default) none of a test
    statement occurs in any calibration statement: the held-out entities are cut again, so
    all three sets are pairwise entity-disjoint. The calibration split picks the best layer
    (experiments/tables.py), so a calibration set sharing subjects with test would leak test
    entities into model selection (the row partition below shared a subject with 69 / 82 /
    88 % of the city / med / word test rows). Split conformal's coverage then rests on
    calibration and test being alike as sets of unseen entities (both drawn by the same seeded
    cut), not on an exact row-level exchangeability. The second cut drops held-out rows, which
    would leave train above its share of the kept rows, so the first cut is redone once aiming
    higher (``_three_way``).
    ``disjoint_calibration_test=False`` makes calibration and test a uniform random row
    partition of the held-out pool instead (fewer drops; calibration and test exactly
    exchangeable, but sharing entities).

    Algorithm. Statements and entities form a bipartite graph; its connected components can
    move between splits without breaking disjointness. Components with fewer than
    max(20, tolerance * n) statements are kept whole and packed, in a seeded random order,
    onto the side below its target share (counted per label: a component counts for its most
    common label, so every label keeps its share on both sides). Larger components (on the
    Trilemma datapacks: one per real / synthetic file family, 1000-5900 statements, which hold
    nearly all rows) are cut: entities are
    given a side (held-out or train) so that the held-out share of the component's kept
    statements is within `tolerance` of target, and statements whose two entities land on
    different sides are dropped. The cut minimises drops heuristically: a held-out region is
    grown from a random entity (always adding the frontier entity that cuts fewest
    statements), then refined by Fiduccia-Mattheyses passes (move entities one at a time
    across, best-gain first, each at most once per pass, keep the best prefix); the best of
    `n_starts` starts is kept. Cutting every large component in the same proportion keeps the
    label mix (real true/false vs synthetic neither) of the splits close to the table's.
    Fractions are of kept rows; ``summary()`` reports the dropped count.

``question_disjoint`` (the truthfulqa datapack's default)
    Every statement of a question (the `object_1` string; its answers) lies in one part, so no
    question is in two of train / calibration / test. It is the entity-disjoint algorithm on
    `object_1` alone, with calibration and test also cut apart: each question is one component,
    packed whole (nothing is dropped). `test_size` / `calibration_size` are fractions of the rows.
    A question of at least max(20, tolerance * n) statements counts as a large component, whose
    cut puts its one entity on the held-out side: such a question always lands in test (none does
    on the full truthfulqa datapack, whose largest question has 24 answers for a threshold of 61).

``reference``
    Row-for-row the split of the reference code (carlomarxdk/trilemma-of-truth,
    data_handler.py, DataHandler.assemble with exclusive_split=True, with_calibration=True;
    its configs use seed 42, test_size 0.25, cal_size 0.25). Note that there
    `calibration_size` is a fraction of the non-test rows, not of the table. Its algorithm:
    sample (1 - test_size) of the distinct (object_1, object_2) pairs with
    ``DataFrame.sample(frac, random_state=seed)``; rows with any entity among the sampled
    pairs' entities are train, the rest test; while the test share is not above test_size,
    shrink the entity pool to int(0.975 * len) with ``default_rng(seed).choice`` (one
    generator per call) and recompute. Calibration is carved the same way out of the train
    rows (same seed). Finally ``RandomState(seed + 1)`` shuffles train, then test, then
    calibration; the arrays keep that order (`order == "reference"`), so iterating them
    reproduces the reference's order. It is NOT entity-disjoint: a train row needs only one
    of its entities in the pool, so most test rows share an entity with train rows
    (``summary()["test_rows_sharing_train_entity"]``: 0.64-0.91 on the three datapacks), and
    its held-out sets are rich in synthetic (neither) rows: city_locations has 17 % neither in
    train but 34 % in calibration and 31 % in test.

Arrays of ``entity_disjoint`` and ``question_disjoint`` are sorted ascending (`order == "sorted"`).
Every kind is deterministic for a seed. Bad input raises `SplitError` (a ToolkitError) with a one-line message.
"""
from __future__ import annotations

import logging

import hashlib
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from evaluation.entity_cut import bisect, components
from toolkit.errors import ToolkitError

__all__ = ["Split", "SplitError", "make_split", "KINDS"]

log = logging.getLogger(__name__)

KINDS = ("entity_disjoint", "question_disjoint", "reference")
ENTITY_COLUMNS = ("object_1", "object_2")
QUESTION_COLUMNS = ("object_1",)
MIN_ROWS = 10


class SplitError(ToolkitError):
    """A table or parameters that cannot be split; the message is one line naming the fix."""


@dataclass(frozen=True)
class Split:
    """Row positions (int64) of each part; `dropped` rows are in none of them."""

    kind: str
    seed: int
    n_rows: int
    train: np.ndarray
    calibration: np.ndarray
    test: np.ndarray
    dropped: np.ndarray
    params: dict = field(default_factory=dict)
    order: str = "sorted"          # "sorted" ascending, or "reference" (the reference's shuffle)
    stats: dict = field(default_factory=dict)  # label counts and entity overlap, see summary()

    def sizes(self) -> dict:
        return {"train": len(self.train), "calibration": len(self.calibration),
                "test": len(self.test), "dropped": len(self.dropped)}

    def fingerprint(self) -> str:
        """sha256 (first 16 hex digits) of the three index arrays in their stored order."""
        h = hashlib.sha256()
        for part in (self.train, self.calibration, self.test):
            h.update(np.asarray(part, dtype="<i8").tobytes())
            h.update(b"|")
        return h.hexdigest()[:16]

    def summary(self) -> dict:
        """JSON-serialisable description without the indices (stored in each result cell)."""
        sizes = self.sizes()
        kept = sizes["train"] + sizes["calibration"] + sizes["test"]
        return {
            "kind": self.kind,
            "seed": int(self.seed),
            "params": dict(self.params),
            "n_rows": int(self.n_rows),
            "sizes": {k: int(v) for k, v in sizes.items()},
            "fractions_of_kept": {k: round(sizes[k] / kept, 4) for k in ("train", "calibration", "test")},
            "dropped_fraction": round(sizes["dropped"] / self.n_rows, 4),
            "order": self.order,
            "fingerprint": self.fingerprint(),
            **self.stats,
        }

    def to_dict(self) -> dict:
        """summary() plus the index lists; `Split.from_dict` restores the split."""
        return {**self.summary(), "train": self.train.tolist(), "calibration": self.calibration.tolist(),
                "test": self.test.tolist(), "dropped": self.dropped.tolist()}

    @classmethod
    def from_dict(cls, d: dict) -> "Split":
        arrays = {k: np.asarray(d[k], dtype=np.int64) for k in ("train", "calibration", "test", "dropped")}
        stats = {k: d[k] for k in ("label_counts", "test_rows_sharing_train_entity",
                                   "calibration_rows_sharing_train_entity",
                                   "test_rows_sharing_calibration_entity", "rows_without_entity") if k in d}
        return cls(kind=d["kind"], seed=d["seed"], n_rows=d["n_rows"], params=dict(d["params"]),
                   order=d["order"], stats=stats, **arrays)


def make_split(table: pd.DataFrame, kind: str = "entity_disjoint", seed: int = 0,
               test_size: float = 0.25, calibration_size: float = 0.2, *,
               entity_columns: tuple[str, ...] | list[str] = ENTITY_COLUMNS,
               disjoint_calibration_test: bool = True, tolerance: float = 0.01,
               n_starts: int = 4) -> Split:
    """Split `table` (one row per statement) into train / calibration / test row positions.

    kind: "entity_disjoint", "question_disjoint" or "reference" (see the module docstring).
    test_size, calibration_size: fractions of the kept rows (entity_disjoint: 0.25 and 0.2 give
        55 / 20 / 25 %); for "reference", calibration_size is a fraction of the non-test rows as
        in the reference code. calibration_size = 0 gives an empty calibration set.
    entity_columns: the columns whose strings are entities (entity_disjoint only; the reference
        always uses object_1 and object_2).
    disjoint_calibration_test: entity_disjoint only, also keep calibration and test entity-disjoint
        (default; False: a random row partition of the held-out rows, see the module docstring).
    tolerance: entity_disjoint only, allowed deviation of each cut component's held-out share.
    n_starts: entity_disjoint only, starts of the cut heuristic (best kept).
    """
    if kind not in KINDS:
        raise SplitError(f"unknown split kind {kind!r}: use one of {list(KINDS)} (split.kind=...)")
    if not isinstance(table, pd.DataFrame):
        raise SplitError(f"make_split needs a pandas DataFrame, got {type(table).__name__} "
                         "(load one with extract.statements.load_statements)")
    n = len(table)
    if n < MIN_ROWS:
        raise SplitError(f"table has {n} rows, a split needs at least {MIN_ROWS} "
                         "(use more statements, e.g. drop the `limit` option)")
    if not 0 < test_size < 1:
        raise SplitError(f"test_size={test_size} must be in (0, 1) (e.g. split.test_size=0.25)")
    if not 0 <= calibration_size < 1:
        raise SplitError(f"calibration_size={calibration_size} must be in [0, 1) "
                         "(e.g. split.calibration_size=0.2)")
    if kind != "reference" and test_size + calibration_size >= 1:
        raise SplitError(f"test_size + calibration_size = {test_size + calibration_size} leaves no training "
                         "rows (make their sum < 1, e.g. 0.25 + 0.2)")
    if not 0 < tolerance < 0.5:
        raise SplitError(f"tolerance={tolerance} must be in (0, 0.5) (e.g. split.tolerance=0.01)")
    columns = list({"reference": ENTITY_COLUMNS, "question_disjoint": QUESTION_COLUMNS}.get(kind, entity_columns))
    if not 1 <= len(columns) <= 2:
        raise SplitError(f"entity_columns={columns}: give one or two columns (e.g. [object_1, object_2])")
    missing = [c for c in columns if c not in table.columns]
    if missing:
        raise SplitError(f"table lacks entity column(s) {missing} (load it with "
                         "extract.statements.load_statements, or set split.entity_columns)")
    seed = int(seed)
    if kind == "reference":
        train, calibration, test = _reference_split(table, seed, test_size, calibration_size)
        dropped = np.zeros(0, dtype=np.int64)
        params = {"test_size": test_size, "calibration_size": calibration_size,
                  "calibration_of": "non-test rows"}
        order = "reference"
    elif kind == "question_disjoint":
        train, calibration, test, dropped = _entity_disjoint_split(
            table, columns, seed, test_size, calibration_size, True, tolerance, n_starts)
        params = {"test_size": test_size, "calibration_size": calibration_size,
                  "calibration_of": "rows", "question_column": columns[0]}
        order = "sorted"
    else:
        train, calibration, test, dropped = _entity_disjoint_split(
            table, columns, seed, test_size, calibration_size, disjoint_calibration_test,
            tolerance, n_starts)
        params = {"test_size": test_size, "calibration_size": calibration_size,
                  "calibration_of": "kept rows", "entity_columns": columns,
                  "disjoint_calibration_test": bool(disjoint_calibration_test),
                  "tolerance": tolerance, "n_starts": int(n_starts)}
        order = "sorted"
    for name, part in (("train", train), ("test", test)) + ((("calibration", calibration),)
                                                           if calibration_size > 0 else ()):
        if len(part) == 0:
            raise SplitError(f"the {kind} split of {n} rows left the {name} set empty "
                             "(use more statements, or split.kind=reference if all rows share entities)")
    stats = _stats(table, columns, train, calibration, test)
    without = int((_entity_codes(table, columns) < 0).all(axis=1).sum())
    if without:     # (recorded only where there are some: the datapacks' cells stay as they were)
        stats["rows_without_entity"] = without
    if without and kind != "reference":
        log.warning("%d of %d statements name no entity (%s empty): each is split as its own unit, so the %s split "
                    "keeps only the others apart by entity (the cell records rows_without_entity); give %s columns to "
                    "hold statements about one entity together (docs/train_probe.md)", without, n,
                    " / ".join(columns), kind, " / ".join(columns))
    return Split(kind=kind, seed=seed, n_rows=n, train=train, calibration=calibration, test=test,
                 dropped=dropped, params=params, order=order, stats=stats)


# ---------------------------------------------------------------------------------------------
# reference split

def _reference_split(table, seed, test_size, calibration_size):
    # Entities become integer codes (factorize is exact: equal codes <=> equal strings, NaN its
    # own value as in pandas' isin / drop_duplicates). Every random call below depends only on
    # lengths, never on the values, so the codes draw the same rows as the reference's strings,
    # and membership becomes a table lookup (the reference's isin loop is slow). A fresh
    # RangeIndex makes index labels row positions, as in the reference's polars -> pandas frame.
    # The vendored files have no empty entity; polars would read an empty field as null where
    # our loader keeps "", which only renames that one shared token.
    values = np.concatenate([table[c].to_numpy(dtype=object) for c in ENTITY_COLUMNS])
    codes, _ = pd.factorize(values, use_na_sentinel=False)
    objects = pd.DataFrame({"object_1": codes[:len(table)], "object_2": codes[len(table):]})
    n_codes = int(codes.max(initial=-1)) + 1
    rest, test = _reference_holdout(objects, test_size, seed, n_codes)
    if calibration_size > 0:
        train, calibration = _reference_holdout(objects.loc[rest], calibration_size, seed, n_codes)
    else:
        train, calibration = rest, np.zeros(0, dtype=np.int64)
    shuffle = np.random.RandomState(seed + 1)  # the reference seeds the global state the same way
    for part in (train, test, calibration):      # ... and shuffles in this order
        shuffle.shuffle(part)
    return train, calibration, test


def _reference_holdout(objects: pd.DataFrame, holdout: float, seed: int, n_codes: int):
    """(kept, held-out) index labels of `objects`: held-out rows have no entity in the pool."""
    rng = np.random.default_rng(seed)
    pool = (objects.drop_duplicates()
            .sample(frac=1.0 - holdout, random_state=seed)
            .to_numpy().ravel())  # row-major: o1, o2 of the first sampled pair, then the next pair
    first = objects["object_1"].to_numpy()
    second = objects["object_2"].to_numpy()
    labels = objects.index.to_numpy(dtype=np.int64)

    def divide(pool):
        member = np.zeros(n_codes, dtype=bool)
        member[pool] = True
        inside = member[first] | member[second]
        return labels[inside], labels[~inside]

    kept, held = divide(pool)
    while not len(held) / len(objects) > holdout:   # terminates: an empty pool holds out all
        pool = rng.choice(pool, size=int(len(pool) * 0.975), replace=False)
        kept, held = divide(pool)
    return kept, held


# ---------------------------------------------------------------------------------------------
# entity-disjoint split

def _entity_codes(table: pd.DataFrame, columns: list[str]) -> np.ndarray:
    """[n, k] int codes of the entity strings (one namespace for all columns), -1 for ""."""
    values = [table[c].fillna("").astype(str).to_numpy(dtype=object) for c in columns]
    codes, uniques = pd.factorize(np.concatenate(values))
    codes = codes.reshape(len(columns), -1).T.copy()
    empty = np.flatnonzero(np.asarray(uniques, dtype=object) == "")
    if len(empty):
        codes[codes == empty[0]] = -1
    return codes


def _entity_disjoint_split(table, columns, seed, test_size, calibration_size, disjoint_cal_test,
                           tolerance, n_starts):
    codes = _entity_codes(table, columns)
    rows = np.arange(len(table), dtype=np.int64)
    strata = table["label"].to_numpy() if "label" in table.columns else np.zeros(len(table), dtype=np.int64)
    held_share = test_size + calibration_size
    test_share = test_size / held_share
    if calibration_size > 0 and disjoint_cal_test:
        parts = _three_way(codes, rows, held_share, test_share, seed, tolerance, n_starts, strata)
        return tuple(np.sort(np.asarray(p, dtype=np.int64)) for p in parts)
    rng = np.random.default_rng(seed)
    held, train, dropped = bisect(codes, rows, held_share, rng, tolerance, n_starts, strata)
    if calibration_size == 0:
        test, calibration = held, np.zeros(0, dtype=np.int64)
    else:  # uniform random row partition of the held-out pool: calibration exchangeable with test
        perm = rng.permutation(held)
        n_test = int(round(len(held) * test_share))
        test, calibration = perm[:n_test], perm[n_test:]
    return tuple(np.sort(np.asarray(p, dtype=np.int64)) for p in (train, calibration, test, dropped))


def _three_way(codes, rows, held_share, test_share, seed, tolerance, n_starts, strata):
    """(train, calibration, test, dropped), pairwise entity-disjoint: held-out rows are cut from
    train, then test from calibration. When the second cut drops a fraction d of the held-out
    rows, the first is redone once (same seed) aiming at held_share / (1 - (1 - held_share) d),
    so that the kept rows' shares stay near target (within 0.01 on the Trilemma datapacks)."""
    share = held_share
    for attempt in range(2):
        rng = np.random.default_rng(seed)
        held, train, dropped = bisect(codes, rows, share, rng, tolerance, n_starts, strata)
        test, calibration, dropped2 = bisect(codes, held, test_share, rng, tolerance, n_starts, strata)
        lost = len(dropped2) / max(len(held), 1)
        if lost == 0 or attempt == 1:
            break
        share = held_share / (1 - (1 - held_share) * lost)
    return train, calibration, test, np.concatenate([dropped, dropped2])


# ---------------------------------------------------------------------------------------------

def _stats(table, columns, train, calibration, test) -> dict:
    stats: dict = {}
    if "label" in table.columns:
        labels = table["label"].to_numpy()
        stats["label_counts"] = {
            name: {str(k): int(v) for k, v in zip(*np.unique(labels[part], return_counts=True))}
            for name, part in (("train", train), ("calibration", calibration), ("test", test))}

    def entities(part) -> set:
        found = set()
        for c in columns:
            found.update(table[c].to_numpy()[part].tolist())
        found.discard("")
        return found

    def sharing(part, others: set):
        if len(part) == 0:
            return 0.0
        hit = np.zeros(len(part), dtype=bool)
        for c in columns:
            hit |= table[c].iloc[part].isin(others).to_numpy()
        return round(float(hit.mean()), 4)

    train_entities = entities(train)
    stats["test_rows_sharing_train_entity"] = sharing(test, train_entities)
    stats["calibration_rows_sharing_train_entity"] = sharing(calibration, train_entities)
    stats["test_rows_sharing_calibration_entity"] = sharing(test, entities(calibration))
    return stats


def entity_groups(table: pd.DataFrame, columns=("object_1",)) -> np.ndarray:
    """int64 [N]: statements linked by a shared entity of `columns` share a group (for grouped
    cross-validation inside the training split).

    The default groups by subject (`object_1`: the city, drug or word) only: linking objects too
    (countries, conditions, definitions) joins nearly every real statement into one component (two
    groups in the city and med training splits), and grouped folds then hold out whole classes."""
    return components(_entity_codes(table, list(columns))).astype(np.int64)
