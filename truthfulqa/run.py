"""`python -m truthfulqa`: per-choice log-likelihoods of every question, MC1 / MC2 and their intervals
(`mode=likelihood`, below); P(yes) that each answer is correct, MC1 / MC2_verify (`mode=verify`, `run_verify`);
generated answers judged (`mode=generate`, truthfulqa.generate).

Output ``<results_dir>/<model.name>/truthfulqa/likelihood-<format>[-limit<N>].json``::

    format, n_questions, mc1, mc2, mc1_ci, mc2_ci (95 % bootstrap over questions),
    n_duplicate_choices {mc1, mc2}, model_id, model_fingerprint, seconds (tokenising + scoring in
    this run, model loading excluded), resumed_after_requests,
    questions: [{row (0-based CSV data row), mc1_logliks, mc2_logliks, mc2_labels}, ...]

MC1 = mean over questions of [argmax(mc1_logliks) == 0] (np.argmax: ties go to the first choice);
MC2 = mean over questions of sum_true p / sum_all p, p = exp(loglik) (as the harness's
process_results_mc2, computed with the largest loglik subtracted first).

Each distinct (sequence, continuation length) of the run is scored once (an incorrect answer is
in both MC1 and MC2). Requests run longest first in batches of `batch_size` (extract.scorer); with
`prefix_cache=true` the tokens every request starts with (the primer) run once. Every `save_every`
batches the log-likelihoods done so far go atomically to ``<name>.partial.npz``; a rerun with the
same model, format and questions continues from it (other settings: it starts again; a file that
cannot be read is discarded with one warning). Every option is checked first (truthfulqa.schema).

mode=verify, ``verify-<format>[-limit<N>].json``::

    mode, format, prompt (truthfulqa.verify.prompt_record: template, Yes / No ids and tokens),
    n_questions, mc1_verify, mc1_verify_ci, mc1_verify_ties, mc2_verify, mc2_verify_ci,
    p_yes_correct / p_yes_incorrect (mean over answers), model_id, model_label, model_fingerprint,
    seconds, resumed_after_requests,
    questions: [{row, p_yes (per MC2 choice), mc2_labels, mc1_p_yes (best, then incorrect)}, ...]

Each distinct prompt is scored once (extract.scorer, checkpointed and resumed as above).
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from evaluation.cells import write_record

from toolkit.disk import atomic_write
from evaluation.multiple_choice import mc1_credit, mc2_verify, mc_scores, question_ci
from extract.models import load_model
from extract.scorer import Checkpoint, partial_path, score
from extract.truthfulqa_pack import Question, count_duplicate_choices
from truthfulqa.common import machine, result_path, select_questions
from truthfulqa.likelihood import LoglikScorer, question_requests
from truthfulqa.schema import validate
from truthfulqa.verify import NextTokenMass, encode, p_yes, prompt_record, verify_text, yes_no_ids

log = logging.getLogger(__name__)


def build_requests(tokenizer, fmt: str, questions: list[Question], system_prompt=None):
    """Distinct scored sequences and where each choice's score comes from.

    Returns seqs (list of int64 arrays: context + continuation ids), n_cont (continuation lengths)
    and, per question, int arrays indexing seqs for its MC1 and MC2 choices.
    """
    index: dict[tuple, int] = {}
    seqs, n_cont, mc1_idx, mc2_idx = [], [], [], []
    for q in tqdm(questions, desc="tokenize", unit="question", leave=False):
        choices = list(dict.fromkeys(q.mc1_choices + q.mc2_choices))
        where = {}
        for choice, (ctx, cont) in zip(choices, question_requests(tokenizer, fmt, q.question, choices,
                                                                  system_prompt)):
            key = (tuple(ctx + cont), len(cont))
            if key not in index:
                index[key] = len(seqs)
                seqs.append(np.array(ctx + cont, dtype=np.int64))
                n_cont.append(len(cont))
            where[choice] = index[key]
        mc1_idx.append(np.array([where[c] for c in q.mc1_choices]))
        mc2_idx.append(np.array([where[c] for c in q.mc2_choices]))
    return seqs, n_cont, mc1_idx, mc2_idx


def run(cfg: DictConfig, on_batch=None) -> Path:
    """Run `mode=` (likelihood, verify or generate) on the questions (or resume), write its result JSON
    atomically and print its headline numbers.

    on_batch(b): called after batch b (tests use it to simulate an interruption)."""
    cfg = validate(cfg)                       # every option typed and in range before any work
    if cfg.mode == "verify":
        return run_verify(cfg, on_batch)
    if cfg.mode == "generate":
        from truthfulqa.generate import run_generate

        return run_generate(cfg, on_batch)
    return run_likelihood(cfg, on_batch)


def _start(cfg: DictConfig):
    """What a scoring mode starts from: (its questions, its result's path, the loaded model, the start time)."""
    return select_questions(cfg), result_path(cfg), load_model(cfg.model), time.perf_counter()


def _finish(cfg: DictConfig, final: Path, result: dict, summary: str) -> Path:
    """Write a mode's `result` to `final` with its config, drop its checkpoint, print `summary` and the path."""
    write_record(final, result, OmegaConf.to_container(cfg, resolve=True), indent=1)
    partial_path(final).unlink(missing_ok=True)
    print(f"{summary}  -> {final}")
    return final


def run_likelihood(cfg: DictConfig, on_batch=None) -> Path:
    """mode=likelihood: per-choice log-likelihoods -> MC1 / MC2 (module docstring)."""
    fmt = cfg.format
    questions, final, loaded, started = _start(cfg)
    seqs, n_cont, mc1_idx, mc2_idx = build_requests(loaded.tokenizer, fmt, questions, loaded.system_prompt)
    checkpoint = Checkpoint(partial_path(final), {"format": fmt}, cfg.save_every, atomic_write)
    scored = score(loaded, seqs, LoglikScorer(n_cont), cfg.batch_size, longest_first=True,
                   prefix_cache=cfg.prefix_cache, checkpoint=checkpoint, desc=f"truthfulqa {fmt}", on_batch=on_batch)
    logliks = scored.results
    mc1_ll = [logliks[i].tolist() for i in mc1_idx]
    mc2_ll = [logliks[i].tolist() for i in mc2_idx]
    labels = [q.mc2_labels for q in questions]
    mc1, mc2 = mc_scores(mc1_ll, mc2_ll, labels)
    result = {
        "format": fmt, "n_questions": len(questions), "mc1": float(mc1.mean()), "mc2": float(mc2.mean()),
        "mc1_ci": question_ci(mc1, cfg.n_boot, cfg.seed), "mc2_ci": question_ci(mc2, cfg.n_boot, cfg.seed),
        "n_duplicate_choices": count_duplicate_choices(questions),
        "model_id": loaded.model_id, "model_label": loaded.label, "model_fingerprint": loaded.fingerprint,
        "seconds": time.perf_counter() - started, "resumed_after_requests": scored.resumed_after,
        "questions": [{"row": q.row, "mc1_logliks": a, "mc2_logliks": b, "mc2_labels": y}
                      for q, a, b, y in zip(questions, mc1_ll, mc2_ll, labels)],
    }
    return _finish(cfg, final, result, f"TruthfulQA {fmt} ({cfg.model.name}, {len(questions)} questions): "
                   f"MC1 {result['mc1']:.4f} [{result['mc1_ci'][0]:.4f}, {result['mc1_ci'][1]:.4f}]  "
                   f"MC2 {result['mc2']:.4f} [{result['mc2_ci'][0]:.4f}, {result['mc2_ci'][1]:.4f}]")


def distinct_prompts(tokenizer, fmt: str, questions: list[Question], system_prompt=None):
    """The verification prompts of every (question, distinct answer): seqs (int64 arrays, each distinct
    prompt once) and, per question, int [K] indexing seqs for its MC2 choices and int [1 + I] for its MC1
    choices."""
    index: dict[tuple, int] = {}
    seqs, mc1_idx, mc2_idx = [], [], []
    for q in tqdm(questions, desc="tokenize", unit="question", leave=False):
        where = {}
        for answer in dict.fromkeys(q.mc1_choices + q.mc2_choices):
            ids = encode(tokenizer, fmt, verify_text(fmt, q.question, answer, tokenizer, system_prompt))
            where[answer] = index.setdefault(tuple(ids.tolist()), len(seqs))
            if where[answer] == len(seqs):
                seqs.append(ids)
        mc1_idx.append(np.array([where[c] for c in q.mc1_choices]))
        mc2_idx.append(np.array([where[c] for c in q.mc2_choices]))
    return seqs, mc1_idx, mc2_idx


def score_yes_no(loaded, seqs: list[np.ndarray], ids: dict, cfg: DictConfig, final: Path, signature: dict,
                 desc: str, on_batch=None):
    """P(yes) float [N] of each prompt (next-token yes vs no mass) through extract.scorer, checkpointed
    beside `final`; returns (p_yes, Scored)."""
    checkpoint = Checkpoint(partial_path(final), {**signature, "yes_ids": ids["yes"], "no_ids": ids["no"]},
                            cfg.save_every, atomic_write)
    scored = score(loaded, seqs, NextTokenMass(loaded.model, [ids["yes"], ids["no"]]), cfg.batch_size, longest_first=True,
                   prefix_cache=cfg.prefix_cache, checkpoint=checkpoint, desc=desc, on_batch=on_batch)
    return p_yes(scored.results), scored


def run_verify(cfg: DictConfig, on_batch=None) -> Path:
    """mode=verify: P(yes) of every (question, answer) -> MC1_verify / MC2_verify (module docstring)."""
    fmt = cfg.format
    questions, final, loaded, started = _start(cfg)
    ids = yes_no_ids(loaded.tokenizer)
    seqs, mc1_idx, mc2_idx = distinct_prompts(loaded.tokenizer, fmt, questions, loaded.system_prompt)
    p, scored = score_yes_no(loaded, seqs, ids, cfg, final, {"mode": "verify", "format": fmt}, f"verify {fmt}",
                             on_batch)
    labels = [q.mc2_labels for q in questions]
    mc2_p = [p[i] for i in mc2_idx]
    mc1 = np.array([mc1_credit(p[i], ties="expected") for i in mc1_idx])
    mc2 = mc2_verify(mc2_p, labels)
    flat_p, flat_y = np.concatenate(mc2_p), np.concatenate(labels)
    result = {
        "mode": "verify", "format": fmt, "prompt": prompt_record(fmt, loaded.tokenizer, loaded.system_prompt, ids),
        "n_questions": len(questions), "n_prompts": len(seqs),
        "mc1_verify": float(mc1.mean()), "mc1_verify_ci": question_ci(mc1, cfg.n_boot, cfg.seed),
        "mc1_verify_ties": int(((mc1 > 0) & (mc1 < 1)).sum()),
        "mc2_verify": float(mc2.mean()), "mc2_verify_ci": question_ci(mc2, cfg.n_boot, cfg.seed),
        "p_yes_correct": float(flat_p[flat_y == 1].mean()), "p_yes_incorrect": float(flat_p[flat_y == 0].mean()),
        "model_id": loaded.model_id, "model_label": loaded.label, "model_fingerprint": loaded.fingerprint,
        "machine": machine(loaded), "seconds": time.perf_counter() - started,
        "resumed_after_requests": scored.resumed_after,
        "questions": [{"row": q.row, "p_yes": a.tolist(), "mc2_labels": y, "mc1_p_yes": p[i].tolist()}
                      for q, a, y, i in zip(questions, mc2_p, labels, mc1_idx)],
    }
    return _finish(cfg, final, result, f"TruthfulQA verify {fmt} ({loaded.label}, {len(questions)} questions): "
                   f"MC1 {result['mc1_verify']:.4f} [{result['mc1_verify_ci'][0]:.4f}, {result['mc1_verify_ci'][1]:.4f}]  "
                   f"MC2_verify {result['mc2_verify']:+.4f} [{result['mc2_verify_ci'][0]:+.4f}, "
                   f"{result['mc2_verify_ci'][1]:+.4f}]")
