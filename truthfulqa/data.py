"""The TruthfulQA questions and their MC1 / MC2 choices.

The CSV is parsed in one place, extract.truthfulqa_pack (the bottom layer, so that the probing
datapack `data=truthfulqa` reads the same answers); this module re-exports it for the likelihood
evaluation and adds what only that evaluation needs.
"""
from __future__ import annotations

from extract.truthfulqa_pack import DEFAULT_CSV, Question, TruthfulQAError, load_questions, split_answers

__all__ = ["DEFAULT_CSV", "Question", "TruthfulQAError", "load_questions", "split_answers",
           "count_duplicate_choices"]


def count_duplicate_choices(questions: list[Question]) -> dict[str, int]:
    """Choices that repeat an earlier choice of the same question: {"mc1": n, "mc2": n}."""
    return {"mc1": sum(len(q.mc1_choices) - len(set(q.mc1_choices)) for q in questions),
            "mc2": sum(len(q.mc2_choices) - len(set(q.mc2_choices)) for q in questions)}
