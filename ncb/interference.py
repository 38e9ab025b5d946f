"""Contextual interference: the text put before a target statement in the stress tests.

Every claim comes from the datapack itself (nothing is generated), for the target's subject entity
(`object_1`), among its affirmative (not negated) real statements, the first in datapack order:

    {false}      a false statement about the entity ("the city of X is located in W")
    {true}       a true statement about it ("the city of X is located in C")
    {neighbour}  a true statement about another entity whose object is the false claim's W
                 ("the city of Y is located in W": a confusable neighbour, no false claim in it)

A claim enters a template as a clause: the final period dropped, a leading The / A / An lowercased.
The templates (conf/ncb.yaml, `stress:`) map each interference to {level: template}; the template
`control` stands for a neutral passage (`neutral:`) cut to as many words as the interference's next
template has for the same target, so the control has the same length without any claim. A target
without the claims a template needs gets no input for it. Each context ends in a newline, so the
target's own tokens keep their ids (extract.capture.render; checked again on the extracted store).
"""
from __future__ import annotations

import io
import string
from pathlib import Path

import numpy as np
import pandas as pd

from evaluation.cells import atomic_write
from extract.errors import ToolkitError
from extract.statements import FALSE, NEITHER, TRUE

ARTICLES = ("The ", "A ", "An ")
CONTROL = "control"
FIELDS = ("false", "true", "neighbour")
COLUMNS = ["target_row", "interference", "level", "context", "statement", "object_1", "object_2", "negation",
           "label"]


def as_clause(statement: str) -> str:
    """"The city of X is located in Y." -> "the city of X is located in Y"."""
    text = statement.strip().rstrip(".").strip()
    return text[0].lower() + text[1:] if text.startswith(ARTICLES) else text


def entity_claims(table: pd.DataFrame) -> pd.DataFrame:
    """One row per entity (index object_1) with columns false, false_object, true, neighbour (clauses,
    None where the datapack has none), from the table's affirmative real statements."""
    affirmative = table[~table["negation"].to_numpy(dtype=bool) & (table["object_1"] != "")]
    false = affirmative[affirmative["label"] == FALSE].drop_duplicates("object_1").set_index("object_1")
    true = affirmative[affirmative["label"] == TRUE]
    claims = pd.DataFrame(index=pd.Index(table.loc[table["object_1"] != "", "object_1"].unique(), name="object_1"))
    claims["false"] = false["statement"].map(as_clause)
    claims["false_object"] = false["object_2"]
    claims["true"] = true.drop_duplicates("object_1").set_index("object_1")["statement"].map(as_clause)
    by_object = {obj: list(zip(g["object_1"], g["statement"])) for obj, g in true.groupby("object_2")}
    claims["neighbour"] = [next((as_clause(s) for e, s in by_object.get(obj, []) if e != entity), None)
                           if isinstance(obj, str) else None
                           for entity, obj in zip(claims.index, claims["false_object"])]
    return claims.astype(object).where(claims.notna(), None)


def _fields(template: str) -> set[str]:
    return {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}


def check_templates(stress: dict) -> None:
    """Every template of `stress` ({interference: {level: template}}) is `control` or text whose only
    fields are FIELDS; anything else (an unknown or positional field, a broken brace, an empty template,
    an interference without levels) is one ToolkitError line naming the template and the allowed fields
    (otherwise a template no claim can fill would silently give no input)."""
    allowed = f"use only {', '.join('{' + f + '}' for f in FIELDS)} in a template, or the template {CONTROL}"
    for interference, levels in stress.items():
        if not isinstance(levels, dict) or not levels:
            raise ToolkitError(f"stress.interferences.{interference} has no templates: give it {{level: template}}, "
                               f"e.g. stress.interferences.{interference}.1='...'")
        for level, template in levels.items():
            option = f"stress.interferences.{interference}.{level}"
            if not isinstance(template, str) or not template.strip():
                raise ToolkitError(f"{option}={template!r} is empty: {allowed}")
            if template == CONTROL:
                continue
            try:
                unknown = sorted(_fields(template) - set(FIELDS))
                if not unknown:
                    template.format(**{f: "x" for f in FIELDS})
            except (ValueError, KeyError, IndexError, AttributeError) as err:
                raise ToolkitError(f"{option}={template!r} is not a template ({err}): {allowed}") from None
            if unknown:
                raise ToolkitError(f"{option}={template!r} has the unknown field(s) "
                                   f"{', '.join('{' + f + '}' for f in unknown)}: {allowed}")


def _control(neutral: str, n_words: int) -> str:
    words = neutral.split()
    return " ".join(words[i % len(words)] for i in range(n_words)).rstrip(".,;") + "."


def perturbations(table: pd.DataFrame, targets: np.ndarray, stress: dict, neutral: str) -> pd.DataFrame:
    """The stress inputs of `targets` (table rows): one row per (target, interference, level) that the
    target's claims allow, columns COLUMNS (level as text, context ending in a newline, the target's
    statement, entities, negation and label copied from the table), in target then template order.

    stress: {interference: {level: template}} with fields {false}, {true}, {neighbour}, or `control`
    (check_templates: anything else is refused)."""
    check_templates(stress)
    claims = entity_claims(table)
    records = []
    for row in np.asarray(targets, dtype=np.int64):
        target = table.iloc[row]
        values = claims.loc[target["object_1"]].to_dict() if target["object_1"] in claims.index else {}
        for interference, levels in stress.items():
            texts = [None if t == CONTROL else (t.format(**values) if all(values.get(f) for f in _fields(t)) else "")
                     for t in levels.values()]
            for i, (level, text) in enumerate(zip(levels, texts)):
                if text is None:  # the control: as long as the next real template
                    following = next((t for t in texts[i + 1:] if t is not None), "")
                    text = _control(neutral, len(following.split())) if following else ""
                if text:
                    records.append((int(row), str(interference), str(level), text[0].upper() + text[1:] + "\n", target["statement"],
                                    target["object_1"], target["object_2"], bool(target["negation"]),
                                    int(target["label"])))
    return pd.DataFrame.from_records(records, columns=COLUMNS)


def write_datapack(frame: pd.DataFrame, path: Path) -> Path:
    """The stress inputs as a datapack CSV that `python -m extract data=csv` reads (statement, context,
    entities, negation, and `correct` / `real_object` giving each input its target's label), atomically."""
    csv = pd.DataFrame({"statement": frame["statement"], "context": frame["context"],
                        "object_1": frame["object_1"], "object_2": frame["object_2"],
                        "negation": frame["negation"].map({True: "true", False: "false"}),
                        "correct": (frame["label"] == TRUE).map({True: "true", False: "false"}),
                        "real_object": (frame["label"] != NEITHER).map({True: "true", False: "false"}),
                        "target_row": frame["target_row"], "interference": frame["interference"],
                        "level": frame["level"]})
    buffer = io.StringIO()
    csv.to_csv(buffer, index=False)
    data = buffer.getvalue().encode()
    atomic_write(Path(path), lambda f: f.write(data))
    return Path(path)
