"""TruthfulQA by generation (`mode=generate`): the model answers each question, a judge (truthfulqa.judge)
rates each answer truthful / informative.

Prompt = the likelihood's context (truthfulqa.likelihood.context_text): lm_eval = the 6-shot QA primer +
``"\\n\\nQ: " + question + "\\nA:"`` (TruthfulQA's own generation prompt), plain = without the primer,
chat = the question as the user turn of the chat template, then the assistant turn's opening.
Decoding (`generate.*`, recorded): greedy (temperature 0) or sampling at `temperature` with nucleus
`top_p` (each batch's torch.Generator seeded from `seed` and the batch's first row), at most
`max_new_tokens`; a row stops at the first token whose text holds a newline, at the end-of-sequence
token or at the chat turn's end token. The answer = the decoded new tokens (special tokens skipped), cut
at the first newline, stripped.

Generation runs in extract.scorer (`Generator` is its reduction: token ids as float64 [B, max_new_tokens],
-1 after the stop; prompts longest first, left-padded inside a batch) with a checkpoint after every
batch, so a SIGKILL loses at most the batch in flight and a rerun continues with the same batches:
identical output. Judging: every generated answer on both dimensions and the dataset's own correct and
incorrect answers of the same questions on truthfulness (the agreement check; `judge_references=N`: the
first N of each kind per question); P(yes) of each judge
prompt is cached in ``<results_dir>/<judge>/truthfulqa/judge-cache.json`` (truthfulqa.judge.cache_key),
so reruns and other generation settings score only prompts not seen before.

Output ``<results_dir>/<model.name>/truthfulqa/generate-<format>-<decoding>[-limit<N>].json``::

    mode, format, decoding {temperature, top_p, seed, max_new_tokens, greedy}, prompt {template, stop},
    n_questions, pct_truthful, pct_informative, pct_truthful_informative (P(yes) > 0.5 of the
    generated answers) with *_ci (95 % bootstrap over questions), judge {name, label, fingerprint,
    format, rubric, ask, yes / no ids, cached, scored}, agreement (truthfulqa.judge.agreement of the
    reference answers), model_id, model_label, model_fingerprint, seconds {generate, judge},
    questions: [{row, question, answer, n_new_tokens, stop, p_truthful, p_informative,
                 examples {row, order}}],
    references: [{row, answer, label, p_truthful}]
"""
from __future__ import annotations

import inspect
import logging
import time
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from evaluation.cells import write_json, write_record

from toolkit.disk import atomic_write
from evaluation.multiple_choice import question_ci
from extract.models import load_model
from extract.scorer import Checkpoint, partial_path, score
from extract.truthfulqa_pack import load_questions
from truthfulqa.common import machine, result_path, select_questions
from truthfulqa.judge import (ASK, DIMENSIONS, RUBRIC, agreement, cache_key, examples, judge_ids, judge_text,
                              read_cache)
from truthfulqa.likelihood import _SLOT, context_text
from truthfulqa.schema import judge_config
from truthfulqa.verify import NextTokenMass, encode, p_yes, yes_no_ids

log = logging.getLogger(__name__)


def stop_ids(tokenizer, vocab_size: int) -> tuple[np.ndarray, dict]:
    """bool [vocab_size] (the LM head's rows): the ids that end an answer (a newline in their text, end of
    sequence, the chat turn's end token), and a record of them."""
    newline = np.array(["\n" in tokenizer.decode([i]) if i < len(tokenizer) else False for i in range(vocab_size)])
    ends = {tokenizer.eos_token_id} - {None}
    template = getattr(tokenizer, "chat_template", None)
    if template:
        full = tokenizer.apply_chat_template([{"role": "user", "content": "x"}, {"role": "assistant", "content": _SLOT}],
                                             tokenize=False)
        after = tokenizer.encode(full[full.index(_SLOT) + len(_SLOT):], add_special_tokens=False)
        if after and after[0] in tokenizer.all_special_ids:
            ends.add(after[0])
    stop = newline.copy()
    stop[sorted(ends)] = True
    return stop, {"newline_ids": int(newline.sum()), "end_ids": sorted(int(i) for i in ends),
                  "end_tokens": [tokenizer.decode([i]) for i in sorted(ends)]}


