"""Stress settings of method=zero_shot (`zero_shot.settings`): the same stress inputs answered three ways.

direct      the zero-shot prompt with the context before its question line (ncb.methods.prompt_text), the
            answer read at the token after its continuation "The final answer is number " (as today).
cot         chain of thought: the prompt without its continuation, then COT ("Let's think step by step.")
            opening the answer; the model writes a rationale (truthfulqa.generate.Generator: greedy, at
            most `zero_shot.rationale_tokens` new tokens, stopping at the end of sequence or the turn's
            end, newlines kept; its text without special tokens, stripped), then
            "<prompt without continuation>Let's think step by step. <rationale>\\n<continuation>" and the
            answer read at its last token as direct.
reflection  a second turn (zero_shot.prompts.PromptRenderer.text's follow_up): the first answer, the
            direct setting's most probable of the six options on the same input, as the assistant's turn
            "The final answer is number <label>.", then REFLECT as the user's turn, then the assistant's
            turn opened with the continuation; the answer read there.

Each setting answers the clean statement (no context) and every stress input of the group pool (the valid
test targets with stress inputs; ncb.run); accuracy, drop and gap per group as ncb.stress computes them.
Every step runs in extract.scorer with its checkpoint kept in the output folder (`<setting>-<part>[-
rationales].npz`, resumed on a rerun: identical output after a kill).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from omegaconf import DictConfig, OmegaConf

from evaluation.cells import write_record

from toolkit.disk import atomic_write
from extract.models import load_model
from extract.scorer import Checkpoint, score
from ncb import self_consistency
from ncb.methods import STRESS_SCORES, Method, encode, prompt_text, score_options, zero_shot_probs
from ncb.stress import stress_results, write_csv
from truthfulqa.generate import Generator, stop_ids
from zero_shot.prompts import PromptRenderer, get_enumeration, option_token_ids

COT = "Let's think step by step."
REFLECT = "Please reconsider your answer carefully: is the statement correct? Respond with the corresponding {unit}."


class Answerer:
    """One loaded model, its prompt renderer, option ids and the ids that end a rationale (truthfulqa.generate.
    stop_ids without the newlines), shared by every setting's steps; checkpoints in `folder`."""

    def __init__(self, cfg: DictConfig, folder: Path):
        self.cfg, self.folder = cfg, folder
        self.loaded = load_model(cfg.model)
        tok = self.loaded.tokenizer
        self.renderer = PromptRenderer(tok, get_enumeration(cfg.zero_shot.enumeration), self.loaded.use_chat_template)
        self.option_ids = option_token_ids(tok, self.renderer.enum.labels)
        stop, record = stop_ids(tok, self.loaded.model.get_output_embeddings().weight.shape[0])
        self.stop = np.zeros_like(stop)
        self.stop[record["end_ids"]] = True
        self.stop_record = {k: record[k] for k in ("end_ids", "end_tokens")}

    def texts(self, setting: str, statements, contexts, first=None, rationales=None) -> list[str]:
        """The prompt texts of a setting (module docstring); first: option positions (reflection),
        rationales: texts (cot; None: the generation prompts, ending in COT)."""
        r, continuation = self.renderer, self.renderer.enum.continuation
        if setting == "reflection":
            ask = REFLECT.format(unit=r.enum.unit)
            return [prompt_text(r, s, c, (r.enum.labels[int(a)], ask))
                    for s, c, a in zip(statements, contexts, first)]
        texts = [prompt_text(r, s, c) for s, c in zip(statements, contexts)]
        if setting == "direct":
            return texts
        heads = [t[: len(t) - len(continuation)] + COT for t in texts]
        return heads if rationales is None else [f"{h} {x}".rstrip() + "\n" + continuation
                                                 for h, x in zip(heads, rationales)]

    def answer(self, setting: str, statements, contexts, name: str, first=None,
               sample: tuple[float, int] | None = None) -> tuple[np.ndarray, list[str] | None]:
        """(float32 [P, 7] option probabilities, cot's rationales or None) of a setting's prompts.
        sample=None: greedy rationale, options at temperature 1; (T, seed): rationale sampled at T (seeded),
        options at T. Checkpoints <folder>/<name>.npz and <name>-rationales.npz."""
        rationales = None
        if setting == "cot":
            heads = self.texts("cot", statements, contexts)
            rationales = self.rationales(heads, name, *(sample or (0.0, 0))) if heads else []
        texts = self.texts(setting, statements, contexts, first, rationales)
        if not texts:
            return np.zeros((0, 7), dtype=np.float32), rationales
        temperature = 1.0 if sample is None else sample[0]
        return score_options(self.cfg, self.loaded, self.option_ids, [encode(self.renderer, t) for t in texts],
                             self.folder / f"{name}.npz", temperature), rationales

    def rationales(self, heads: list[str], name: str, temperature: float, seed: int) -> list[str]:
        """The rationale text generated after each prompt text (greedy at temperature 0, else sampled at it
        from a generator seeded by `seed` and the batch's first row), checkpointed after every batch."""
        n = int(self.cfg.zero_shot.rationale_tokens)
        checkpoint = Checkpoint(self.folder / f"{name}-rationales.npz", {"decoding": self.decoding(temperature, seed),
                                                                        "stop": self.stop_record},
                                1, atomic_write, resume=not self.cfg.overwrite)
        rows = score(self.loaded, [encode(self.renderer, h) for h in heads],
                     Generator(self.loaded, self.stop, n, temperature, 1.0, seed), int(self.cfg.zero_shot.batch_size),
                     longest_first=True, prefix_cache=False, checkpoint=checkpoint, desc=f"{name} rationales").results
        return [self.loaded.tokenizer.decode([int(i) for i in row if i >= 0], skip_special_tokens=True).strip()
                for row in rows]

    def decoding(self, temperature: float, seed: int) -> dict:
        """What a cot rationale's decoding was (recorded)."""
        return {"max_new_tokens": int(self.cfg.zero_shot.rationale_tokens), "temperature": temperature,
                "greedy": temperature == 0, "top_p": 1.0, "seed": seed if temperature else None,
                "batch_size": int(self.cfg.zero_shot.batch_size), "stop": self.stop_record}


