"""The controls that could explain a probe's signal away, as features any statement-vector probe is fitted on
(`python -m train_probe features=text | surprisal`) and as a null for any probe (`shuffle_labels=true`).

features=text        the statement's text alone, no model: word 1-2-grams and character 2-4-grams (within word
                     boundaries), each hashed into 1024 columns (sklearn's HashingVectorizer: no vocabulary to fit,
                     so nothing is learnt from held-out rows), tf = log(1 + count), idf = log((1 + n) / (1 + df)) + 1
                     from the n TRAINING statements only, each row L2-normalised: float32 [N, 2048]. A probe on it
                     is "TF-IDF + logistic regression" with probe=linear (C by grouped CV, as for activations).
features=surprisal   the model's surprisal of the statement: the mean and the max negative log-likelihood (nats)
                     of the statement's tokens, the statement encoded alone after the tokenizer's BOS (no chat
                     template), float32 [N, 2]; a made-up name is a rare token sequence. Computed once per model
                     and datapack with the batched, resumable scorer (extract.scorer) into
                     <results_dir>/<model>/<datapack>/surprisal/surprisal.npy (+ .json: model, statements).
Both read the statements of the store <store_dir>/<model>/<datapack>.h5 where it exists (so their split and test
rows are the probes'), else the datapack's own (no store needed).
shuffle_labels=true  the training statements' labels permuted (seeded by `seed`, so seeds 0..k-1 are k
                     permutations) before the heads and their score map are fitted; calibration and test keep
                     the true labels: the null floor of a probe at its layer (|MCC| near 0 when it learns nothing).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch

from evaluation.cells import CellError

from toolkit.disk import atomic_write
from extract.scorer import Checkpoint, last_ids_logprobs, partial_path, score
from probes.features import Features

FEATURES = ("activations", "text", "surprisal")
HASHED_COLUMNS = 1024            # per analyzer (word, character)
SURPRISAL_COLUMNS = ("mean_nll", "max_nll")


def text_features(statements: list[str], train: np.ndarray) -> Features:
    """float32 [N, 2 * HASHED_COLUMNS] TF-IDF of hashed word and character n-grams (module docstring), idf from
    the rows `train` (int positions) only."""
    from sklearn.feature_extraction.text import HashingVectorizer
    from scipy import sparse

    counts = sparse.hstack([
        HashingVectorizer(analyzer=analyzer, ngram_range=ngrams, n_features=HASHED_COLUMNS, alternate_sign=False,
                          norm=None, lowercase=True).transform(statements)
        for analyzer, ngrams in (("word", (1, 2)), ("char_wb", (2, 4)))]).tocsr().astype(np.float64)
    df = np.asarray((counts[np.asarray(train)] > 0).sum(0)).ravel()
    idf = np.log((1.0 + len(train)) / (1.0 + df)) + 1.0
    counts.data = np.log1p(counts.data)
    weighted = counts.multiply(idf[None, :]).tocsr()
    norms = np.sqrt(np.asarray(weighted.multiply(weighted).sum(1)).ravel())
    dense = weighted.toarray() / np.maximum(norms, 1e-12)[:, None]
    return Features(torch.as_tensor(dense.astype(np.float32)))


class SurprisalScorer:
    """The reduction of extract.scorer.score: a batch of sequences ([BOS] + statement ids) -> float64 [B, 2], the
    mean and max negative log-likelihood of the statement ids (every id after the BOS)."""
    shape, dtype, keep = (2,), np.float64, None

    def __init__(self, n_statement: list[int]):
        self.n_statement = np.asarray(n_statement, dtype=np.int64)
        self.keep = self.n_statement + 1

    @torch.inference_mode()
    def __call__(self, forward, seqs: list[np.ndarray], index: np.ndarray) -> np.ndarray:
        out = np.empty((len(seqs), 2), dtype=np.float64)
        for row, logp in enumerate(last_ids_logprobs(forward, seqs, self.n_statement[index].tolist())):
            nll = -logp.double()
            out[row] = (float(nll.mean()), float(nll.max()))
        return out


def surprisal_sequences(tokenizer, statements: list[str]) -> list[np.ndarray]:
    """int64 ids per statement: the tokenizer's BOS (else its EOS) then the statement alone, no special tokens."""
    start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    if start is None:
        raise CellError("features=surprisal: the tokenizer has neither a BOS nor an EOS token to start a statement")
    seqs = []
    for i, s in enumerate(statements):
        ids = tokenizer(s, add_special_tokens=False)["input_ids"]
        if not ids:
            raise CellError(f"features=surprisal: statement {i} ({s!r}) has no tokens")
        seqs.append(np.asarray([start, *ids], dtype=np.int64))
    return seqs


def surprisal_features(model_cfg, statements: list[str], folder: Path, batch_size: int = 32,
                       overwrite: bool = False) -> Features:
    """float32 [N, 2] (mean, max NLL) of `statements` under the model of `model_cfg`, read from
    <folder>/surprisal.npy when it was computed by the same model on the same statements, else computed
    (resumable: a stopped run continues from its checkpoint) and saved there."""
    from extract.models import load_model

    folder = Path(folder)
    path, meta_path = folder / "surprisal.npy", folder / "surprisal.json"
    digest = hashlib.sha256("\n".join(statements).encode()).hexdigest()[:16]
    if not overwrite and path.exists() and meta_path.exists():
        meta = json.loads(meta_path.read_text())
        if meta.get("statements_sha256") == digest and meta.get("model") == model_cfg.get("name"):
            return Features(torch.as_tensor(np.load(path).astype(np.float32)))
    loaded = load_model(model_cfg)
    seqs = surprisal_sequences(loaded.tokenizer, statements)
    folder.mkdir(parents=True, exist_ok=True)
    checkpoint = Checkpoint(partial_path(path), {"kind": "surprisal", "statements_sha256": digest}, save_every=20,
                            write=atomic_write, resume=not overwrite)
    scored = score(loaded, seqs, SurprisalScorer([len(x) - 1 for x in seqs]), batch_size, longest_first=True,
                   checkpoint=checkpoint, desc="surprisal")
    values = scored.results.astype(np.float32)
    atomic_write(path, lambda f: np.save(f, values))
    atomic_write(meta_path, lambda f: f.write(json.dumps({
        "model": model_cfg.get("name"), "model_id": loaded.model_id, "model_fingerprint": loaded.fingerprint,
        "dtype": loaded.compute_dtype, "statements_sha256": digest, "columns": list(SURPRISAL_COLUMNS),
        "encoding": "BOS + statement, no chat template"}, indent=1).encode()))
    partial_path(path).unlink(missing_ok=True)
    return Features(torch.as_tensor(values))


def shuffled_positions(train: np.ndarray, seed: int) -> np.ndarray:
    """int [len(train)]: a permutation of the training positions `train` (seeded), so that label[train] takes
    label[shuffled] -- the same for every task sharing those statements."""
    return np.random.default_rng([int(seed), 0x5EED]).permutation(np.asarray(train))
