"""A probe read token by token: one statement's tokens across a store's layers, each token's vector scored by the
probe (FittedProbe.token_scores), as numbers (`token_view`) and as one self-contained HTML page (`view_html`:
no script, no external file; the numbers also embedded as JSON in `<script type="application/json"
id="token-view">`).

Each token's colour is the probe's probability of one class for that token's vector (the calibrated score map of
the probe applied to the token's score): a binary task's positive class, a multiclass task's class with the
highest probability for the whole statement. The probe was fitted at one layer; at the others it reads vectors of
another layer, which shows where the direction it learnt is present, not what a probe fitted there would say.
"""
from __future__ import annotations

import html
import json

import numpy as np

from probes.artifacts import FittedProbe
from probes.features import TOKEN_KINDS, layer_features


def token_view(probe: FittedProbe, store, row: int, statement: str, token_text, classes: list[str],
               layers: list[int] | None = None) -> dict:
    """The numbers of `statement`, row `row` of `store` (an ActivationStore or on-the-fly MemoryStore holding the
    probe's layer): its tokens of the kinds the probe reads (`token_text(ids) -> [str]` names them), at each of `layers`
    (None: every stored one) each token's scores [T, heads] and probabilities [T, K] through the probe, and the
    probe's decision for the statement at its own layer (probabilities, conformal set, label or abstention)."""
    layers = store.layers if layers is None else layers
    rows, offsets = store.bag_rows(TOKEN_KINDS[probe.tokens])
    mine = rows[offsets[row]:offsets[row + 1]]                 # [T] this statement's token rows
    decision = probe.score_all(layer_features(store, probe.layer, probe.representation, probe.tokens)
                               .subset(np.array([row])))
    probs = decision["probs"][0]
    shown = 1 if len(classes) == 2 else int(np.argmax(probs))
    per_layer = {}
    for k in layers:
        scores = probe.token_scores(store.layer(k, mine))       # [T, heads]
        per_layer[int(k)] = {"scores": scores.tolist(), "probs": probe.from_scores(scores)["probs"].tolist()}
    pred = int(decision["pred"][0])
    return {"statement": statement, "row": int(row), "tokens": token_text(store.token_ids[mine]),
            "classes": classes, "shown_class": classes[shown], "shown_index": shown, "probe_layer": probe.layer,
            "layers": per_layer, "decision": {"probs": dict(zip(classes, probs.tolist())),
                                              "set": [classes[c] for c in np.flatnonzero(decision["sets"][0])],
                                              "pred": classes[pred] if pred >= 0 else None}}


def _colour(p: float) -> str:
    """A background for probability p: red towards 1, blue towards 0, white at 0.5."""
    strength = min(abs(p - 0.5) * 2, 1.0)
    rgb = (220, 60, 50) if p >= 0.5 else (50, 100, 220)
    return f"rgba({rgb[0]},{rgb[1]},{rgb[2]},{strength:.3f})"


def view_html(views: list[dict], title: str, about: str) -> str:
    """One HTML page of `views` (token_view's dicts): per statement a table, one row per layer (the probe's layer
    marked) and one cell per token coloured by its probability of the shown class (exact numbers on hover), the
    decision stated above it; `about` (what probe, which model) under the title."""
    parts = []
    for v in views:
        d = v["decision"]
        verdict = f"predicts <b>{html.escape(d['pred'])}</b>" if d["pred"] is not None else "<b>abstains</b>"
        probs = ", ".join(f"p({html.escape(c)}) = {p:.3f}" for c, p in d["probs"].items())
        head = "".join(f"<th>{html.escape(t)}</th>" for t in v["tokens"])
        body = []
        for k, layer in v["layers"].items():
            chosen = int(k) == v["probe_layer"]
            cells = "".join(
                f'<td style="background:{_colour(p[v["shown_index"]])}" title="layer {k}, token {i}: '
                f'p({html.escape(v["shown_class"])}) = {p[v["shown_index"]]:.4f}, score = '
                f'{", ".join(f"{s:.4f}" for s in layer["scores"][i])}">{p[v["shown_index"]]:.2f}</td>'
                for i, p in enumerate(layer["probs"]))
            label = f"{k} &larr; probe" if chosen else str(k)
            body.append(f'<tr class="{"chosen" if chosen else ""}"><th>{label}</th>{cells}</tr>')
        parts.append(
            f'<section><h2>{html.escape(v["statement"])}</h2>'
            f'<p>At its layer {v["probe_layer"]} the probe {verdict}: {probs}; conformal set '
            f'{{{", ".join(map(html.escape, d["set"]))}}}. Cells: each token\'s p({html.escape(v["shown_class"])}).</p>'
            f'<div class="scroll"><table><tr><th>layer</th>{head}</tr>{"".join(body)}</table></div></section>')
    data = json.dumps(views).replace("</", "<\\/")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }}
.scroll {{ overflow-x: auto; }}
table {{ border-collapse: collapse; font-size: 12px; }}
th, td {{ border: 1px solid #ddd; padding: 2px 5px; text-align: center; white-space: pre; }}
tr.chosen th, tr.chosen td {{ border-top: 2px solid #000; border-bottom: 2px solid #000; font-weight: bold; }}
.legend span {{ display: inline-block; width: 3em; text-align: center; }}
</style></head><body>
<h1>{html.escape(title)}</h1>
<p>{html.escape(about)}</p>
<p class="legend">probability of the shown class:
<span style="background:{_colour(0.0)}">0</span><span style="background:{_colour(0.25)}">0.25</span><span
style="background:{_colour(0.5)}">0.5</span><span style="background:{_colour(0.75)}">0.75</span><span
style="background:{_colour(1.0)}">1</span>. The probe was fitted at the marked layer; at the others it reads
another layer's vectors (where its direction is present, not what a probe fitted there would say).</p>
{"".join(parts)}
<script type="application/json" id="token-view">{data}</script>
</body></html>
"""
