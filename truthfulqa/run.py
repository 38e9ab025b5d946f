"""`python -m truthfulqa`: per-choice log-likelihoods of every question, MC1 / MC2 and their intervals.

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
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from evaluation.cells import atomic_write, write_record
from evaluation.multiple_choice import mc_scores, question_ci
from extract.errors import check_name
from extract.models import load_model
from extract.scorer import Checkpoint, partial_path, score
from extract.truthfulqa_pack import Question, TruthfulQAError, count_duplicate_choices, load_questions
from truthfulqa.likelihood import LoglikScorer, question_requests
from truthfulqa.schema import validate

log = logging.getLogger(__name__)


def result_path(cfg: DictConfig) -> Path:
    suffix = f"-limit{int(cfg.limit)}" if cfg.get("limit") else ""
    return (Path(cfg.results_dir) / check_name(cfg.model.name, "model.name") / "truthfulqa"
            / f"likelihood-{cfg.format}{suffix}.json")


def select_questions(cfg: DictConfig) -> list[Question]:
    questions = load_questions(cfg.get("data_path"))
    limit = cfg.get("limit")
    if limit is not None:
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise TruthfulQAError(f"limit={limit!r}: give a positive number of questions (or null for all)")
        questions = questions[:limit]
    return questions


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
    """Score the questions (or resume), write the result JSON atomically, print MC1 / MC2.

    on_batch(b): called after batch b (tests use it to simulate an interruption)."""
    cfg = validate(cfg)                       # every option typed and in range before any work
    fmt = cfg.format
    questions = select_questions(cfg)
    final = result_path(cfg)
    loaded = load_model(cfg.model)
    started = time.perf_counter()
    seqs, n_cont, mc1_idx, mc2_idx = build_requests(loaded.tokenizer, fmt, questions, loaded.system_prompt)
    partial = partial_path(final)
    checkpoint = Checkpoint(partial, {"format": fmt}, cfg.save_every, atomic_write)
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
    write_record(final, result, OmegaConf.to_container(cfg, resolve=True), indent=1)
    partial.unlink(missing_ok=True)
    print(f"TruthfulQA {fmt} ({cfg.model.name}, {len(questions)} questions): "
          f"MC1 {result['mc1']:.4f} [{result['mc1_ci'][0]:.4f}, {result['mc1_ci'][1]:.4f}]  "
          f"MC2 {result['mc2']:.4f} [{result['mc2_ci'][0]:.4f}, {result['mc2_ci'][1]:.4f}]  -> {final}")
    return final
