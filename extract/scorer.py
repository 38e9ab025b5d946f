"""One batched, resumable scorer of token-id sequences (zero-shot prompts, NCB stress prompts, TruthfulQA
choices): `score(loaded, seqs, reduce, batch_size)` -> one result row per sequence.

Batches are consecutive sequences (`longest_first`: longest first, ties in input order), right-padded
(extract.padded_forward); with `prefix_cache` the tokens every sequence starts with run once and their
key/value cache is reused by every batch. The caller's `reduce(forward, batch, index)` turns a batch
into its rows [B, *reduce.shape] (reduce.dtype); `reduce.keep` (int or int [N]) is how many final
tokens of each sequence the prefix must leave.

With a `Checkpoint`, every `save_every` batches and after the last one the rows done so far are
written (the caller's atomic writer: toolkit.disk.atomic_write; extract does not import
evaluation) to an npz: scores [N, *shape] in input order, n_done (rows of the batch order done),
batch_size and signature (JSON: the caller's part, the model's id, fingerprint and dtype, the sha256 of
the sequences and `keep`, the batch order and the prefix length). A run with the same signature
continues from it with its batch size, so its results are bit-identical to an uninterrupted run's.
A checkpoint of another signature is refused (`refuse`) or discarded with a warning; one that cannot
be read (garbage, truncated, other arrays or shapes) is discarded with one warning; either way its
rows are scored again, never mixed.
"""
from __future__ import annotations

import hashlib
import json
import logging
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Callable, NamedTuple

import numpy as np
import torch
from tqdm import tqdm

from toolkit.errors import ToolkitError
from extract.padded_forward import PaddedForward

log = logging.getLogger(__name__)


@dataclass
class Checkpoint:
    """Where `score` saves its progress and resumes from."""
    path: Path
    signature: dict                 # the caller's part of what makes the checkpoint valid (JSON values)
    save_every: int                 # batches between saves
    write: Callable[[Path, Callable[[IO[bytes]], None]], None]   # atomic writer: write(path, fill(file))
    resume: bool = True             # False (overwrite=true): the file is never read, only replaced
    refuse: type[Exception] | None = None   # raised for a checkpoint of another signature (else: redone)


class Scored(NamedTuple):
    results: np.ndarray             # [N, *reduce.shape], input order
    resumed_after: int              # rows read from the checkpoint
    batch_size: int                 # the batch size used (the checkpoint's when resumed)
    prefix_len: int                 # tokens run once for every sequence


def partial_path(final: Path) -> Path:
    """The checkpoint beside a result file: <stem>.partial.npz."""
    return final.with_name(final.stem + ".partial.npz")


def pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)


def common_prefix_length(seqs: list[np.ndarray], keep) -> int:
    """Tokens shared by the start of every sequence, leaving at least keep[i] (int or int [N]) of each."""
    keep = np.broadcast_to(keep, (len(seqs),))
    first = seqs[0]
    p = len(first) - int(keep[0])
    for x, k in zip(seqs[1:], keep[1:]):
        m = min(p, len(x) - int(k))
        differ = np.flatnonzero(first[:m] != x[:m])
        p = int(differ[0]) if differ.size else m
    return max(p, 0)


def check_context(seqs: list[np.ndarray], max_positions: int | None, desc: str) -> None:
    """Refuse (ToolkitError) sequences longer than the model's context (`max_positions`; None: no limit):
    scored past it, a model's positions wrap or extrapolate and its scores mean nothing."""
    lengths = np.array([len(x) for x in seqs])
    over = np.flatnonzero(lengths > max_positions) if max_positions else []
    if len(over):
        raise ToolkitError(f"{desc}: {len(over)} of {len(seqs)} sequences are longer than the model's "
                           f"{max_positions} positions (the first, #{over[0]}, has {lengths[over[0]]} tokens): "
                           "shorten the prompts (fewer examples, shorter contexts or answers) or use a model with a "
                           "longer context")