def output_paths(cfg: DictConfig, out: Path) -> list[Path]:
    """The files of the other settings and of self-consistency in the output folder `out`."""
    return [out / f"{kind}-{setting}.{ext}" for setting in cfg.zero_shot.settings[1:]
            for kind, ext in (("stress", "json"), ("inputs", "csv"))] + [out / "self_consistency.json"]


@dataclass
class Pool:
    """What every setting answers: the group pool's clean statements (M) and their stress inputs (P)."""
    rows: np.ndarray          # int [M] table rows: the valid test targets with stress inputs
    y: np.ndarray             # int [M] their task targets
    statements: np.ndarray    # str [M]
    first: np.ndarray         # int [M] the direct answer's most probable option on the clean statement
    inputs: pd.DataFrame      # their stress inputs (contexts.interference.COLUMNS), P rows
    inputs_y: np.ndarray      # int [P]
    inputs_first: np.ndarray  # int [P] the direct answer's most probable option on each


def make_pool(answerer: Answerer, method: Method, frame: pd.DataFrame, pool: pd.DataFrame) -> Pool:
    """The Pool of belief_targets rows `pool`; frame: every stress input (its direct scores are read back
    from the finished stress_scores.npz checkpoint: no forward pass)."""
    rows = pool["row"].to_numpy()
    position = pd.Series(np.arange(len(method.rows)), index=method.rows)
    inputs = frame["target_row"].isin(rows).to_numpy()
    direct = answerer.answer("direct", frame["statement"], frame["context"], STRESS_SCORES)[0]
    y = pd.Series(pool["y"].to_numpy(), index=rows)
    chosen = frame[inputs].reset_index(drop=True)
    return Pool(rows, y.to_numpy(), method.table["statement"].to_numpy()[rows],
                method.options[position[rows].to_numpy(), :6].argmax(1), chosen,
                y.loc[chosen["target_row"]].to_numpy(), direct[inputs, :6].argmax(1))


