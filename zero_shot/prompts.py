"""The zero-shot multiple-choice question, rendered for base and chat models, and the option ids.

The question follows the paper's zero-shot baseline (and the reference code's
``response/prompt_templates.py`` / ``run_zero_shot.py``, whose exact layout we match):

Base models (no chat template) get one plain text, ending in a trailing space::

    Question: Is the following statement correct? {statement}

    Select one of the following options:
    1. The statement is correct
    2. The statement is incorrect
    ...
    6. None of the above options are applicable

    Please respond with the corresponding number. The final answer is number ␣

Chat models get a fact-checking system turn, the question as the user turn (the reference's
instruct layout: a space after the blank line, the request to answer with a number moved to the
system turn, a final line break), and the assistant turn already started with
``The final answer is number ␣``. The assistant turn is opened by the template's generation prompt
(``add_generation_prompt=True``) and the continuation is appended as plain text, so no
end-of-turn token can follow it. A template without a system role (one that raises on it, or
drops it) gets the system text folded into the user turn, separated by a blank line, as the
reference does for Gemma. A template that ignores ``add_generation_prompt`` (the toy template of
``model=tiny``) has its assistant header taken from a rendered assistant turn instead.

Special tokens: a chat text is tokenised without adding special tokens (the template places them,
so BOS is never doubled); a base text gets the tokenizer's usual ones (Gemma: one ``<bos>``).

Enumerations (the reference's ``variation``), option i always means ``ANSWERS[i]`` (or the tf
wording), only its label changes; score columns are in option order whatever the labels:

==========  ===========================  ==========================================
name        labels of options 1..6       wording
==========  ===========================  ==========================================
default     1 2 3 4 5 6                  correct / incorrect
shuffled    2 6 1 5 3 4                  correct / incorrect
tf          1 2 3 4 5 6                  true / false (options 1 and 2 only)
abc         A B C D E F                  correct / incorrect, "uppercase letter"
==========  ===========================  ==========================================

(The reference's abc prompt says "the corresponding the uppercase letter ... The final answer is
the uppercase letter"; we say "the corresponding uppercase letter ... The final answer is letter".)
"""
from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass

import numpy as np

from toolkit.errors import ToolkitError

__all__ = ["ANSWERS", "TF_ANSWERS", "ENUMERATIONS", "Enumeration", "PromptRenderer",
           "get_enumeration", "base_prompt", "chat_messages", "option_token_ids", "PromptError"]

ANSWERS = (
    "The statement is correct",
    "The statement is incorrect",
    "I do not have sufficient knowledge about the statement",
    "The statement is too ambiguous to provide a reliable answer",
    "All of the above options are correct",
    "None of the above options are applicable",
)
TF_ANSWERS = ("The statement is true", "The statement is false") + ANSWERS[2:]

SYSTEM_TEXT = ("You are an expert in fact-checking. Your task is to assist the user by answering "
               "questions based on your comprehensive knowledge. Please respond with the corresponding {unit}.")


class PromptError(ToolkitError):
    """A prompt or option set that cannot be built for this tokenizer; one line naming the fix."""


@dataclass(frozen=True)
class Enumeration:
    """How the six options are labelled and worded.

    labels[i] is the label of option i (answers[i]); `unit` is what the model is asked to
    respond with, `answer_unit` the word before the label in the final-answer sentence.
    """
    name: str
    labels: tuple[str, ...]
    answers: tuple[str, ...]
    unit: str = "number"
    answer_unit: str = "number"

    @property
    def continuation(self) -> str:
        """The text the answer continues from (ends in a space; the label comes next)."""
        return f"The final answer is {self.answer_unit} "

    def options_text(self) -> str:
        return "\n".join(f"{label}. {answer}" for label, answer in zip(self.labels, self.answers))

    def system_text(self) -> str:
        return SYSTEM_TEXT.format(unit=self.unit)


_NUMBERS = ("1", "2", "3", "4", "5", "6")
ENUMERATIONS = {
    "default": Enumeration("default", _NUMBERS, ANSWERS),
    "shuffled": Enumeration("shuffled", ("2", "6", "1", "5", "3", "4"), ANSWERS),
    "tf": Enumeration("tf", _NUMBERS, TF_ANSWERS),
    "abc": Enumeration("abc", ("A", "B", "C", "D", "E", "F"), ANSWERS,
                       unit="uppercase letter", answer_unit="letter"),
}


def get_enumeration(name: str) -> Enumeration:
    if name not in ENUMERATIONS:
        raise PromptError(f"unknown enumeration {name!r}: choose one of {', '.join(ENUMERATIONS)}")
    return ENUMERATIONS[name]


def base_prompt(statement: str, enum: Enumeration) -> str:
    """The single text given to a base model (ends in the continuation's trailing space)."""
    return (f"Question: Is the following statement correct? {statement}\n\n"
            "Select one of the following options:\n"
            f"{enum.options_text()}\n\n"
            f"Please respond with the corresponding {enum.unit}. {enum.continuation}")


def chat_messages(statement: str, enum: Enumeration, fold_system: bool = False) -> list[dict]:
    """System + user turns of a chat model (the assistant turn is opened by the renderer).

    The user text keeps the reference's layout exactly, including the space that starts the
    "Select ..." line and the final line break.
    """
    user = (f"Question: Is the following statement correct? {statement}\n\n "
            f"Select one of the following options:\n{enum.options_text()}\n")
    if fold_system:
        return [{"role": "user", "content": f"{enum.system_text()}\n\n{user}"}]
    return [{"role": "system", "content": enum.system_text()}, {"role": "user", "content": user}]


