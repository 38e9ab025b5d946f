"""The TruthfulQA questions and their MC1 / MC2 choices.

The CSV is parsed in one place, extract.truthfulqa_pack (the bottom layer, so that the probing
datapack `data=truthfulqa` reads the same answers); this module re-exports it for the likelihood
evaluation and adds what only that evaluation needs.
"""
from __future__ import annotations

from pathlib import Path

from extract import truthfulqa_pack
from extract.truthfulqa_pack import DEFAULT_CSV, Question, TruthfulQAError, split_answers

__all__ = ["DEFAULT_CSV", "Question", "TruthfulQAError", "load_questions", "split_answers",
           "count_duplicate_choices"]


def count_duplicate_choices(questions: list[Question]) -> dict[str, int]:
    """Choices that repeat an earlier choice of the same question: {"mc1": n, "mc2": n}."""
    return {"mc1": sum(len(q.mc1_choices) - len(set(q.mc1_choices)) for q in questions),
            "mc2": sum(len(q.mc2_choices) - len(set(q.mc2_choices)) for q in questions)}


def load_questions(path: str | Path | None = None) -> list[Question]:
    """extract.truthfulqa_pack.load_questions; a CSV that is not UTF-8 is one TruthfulQAError line naming
    the file and how to re-encode it."""
    try:
        return truthfulqa_pack.load_questions(path)
    except UnicodeDecodeError as err:
        where = Path(path) if path else DEFAULT_CSV
        raise TruthfulQAError(f"{where} is not UTF-8 text (byte {err.object[err.start:err.start + 1]!r} at offset "
                              f"{err.start}): save it as UTF-8, e.g. iconv -f latin1 -t utf-8 {where} > "
                              f"{where.with_suffix('.utf8.csv')}") from None