def score(loaded, seqs: list[np.ndarray], reduce, batch_size: int, *, longest_first: bool = False,
          prefix_cache: bool = True, checkpoint: Checkpoint | None = None, desc: str = "score",
          on_batch: Callable[[int], None] | None = None) -> Scored:
    """Score `seqs` (int ids) with `loaded` (extract.models.LoadedModel), resuming from `checkpoint`.

    on_batch(b): called after batch b (tests use it to simulate an interruption).
    """
    n = len(seqs)
    check_context(seqs, getattr(loaded, "max_positions", None), desc)
    keep = np.broadcast_to(np.asarray(reduce.keep, dtype=np.int64), (n,))
    p = common_prefix_length(seqs, keep) if prefix_cache and n > 1 else 0
    order = np.array(sorted(range(n), key=lambda i: (-len(seqs[i]), i)) if longest_first else range(n), dtype=np.int64)
    results = np.full((n, *reduce.shape), np.nan, dtype=reduce.dtype)
    log.info("%s: %d sequences of %d-%d tokens, %d shared prefix tokens run once", desc, n, min(map(len, seqs)),
             max(map(len, seqs)), p)
    done, size = 0, int(batch_size)
    if checkpoint is not None:
        signature = _signature(checkpoint, loaded, seqs, keep, longest_first, p)
        resumed = _resume(checkpoint, signature, order, results)
        if resumed is not None:
            done, old = resumed
            if old != size:
                log.info("resuming with the batch size of the interrupted run (%d, not %d)", old, size)
            size = old
            log.info("resuming %s after %d of %d rows", checkpoint.path.name, done, n)
    if done < n:
        forward = PaddedForward(loaded.model, pad_id(loaded.tokenizer), loaded.device, seqs[0][:p] if p else None)
        n_batches, first = -(-n // size), done // size
        for b in tqdm(range(first, n_batches), total=n_batches, initial=first, desc=desc, unit="batch"):
            index = order[b * size: (b + 1) * size]
            results[index] = reduce(forward, [seqs[i] for i in index], index)
            end = min(n, (b + 1) * size)
            if checkpoint is not None and ((b + 1 - first) % checkpoint.save_every == 0 or end == n):
                checkpoint.write(checkpoint.path, lambda f: np.savez(
                    f, scores=results, n_done=np.int64(end), batch_size=np.int64(size),
                    signature=np.str_(json.dumps(signature, sort_keys=True))))
            if on_batch is not None:
                on_batch(b)
    return Scored(results, done, size, p)


def last_ids_logprobs(forward: PaddedForward, seqs: list[np.ndarray], counts: list[int]) -> list[torch.Tensor]:
    """float32 [c_i] per sequence: the log-probability of each of sequence i's last counts[i] ids given the ids
    before it, from one forward of every seq[:-1] after `forward`'s shared prefix (which holds no scored id).
    The shared step of the reductions that read a continuation's probabilities (a `score` reduce calls it)."""
    p = forward.prefix_len
    logits = forward.forward([x[p:-1] for x in seqs])             # logits[j] predicts token p + j + 1
    out = []
    for row, (x, c) in enumerate(zip(seqs, counts)):
        end = len(x) - 1 - p
        logp = torch.log_softmax(logits[row, end - c: end].float(), dim=-1)
        out.append(logp.gather(1, torch.from_numpy(x[-c:]).to(logp.device)[:, None])[:, 0])
    return out


def _signature(checkpoint: Checkpoint, loaded, seqs, keep, longest_first: bool, prefix_len: int) -> dict:
    h = hashlib.sha256()
    for x, k in zip(seqs, keep):
        h.update(np.array([len(x), k], dtype=np.int64).tobytes())
        h.update(np.asarray(x, dtype=np.int64).tobytes())
    signature = {**checkpoint.signature, "model_id": loaded.model_id, "model_fingerprint": loaded.fingerprint,
                 "dtype": loaded.compute_dtype, "inputs_sha256": h.hexdigest()[:16], "n_rows": len(seqs),
                 "longest_first": longest_first, "prefix_len": prefix_len}
    return json.loads(json.dumps(signature, sort_keys=True))       # as it reads back from the file


def _resume(checkpoint: Checkpoint, signature: dict, order: np.ndarray, results: np.ndarray):
    """(n_done, batch_size) of a checkpoint made for `signature`, its done rows copied into `results`,
    or None when there is nothing to resume from."""
    path = checkpoint.path
    if not checkpoint.resume or not path.exists():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            old, scores = json.loads(str(z["signature"])), z["scores"]
            done, size = int(z["n_done"]), int(z["batch_size"])
        if not isinstance(old, dict) or scores.shape != results.shape or scores.dtype != results.dtype \
                or not 0 <= done <= len(results) or size < 1:
            raise ValueError(f"scores {scores.dtype} {scores.shape}, n_done {done}, batch_size {size}")
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as err:
        reason = " ".join(str(err).split())[:200]
        log.warning("%s is not a readable checkpoint (%s: %s): discarding it, its rows are scored again",
                    path, type(err).__name__, reason)
        return None
    if old != signature:
        differ = ", ".join(sorted(k for k in old.keys() | signature.keys() if old.get(k) != signature.get(k)))
        if checkpoint.refuse is not None:
            raise checkpoint.refuse(f"{path} was made with other settings ({differ}): set overwrite=true to "
                                    "start again")
        log.warning("%s was made with other settings (%s): starting again", path, differ)
        return None
    results[order[:done]] = scores[order[:done]]
    return done, size
