"""Contextual interference: the text put before a target statement in the stress tests.

Every claim comes from the datapack itself (nothing is generated), for the target's subject entity
(`object_1`), among its affirmative (not negated) real statements, the first in datapack order:

    {false}      a false statement about the entity ("the city of X is located in W")
    {true}       a true statement about it ("the city of X is located in C")
    {neighbour}  a true statement about another entity whose object is the false claim's W
                 ("the city of Y is located in W": a confusable neighbour, no false claim in it)

A claim enters a template as a clause: the final period dropped, a leading The / A / An lowercased.
The templates (conf/stress/default.yaml, `stress:`) map each interference to {level: template}; the template
`control` stands for a neutral passage (`neutral:`) cut to as many words as the interference's next
template has for the same target, so the control has the same length without any claim. A target
without the claims a template needs gets no input for it. Each context ends in a newline, so the
target's own tokens keep their ids (extract.capture.render; checked again on the extracted store).
Each input records the table rows its claims quote (`claim_rows`); `sources` restricts them (probes.augment:
training statements only).
"""
from __future__ import annotations

import io
import string
from pathlib import Path

import numpy as np
import pandas as pd

from toolkit.disk import atomic_write
from toolkit.errors import ToolkitError
from extract.statements import FALSE, NEITHER, TRUE

ARTICLES = ("The ", "A ", "An ")
CONTROL = "control"
FIELDS = ("false", "true", "neighbour")
COLUMNS = ["target_row", "interference", "level", "context", "statement", "object_1", "object_2", "negation",
           "label", "claim_rows"]


def as_clause(statement: str) -> str:
    """"The city of X is located in Y." -> "the city of X is located in Y"."""
    text = statement.strip().rstrip(".").strip()
    return text[0].lower() + text[1:] if text.startswith(ARTICLES) else text


def entity_claims(table: pd.DataFrame, sources: np.ndarray | None = None) -> pd.DataFrame:
    """One row per entity (index object_1) with columns false, false_object, true, neighbour (clauses,
    None where the datapack has none) and false_row, true_row, neighbour_row (the table rows they quote),
    from the affirmative real statements among `sources` (int table rows; None: every row)."""
    pool = table.assign(row=np.arange(len(table)))
    if sources is not None:
        pool = pool.iloc[np.sort(np.asarray(sources, dtype=np.int64))]
    affirmative = pool[~pool["negation"].to_numpy(dtype=bool) & (pool["object_1"] != "")]
    false = affirmative[affirmative["label"] == FALSE].drop_duplicates("object_1").set_index("object_1")
    true = affirmative[affirmative["label"] == TRUE]
    first_true = true.drop_duplicates("object_1").set_index("object_1")
    claims = pd.DataFrame(index=pd.Index(pool.loc[pool["object_1"] != "", "object_1"].unique(), name="object_1"))
    claims["false"], claims["false_row"] = false["statement"].map(as_clause), false["row"]
    claims["false_object"] = false["object_2"]
    claims["true"], claims["true_row"] = first_true["statement"].map(as_clause), first_true["row"]
    by_object = {obj: list(zip(g["object_1"], g["statement"], g["row"])) for obj, g in true.groupby("object_2")}
    neighbours = [next(((as_clause(s), r) for e, s, r in by_object.get(obj, []) if e != entity), (None, None))
                  if isinstance(obj, str) else (None, None)
                  for entity, obj in zip(claims.index, claims["false_object"])]
    claims["neighbour"] = [clause for clause, _ in neighbours]
    claims["neighbour_row"] = [row for _, row in neighbours]
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


def control_text(neutral: str, n_words: int) -> str:
    """The neutral passage cut (or repeated) to `n_words` words, ending in a period: a context of that
    length without any claim."""
    words = neutral.split()
    return " ".join(words[i % len(words)] for i in range(n_words)).rstrip(".,;") + "."


def perturbations(table: pd.DataFrame, targets: np.ndarray, stress: dict, neutral: str,
                  sources: np.ndarray | None = None) -> pd.DataFrame:
    """The stress inputs of `targets` (table rows): one row per (target, interference, level) that the
    target's claims allow, columns COLUMNS (level as text, context ending in a newline, the target's
    statement, entities, negation and label copied from the table, claim_rows: the sorted table rows
    the context quotes, none for a control), in target then template order.

    stress: {interference: {level: template}} with fields {false}, {true}, {neighbour}, or `control`
    (check_templates: anything else is refused). sources: the table rows a claim may quote (None:
    every row)."""
    check_templates(stress)
    claims = entity_claims(table, sources).to_dict(orient="index")
    fields = {t: _fields(t) for levels in stress.values() for t in levels.values()}
    statement, object_1, object_2, negation, label = (table[c].to_numpy() for c in COLUMNS[4:9])
    records = []
    for row in np.asarray(targets, dtype=np.int64):
        values = claims.get(object_1[row], {})
        target = (statement[row], object_1[row], object_2[row], bool(negation[row]), int(label[row]))
        for interference, levels in stress.items():
            texts = [None if t == CONTROL else (t.format(**values) if all(values.get(f) for f in fields[t]) else "")
                     for t in levels.values()]
            for i, (level, template, text) in enumerate(zip(levels, levels.values(), texts)):
                if text is None:  # the control: as long as the next real template
                    following = next((t for t in texts[i + 1:] if t is not None), "")
                    text = control_text(neutral, len(following.split())) if following else ""
                if text:
                    quoted = sorted(int(values[f"{f}_row"]) for f in fields[template])
                    records.append((int(row), str(interference), str(level), text[0].upper() + text[1:] + "\n",
                                    *target, quoted))
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