def run_settings(method: Method, cfg: DictConfig, frame: pd.DataFrame, pool: pd.DataFrame, targets: pd.DataFrame,
                 groups: dict, correct: np.ndarray, out: Path) -> dict[Path, tuple]:
    """The zero-shot method's other settings and the self-consistency of every setting: {path: (writer,
    *arguments)} for ncb.run to write, paths as output_paths.

    frame / correct: every stress input and whether the direct answer on it is right; pool: the group
    pool's rows of belief_targets; targets: belief_targets indexed by row; groups: {fraction: (high, low)}."""
    answerer = Answerer(cfg, out)
    p = make_pool(answerer, method, frame, pool)
    entities, config = method.table["object_1"].to_numpy(), OmegaConf.to_container(cfg, resolve=True)
    clean = {"direct": pd.Series(True, index=p.rows)}
    stress_ok = {"direct": correct[frame["target_row"].isin(p.rows).to_numpy()]}
    outputs = {}
    for setting in cfg.zero_shot.settings[1:]:
        scores, why = answerer.answer(setting, p.statements, [""] * len(p.rows), f"{setting}-clean", p.first)
        stressed, stressed_why = answerer.answer(setting, p.inputs["statement"], p.inputs["context"],
                                                 f"{setting}-stress", p.inputs_first)
        clean[setting] = pd.Series(_right(scores, p.y, method.task), index=p.rows)
        stress_ok[setting] = _right(stressed, p.inputs_y, method.task)
        summary = {"setting": setting, "method": method.name, "model": cfg.model.name, "datapack": cfg.data.name,
                   "decoding": answerer.decoding(0.0, 0) if setting == "cot" else None,
                   "prompt": answerer.texts(setting, p.statements[:1], ["{context}"], p.first[:1],
                                            ["{rationale}"])[0] if len(p.rows) else None,
                   "counts": {"targets": int(len(p.rows)), "clean_correct": int(clean[setting].sum()),
                              "stress_inputs": int(len(p.inputs))},
                   "results": stress_results(p.inputs, stress_ok[setting], groups, targets, entities, cfg,
                                             clean[setting])}
        outputs[out / f"stress-{setting}.json"] = (write_record, summary, config)
        record = pd.DataFrame({"target_row": np.concatenate([p.rows, p.inputs["target_row"]]),
                               "interference": ["clean"] * len(p.rows) + p.inputs["interference"].tolist(),
                               "level": [""] * len(p.rows) + p.inputs["level"].tolist(),
                               "p_y": np.concatenate([_p_y(scores, p.y, method.task),
                                                      _p_y(stressed, p.inputs_y, method.task)]),
                               "correct": np.concatenate([clean[setting].to_numpy(), stress_ok[setting]])})
        if setting == "reflection":
            record["first_answer"] = [answerer.renderer.enum.labels[a] for a in np.concatenate([p.first,
                                                                                                p.inputs_first])]
        else:
            record["rationale"] = why + stressed_why
        outputs[out / f"inputs-{setting}.csv"] = (write_csv, record)
    z = cfg.zero_shot.self_consistency
    sample, n = (float(z.temperature), int(z.seed)), int(z.n_samples)
    sc = {setting: self_consistency.report(setting, p.rows, dist, clean[setting], p.inputs, stress_ok[setting],
                                           targets, entities, answerer.renderer.enum.labels, cfg)
          for setting, dist in answer_samples(answerer, p, list(clean), sample, n).items()}
    summary = {"method": method.name, "model": cfg.model.name, "datapack": cfg.data.name,
               "temperature": sample[0], "n_samples": n, "seed": sample[1], "top_p": 1.0,
               "perfect": f"unanimous >= {self_consistency.PERFECT}",
               "cot_decoding": answerer.decoding(*sample) if "cot" in sc else None,
               "settings": {s: {k: v for k, v in r.items() if k != "targets"} for s, r in sc.items()},
               "targets": [t for r in sc.values() for t in r["targets"]]}
    outputs[out / "self_consistency.json"] = (write_record, summary, config)
    return outputs


def answer_samples(answerer: Answerer, p: Pool, settings: list[str], sample: tuple[float, int], n: int
                   ) -> dict[str, np.ndarray]:
    """{setting: float [M, n, 6]}: the n answer distributions at temperature T of each clean statement of the
    pool (ncb.self_consistency: direct exact, cot rationales sampled, reflection first answers drawn)."""
    m = len(p.rows)
    direct = answerer.answer("direct", p.statements, [""] * m, "sc-direct", sample=sample)[0][:, :6]
    q = {"direct": np.repeat(direct[:, None], n, axis=1)}
    if "cot" in settings:
        scores = answerer.answer("cot", np.repeat(p.statements, n), [""] * (n * m), "sc-cot", sample=sample)[0]
        q["cot"] = scores[:, :6].reshape(m, n, 6)
    if "reflection" in settings:
        first = self_consistency.draw_first_answers(direct, n, sample[1])
        keys = np.stack([np.repeat(np.arange(m), n), first.reshape(-1)], 1)
        pairs, inverse = np.unique(keys, axis=0, return_inverse=True)       # each distinct prompt scored once
        scores = answerer.answer("reflection", p.statements[pairs[:, 0]], [""] * len(pairs), "sc-reflection",
                                 pairs[:, 1], sample=sample)[0]
        q["reflection"] = scores[inverse.reshape(-1), :6].reshape(m, n, 6)
    return q


def _right(scores: np.ndarray, y: np.ndarray, task: str) -> np.ndarray:
    """bool [P]: the task's argmax prediction from option scores [P, 7] equals y [P]."""
    return np.argmax(zero_shot_probs(scores, task), axis=1) == y


def _p_y(scores: np.ndarray, y: np.ndarray, task: str) -> np.ndarray:
    """float [P]: the task's probability of y [P] from option scores [P, 7]."""
    return zero_shot_probs(scores, task)[np.arange(len(y)), y]