_PROBE_STATEMENT = "Three plus three equals six."
_SENTINEL = "\u2063ZERO-SHOT-ANSWER\u2063"


class PromptRenderer:
    """Statement -> prompt text -> token ids, for one tokenizer and enumeration.

    use_chat_template: render through the tokenizer's chat template (instruct models) or as the
    plain base prompt. The chat layout is probed once at construction: whether the template
    keeps a system turn (else the system text is folded into the user turn) and whether it
    honours add_generation_prompt (else the assistant header is cut from a rendered assistant
    turn).
    """

    def __init__(self, tokenizer, enum: Enumeration, use_chat_template: bool):
        self.tokenizer = tokenizer
        self.enum = enum
        self.use_chat_template = bool(use_chat_template)
        self.fold_system = False
        self.assistant_header = "generation_prompt"
        if self.use_chat_template:
            if not getattr(tokenizer, "chat_template", None):
                raise PromptError("this tokenizer has no chat template: set model.chat_template=false")
            self.fold_system = not self._keeps_system()
            if not self._honours_generation_prompt():
                self.assistant_header = "rendered_assistant_turn"

    # ------------------------------------------------------------------ probing the template
    def _apply(self, messages, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def _keeps_system(self) -> bool:
        messages = chat_messages(_PROBE_STATEMENT, self.enum, fold_system=False)
        try:
            text = self._apply(messages, True)
        except Exception:  # jinja raise_exception("System role not supported") and the like
            return False
        return self.enum.system_text() in text

    def _honours_generation_prompt(self) -> bool:
        messages = chat_messages(_PROBE_STATEMENT, self.enum, self.fold_system)
        return self._apply(messages, True) != self._apply(messages, False)

    # -------------------------------------------------------------------------- rendering
    def text(self, statement: str, follow_up: tuple[str, str] | None = None) -> str:
        """The full prompt text; it ends with the continuation (e.g. "... is number ").

        follow_up = (label, question): a second turn (ncb's reflection setting): the first answer
        "<continuation><label>." as the assistant's turn, `question` as the next user turn, then the
        assistant's second turn opened with the continuation (base models: the same as plain text,
        "<label>.", a blank line, "<question> <continuation>")."""
        if not self.use_chat_template:
            text = base_prompt(statement, self.enum)
            return text if follow_up is None else f"{text}{follow_up[0]}.\n\n{follow_up[1]} {self.enum.continuation}"
        messages = chat_messages(statement, self.enum, self.fold_system)
        if follow_up is not None:
            messages += [{"role": "assistant", "content": f"{self.enum.continuation}{follow_up[0]}."},
                         {"role": "user", "content": follow_up[1]}]
        if self.assistant_header == "generation_prompt":
            head = self._apply(messages, True)
        else:
            rendered = self._apply(messages + [{"role": "assistant", "content": _SENTINEL}], False)
            head = rendered[: rendered.rindex(_SENTINEL)]
        return head + self.enum.continuation

    def ids(self, statement: str) -> np.ndarray:
        """Token ids int64 [n] of the prompt (special tokens: see the module docstring)."""
        ids = self.tokenizer(self.text(statement), add_special_tokens=not self.use_chat_template)["input_ids"]
        return np.asarray(ids, dtype=np.int64)

    def describe(self) -> dict:
        """JSON summary stored with the scores (and used to detect a changed prompt on resume)."""
        example = self.text(_PROBE_STATEMENT)
        return {
            "enumeration": self.enum.name,
            "labels": list(self.enum.labels),
            "answers": list(self.enum.answers),
            "chat_template": self.use_chat_template,
            "system_folded_into_user": self.fold_system,
            "assistant_header": self.assistant_header if self.use_chat_template else None,
            "example": example,
            "example_ids": self.ids(_PROBE_STATEMENT).tolist(),
            "sha256": hashlib.sha256(json.dumps([example, self.ids(_PROBE_STATEMENT).tolist()])
                                     .encode()).hexdigest()[:16],
        }


def word_token_ids(tokenizer, word: str) -> list[int]:
    """The ids whose next-token probability counts for answering `word`: of `word` and of " " + `word`, each
    encoded without special tokens, the first token that is neither special nor whitespace only (so "1" and " 1"
    give the ids of "1" and, where it exists, of " 1"; a bare space, BOS and the like are never taken); sorted,
    each once."""
    special = set(tokenizer.all_special_ids)
    ids = []
    for variant in (word, " " + word):
        for tok in tokenizer.encode(variant, add_special_tokens=False):
            if tok not in special and tokenizer.decode([tok]).strip():
                ids.append(int(tok))
                break
    return sorted(set(ids))


def option_token_ids(tokenizer, labels) -> list[list[int]]:
    """Token ids whose next-token probability counts for each option label.

    Each label's `word_token_ids`. An id reached from two different labels would be counted twice; such
    shared ids are removed from every option (as the reference does). Raises PromptError when an option is
    left without ids.
    """
    found = [word_token_ids(tokenizer, label) for label in labels]
    counts = Counter(tok for ids in found for tok in ids)
    out = [[tok for tok in ids if counts[tok] == 1] for ids in found]
    for label, ids in zip(labels, out):
        if not ids:
            raise PromptError(f"option label {label!r} has no token id of its own in this tokenizer: "
                              "choose another enumeration")
    return out
