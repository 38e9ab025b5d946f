"""The TruthfulQA CSV (data/truthfulqa/TruthfulQA.csv): the one parser of its questions and answers.

Used by the probing datapack (extract.statements, `data=truthfulqa`) and by the likelihood
evaluation (truthfulqa/, `python -m truthfulqa`), so both read the same answers.

A cell of answers is split on ``;`` (usually ``"; "``, some cells end in ``;``), each answer is
stripped, empty ones are dropped, CSV order is kept. MC1 choices = the best answer followed by the
incorrect answers (correct index 0); MC2 choices = the correct answers followed by the incorrect
answers (labels 1 then 0). Duplicated choices inside a question are kept as they are.
"""
from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

from toolkit.errors import ToolkitError

DEFAULT_CSV = Path(__file__).resolve().parent.parent / "data" / "truthfulqa" / "TruthfulQA.csv"
COLUMNS = ("Question", "Best Answer", "Correct Answers", "Incorrect Answers")


class TruthfulQAError(ToolkitError):
    """Bad TruthfulQA input or settings; one line naming the file, row or option and the fix."""


@dataclass(frozen=True)
class Question:
    row: int                   # 0-based data row of the CSV
    question: str
    best: str
    correct: tuple[str, ...]
    incorrect: tuple[str, ...]

    @property
    def mc1_choices(self) -> list[str]:
        return [self.best, *self.incorrect]

    @property
    def mc2_choices(self) -> list[str]:
        return [*self.correct, *self.incorrect]

    @property
    def mc2_labels(self) -> list[int]:
        return [1] * len(self.correct) + [0] * len(self.incorrect)


def split_answers(cell: str) -> list[str]:
    """'a; b;c;' -> ['a', 'b', 'c']: split on ';', strip, drop empty answers, keep the order."""
    return [a.strip() for a in cell.split(";") if a.strip()]


def load_questions(path: str | Path | None = None) -> list[Question]:
    """Every question of the CSV (default: the vendored TruthfulQA.csv), in file order; a CSV that is
    not UTF-8 is one TruthfulQAError line naming the file and how to re-encode it."""
    path = Path(path) if path else DEFAULT_CSV
    if not path.is_file():
        raise TruthfulQAError(f"{path}: no such file (give an existing TruthfulQA CSV)")
    try:
        return _read_questions(path)
    except UnicodeDecodeError as err:
        raise TruthfulQAError(f"{path} is not UTF-8 text (byte {err.object[err.start:err.start + 1]!r} at offset "
                              f"{err.start}): save it as UTF-8, e.g. iconv -f latin1 -t utf-8 {path} > "
                              f"{path.with_suffix('.utf8.csv')}") from None


def _read_questions(path: Path) -> list[Question]:
    with path.open(encoding="utf-8-sig", newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise TruthfulQAError(f"{path} lacks the column(s) {', '.join(missing)}: a TruthfulQA CSV needs "
                                  f"{', '.join(COLUMNS)}")
        questions = []
        for row, rec in enumerate(reader):
            q = Question(row, (rec["Question"] or "").strip(), (rec["Best Answer"] or "").strip(),
                         tuple(split_answers(rec["Correct Answers"] or "")),
                         tuple(split_answers(rec["Incorrect Answers"] or "")))
            for what, ok in (("question", q.question), ("best answer", q.best),
                             ("correct answer", q.correct), ("incorrect answer", q.incorrect)):
                if not ok:
                    raise TruthfulQAError(f"{path} row {row} (0-based data row) has no {what}: fix or drop it")
            questions.append(q)
    if not questions:
        raise TruthfulQAError(f"{path} has no question")
    return questions


def count_duplicate_choices(questions: list[Question]) -> dict[str, int]:
    """Choices that repeat an earlier choice of the same question: {"mc1": n, "mc2": n}."""
    return {"mc1": sum(len(q.mc1_choices) - len(set(q.mc1_choices)) for q in questions),
            "mc2": sum(len(q.mc2_choices) - len(set(q.mc2_choices)) for q in questions)}