class Generator:
    """The reduction of extract.scorer.score for generation: a batch of prompts (int ids) -> float64
    [B, max_new_tokens], the new token ids (the stop token included), -1 after it. Prompts are left-padded
    and run with the model's key/value cache; greedy when temperature == 0, else sampled (temperature,
    top_p) from a generator seeded by (seed, the batch's first row), so a batch's output does not depend
    on what ran before it."""
    dtype, keep = np.float64, 1

    def __init__(self, loaded, stop: np.ndarray, max_new_tokens: int, temperature: float, top_p: float, seed: int):
        self.model, self.device = loaded.model, loaded.device
        self.pad = loaded.tokenizer.pad_token_id if loaded.tokenizer.pad_token_id is not None else 0
        self.stop = torch.from_numpy(stop).to(self.device)
        self.shape, self.temperature, self.top_p, self.seed = (max_new_tokens,), temperature, top_p, seed
        params = inspect.signature(self.model.forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"

    @torch.inference_mode()
    def __call__(self, forward, seqs: list[np.ndarray], index: np.ndarray) -> np.ndarray:
        b, width = len(seqs), max(len(x) for x in seqs)
        ids = torch.full((b, width), self.pad, dtype=torch.long)
        mask = torch.zeros((b, width), dtype=torch.long)
        for row, x in enumerate(seqs):
            ids[row, width - len(x):] = torch.from_numpy(np.asarray(x))
            mask[row, width - len(x):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        position = (mask.cumsum(1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=position, use_cache=True, logits_to_keep=1)
        gen = torch.Generator(device=self.device).manual_seed(self.seed * 1_000_003 + int(index[0]))
        result = np.full((b, self.shape[0]), -1.0)
        done = torch.zeros(b, dtype=torch.bool, device=self.device)
        for t in range(self.shape[0]):
            nxt = self._pick(out.logits[:, -1].float(), gen)                  # [B]
            live = ~done
            result[live.cpu().numpy(), t] = nxt[live].cpu().numpy()
            done |= self.stop[nxt]
            if bool(done.all()) or t + 1 == self.shape[0]:
                break
            mask = torch.cat([mask, torch.ones((b, 1), dtype=torch.long, device=self.device)], 1)
            position = position[:, -1:] + 1
            out = self.model(input_ids=nxt[:, None], attention_mask=mask, position_ids=position, use_cache=True,
                             **{self.cache_arg: getattr(out, self.cache_arg)})
        return result

    def _pick(self, logits: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """int [B]: argmax (greedy) or a sample of softmax(logits / T) restricted to the top_p nucleus."""
        if self.temperature == 0:
            return logits.argmax(-1)
        probs = torch.softmax(logits / self.temperature, -1)
        sorted_p, order = probs.sort(-1, descending=True)
        outside = sorted_p.cumsum(-1) - sorted_p >= self.top_p          # mass before it already reaches top_p
        sorted_p[outside] = 0.0
        pick = torch.multinomial(sorted_p / sorted_p.sum(-1, keepdim=True), 1, generator=gen)
        return order.gather(1, pick)[:, 0]


def reference_answers(q, per_label: int) -> list[tuple[str, int]]:
    """(answer, label) of the dataset answers judged for the agreement check: every correct (1) and
    incorrect (0) answer (per_label = 0), or the first `per_label` of each, CSV order."""
    n = per_label or None
    return [(a, 1) for a in q.correct[:n]] + [(a, 0) for a in q.incorrect[:n]]


def answer_text(tokenizer, new_ids: np.ndarray, stop: np.ndarray, max_new_tokens: int) -> tuple[str, int, str]:
    """(answer, number of new tokens, why it stopped: newline | end | max_new_tokens) of one row."""
    ids = [int(i) for i in new_ids if i >= 0]
    if ids and stop[ids[-1]]:
        why = "newline" if "\n" in tokenizer.decode([ids[-1]]) else "end"
    else:
        why = "max_new_tokens"
    text = tokenizer.decode(ids, skip_special_tokens=True)
    return text.split("\n", 1)[0].strip(), len(ids), why


def run_generate(cfg: DictConfig, on_batch=None) -> Path:
    """mode=generate: generate (or resume), judge (cache first), write the result JSON, print the headline."""
    questions = select_questions(cfg)
    every = load_questions(cfg.get("data_path"))
    final = result_path(cfg)
    loaded = load_model(cfg.model)
    judge_name = cfg.judge or cfg.model.name
    judge = loaded if cfg.judge in (None, cfg.model.name) else load_model(judge_config(cfg.judge))
    gen = cfg.generate
    started = time.perf_counter()
    fmt, tok = cfg.format, loaded.tokenizer
    prompts = [encode(tok, fmt, context_text(fmt, q.question, tok, loaded.system_prompt)) for q in questions]
    stop, stop_record = stop_ids(tok, loaded.model.get_output_embeddings().weight.shape[0])
    checkpoint = Checkpoint(partial_path(final), {"mode": "generate", "format": fmt, **OmegaConf.to_container(gen),
                                                  "stop": stop_record}, 1, atomic_write)
    scored = score(loaded, prompts, Generator(loaded, stop, gen.max_new_tokens, gen.temperature, gen.top_p, gen.seed),
                   cfg.batch_size, longest_first=True, prefix_cache=False, checkpoint=checkpoint,
                   desc=f"generate {fmt}", on_batch=on_batch)
    answers = [answer_text(tok, row, stop, gen.max_new_tokens) for row in scored.results]
    generate_seconds = time.perf_counter() - started

    started = time.perf_counter()
    judge_fmt = "chat" if judge.use_chat_template else "plain"
    yes_no = yes_no_ids(judge.tokenizer)
    items = []       # (kind, question position, dimension, answer, label)
    for i, (q, (answer, _, _)) in enumerate(zip(questions, answers)):
        items += [("generated", i, d, answer, None) for d in DIMENSIONS]
        items += [("reference", i, "truthful", a, y) for a, y in reference_answers(q, cfg.judge_references)]
    p, judge_stats = judge_all(judge, judge_fmt, yes_no, items, questions, every, cfg, final,
                               Path(cfg.results_dir) / judge_name)
    judge_seconds = time.perf_counter() - started

    p_gen = {(i, d): p[k] for k, (kind, i, d, _, _) in enumerate(items) if kind == "generated"}
    truthful = np.array([p_gen[i, "truthful"] > 0.5 for i in range(len(questions))], dtype=np.float64)
    informative = np.array([p_gen[i, "informative"] > 0.5 for i in range(len(questions))], dtype=np.float64)
    refs = [(items[k], p[k]) for k in range(len(items)) if items[k][0] == "reference"]
    result = {
        "mode": "generate", "format": fmt, "decoding": {**OmegaConf.to_container(gen), "greedy": gen.temperature == 0},
        "prompt": {"template": context_text(fmt, "{question}", tok, loaded.system_prompt), "stop": stop_record},
        "n_questions": len(questions), "model_id": loaded.model_id, "model_label": loaded.label,
        "model_fingerprint": loaded.fingerprint, "machine": machine(loaded),
        "resumed_after_questions": scored.resumed_after,
        "seconds": {"generate": generate_seconds, "judge": judge_seconds},
        "judge": judge_record(judge, judge_name, judge_fmt, yes_no, questions, every),
        "agreement": agreement([y for (_, _, _, _, y), _ in refs], [v for _, v in refs]),
    }
    for name, hits in (("truthful", truthful), ("informative", informative),
                       ("truthful_informative", truthful * informative)):
        result[f"pct_{name}"] = float(100 * hits.mean())
        result[f"pct_{name}_ci"] = [100 * v for v in question_ci(hits, cfg.n_boot, cfg.seed)]
    result["judge"].update(judge_stats)
    result["questions"] = [
        {"row": q.row, "question": q.question, "answer": a, "n_new_tokens": n, "stop": why,
         "p_truthful": p_gen[i, "truthful"], "p_informative": p_gen[i, "informative"],
         "examples": dict(zip(("row", "order"), _example_record(every, q)))}
        for i, (q, (a, n, why)) in enumerate(zip(questions, answers))]
    result["references"] = [{"row": questions[i].row, "answer": a, "label": y, "p_truthful": v}
                            for (_, i, _, a, y), v in refs]
    write_record(final, result, OmegaConf.to_container(cfg, resolve=True), indent=1)
    partial_path(final).unlink(missing_ok=True)
    ag = result["agreement"]
    kappa = "undefined" if ag["kappa"] is None else f"{ag['kappa']:.3f}"
    print(f"TruthfulQA generate {fmt} ({loaded.label}, {len(questions)} questions, judge {judge.label}): "
          f"truthful {result['pct_truthful']:.1f} %, informative {result['pct_informative']:.1f} %, both "
          f"{result['pct_truthful_informative']:.1f} %; judge vs dataset labels: accuracy {ag['accuracy']:.3f}, "
          f"kappa {kappa} (n={ag['n']})  -> {final}")
    return final


def _example_record(every, q) -> tuple[int, list[int]]:
    source, order = examples(every, q.row)
    return source.row, order


def judge_all(judge, fmt: str, yes_no: dict, items: list, questions, every, cfg: DictConfig, final: Path,
              judge_dir: Path) -> tuple[np.ndarray, dict]:
    """float [len(items)]: the judge's P(yes) of each (kind, question position, dimension, answer, label),
    from the judge cache where present, the rest scored (extract.scorer, one run per dimension so its
    rubric is a shared prefix, checkpointed beside `final`) and added to the cache; and
    {prompts, scored_now, cache}."""
    cache_path = judge_dir / "truthfulqa" / "judge-cache.json"
    cache = read_cache(cache_path)
    keys, ids = [], []
    for _, i, d, answer, _ in tqdm(items, desc="judge prompts", unit="prompt", leave=False):
        source, order = examples(every, questions[i].row)
        x = judge_ids(judge, fmt, d, questions[i].question, answer, source, order)
        ids.append(x)
        keys.append(cache_key(judge, yes_no, x))
    todo = {}
    for k, x, (_, _, d, _, _) in zip(keys, ids, items):
        if k not in cache:
            todo.setdefault(d, {}).setdefault(k, x)
    for d, prompts in todo.items():
        where = final.with_name(f"{final.stem}-judge-{d}.json")
        checkpoint = Checkpoint(partial_path(where), {"mode": "judge", "dimension": d, "format": fmt,
                                                      "yes_ids": yes_no["yes"], "no_ids": yes_no["no"]},
                                cfg.save_every, atomic_write)
        scored = score(judge, list(prompts.values()), NextTokenMass(judge.model, [yes_no["yes"], yes_no["no"]]),
                       cfg.batch_size, longest_first=True, prefix_cache=cfg.prefix_cache, checkpoint=checkpoint,
                       desc=f"judge {d}")
        cache.update(zip(prompts, p_yes(scored.results).tolist()))
        write_json(cache_path, {"judge": judge.label, "model_id": judge.model_id, "fingerprint": judge.fingerprint,
                                "p_yes": cache})
        partial_path(where).unlink(missing_ok=True)
    stats = {"prompts": len(items), "scored_now": sum(len(v) for v in todo.values()), "cache": str(cache_path)}
    return np.array([cache[k] for k in keys]), stats


def judge_record(judge, name: str, fmt: str, yes_no: dict, questions, every) -> dict:
    """What the result records of the judge: which model, its prompt (rubrics, one rendered example)."""
    q = questions[0]
    source, order = examples(every, q.row)
    return {"name": name, "label": judge.label, "model_id": judge.model_id, "fingerprint": judge.fingerprint,
            "format": fmt, "rubric": RUBRIC, "ask": ASK, "yes_ids": yes_no["yes"], "no_ids": yes_no["no"],
            "yes_tokens": yes_no["tokens"]["yes"], "no_tokens": yes_no["tokens"]["no"],
            "examples_rule": "best answer (truthful, informative), first incorrect answer (untruthful, informative) "
                             "and \"I have no comment.\" (truthful, uninformative) of the next question in the CSV, "
                             "in an order drawn from numpy default_rng(row)",
            "example_prompt": judge_text("truthful", q.question, "{answer}", source, order, fmt, judge.tokenizer,
                                         judge.system_prompt)}
