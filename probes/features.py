"""What a probe is fitted on: one layer's features of N statements, read from a store.

`layer_features(store, layer, representation, tokens)` reads one layer once and returns
`Features`: one vector per statement (representation last / mean) or the bag of its tokens
(representation bags, for multiple-instance probes).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from toolkit.errors import ToolkitError
from extract.store import KIND_CONTEXT, KIND_SPECIAL, KIND_STATEMENT, KIND_TEMPLATE, ActivationStore

REPRESENTATIONS = ("last", "mean", "bags")
TOKEN_KINDS = {"statement": (KIND_STATEMENT,), "all": (KIND_SPECIAL, KIND_TEMPLATE, KIND_STATEMENT, KIND_CONTEXT)}


@dataclass
class Features:
    """One layer's representation of N statements.

    X        float32 [N, d] one vector per statement (representation last / mean), or
             float32 [T, d] token vectors when `offsets` is given (representation bags)
    offsets  int64 [N+1] or None: statement i owns rows offsets[i]:offsets[i+1] of X
    groups   int64 [N] or None: group of each statement (statements sharing an entity share a
             group), for grouped cross-validation inside `fit`
    negation bool [N] or None: the statement is negated (its polarity; probes.ttpd, probes.ccs); None: unknown
    pair     int64 [N] or None: statements sharing (object_1, object_2) share a key (`pair_keys`), -1 for a
             statement with no partner; a statement and its negation form a contrast pair (probes.ccs)
    memo     dict or None: shared by these features' subsets when made by `sharing`, where `derived`
             keeps what is computed from a set of statements (e.g. sAwMIL's distinct tokens of a CV fold,
             the same for every head fitted on it); `rows` int64 [N]: the statements' places in the
             features that made the memo
    """
    X: torch.Tensor
    offsets: torch.Tensor | None = None
    groups: np.ndarray | None = None
    negation: np.ndarray | None = None
    pair: np.ndarray | None = None
    memo: dict | None = field(default=None, repr=False, compare=False)
    rows: np.ndarray | None = field(default=None, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.X) if self.offsets is None else len(self.offsets) - 1

    @property
    def is_bags(self) -> bool:
        return self.offsets is not None

    def subset(self, index: np.ndarray) -> "Features":
        """The statements `index` (int [M]), in that order (sharing this one's memo)."""
        index = np.asarray(index, dtype=np.int64)
        groups = None if self.groups is None else self.groups[index]
        shared = dict(memo=self.memo, rows=None if self.rows is None else self.rows[index],
                      **{name: None if getattr(self, name) is None else getattr(self, name)[index]
                         for name in ("negation", "pair")})
        if self.offsets is None:
            return Features(self.X[torch.from_numpy(index)], None, groups, **shared)
        starts, ends = self.offsets[:-1][index], self.offsets[1:][index]
        lengths = ends - starts
        rows = torch.repeat_interleave(starts - torch.cumsum(lengths, 0) + lengths, lengths) + torch.arange(int(lengths.sum()))
        offsets = torch.zeros(len(index) + 1, dtype=torch.long)
        offsets[1:] = torch.cumsum(lengths, 0)
        return Features(self.X[rows], offsets, groups, **shared)

    def sharing(self) -> "Features":
        """These features with a fresh memo that their subsets share (see `derived`)."""
        return Features(self.X, self.offsets, self.groups, self.negation, self.pair, memo={},
                        rows=np.arange(len(self), dtype=np.int64))

    def derived(self, name: str, compute):
        """``compute(self)``, kept in the shared memo under (name, these statements) where there is one
        (`sharing`): a second call on the same statements, through any subset, returns the first result.
        `name` must name everything besides the statements that the result depends on."""
        if self.memo is None:
            return compute(self)
        key = (name, self.rows.tobytes())
        if key not in self.memo:
            self.memo[key] = compute(self)
        return self.memo[key]

    def extend(self, other: "Features") -> "Features":
        """These N statements followed by `other`'s (same representation): rows 0..N-1 are these, N.. other's
        (groups, negation and pair each concatenated where both have them, else None)."""
        joined = [None if a is None or b is None else np.concatenate([a, b]) for a, b in
                  ((self.groups, other.groups), (self.negation, other.negation), (self.pair, other.pair))]
        offsets = None if self.offsets is None else torch.cat([self.offsets, other.offsets[1:] + self.offsets[-1]])
        return Features(torch.cat([self.X, other.X]), offsets, *joined)


def pair_keys(table) -> np.ndarray:
    """int64 [N]: one key per distinct (object_1, object_2) of a statement table (a statement and its negation
    about the same entities share it), -1 where object_1 is empty (no entities, e.g. TruthfulQA's answers are
    keyed by question alone and never negated)."""
    keys = table.groupby(["object_1", "object_2"], sort=False).ngroup().to_numpy(dtype=np.int64)
    return np.where(table["object_1"].astype(str).to_numpy() == "", -1, keys)


def layer_features(store: ActivationStore, layer: int, representation: str, tokens: str = "statement") -> Features:
    """Features of every statement of the store at one layer (one read of that layer).

    representation: last (last token of the chosen kinds) | mean | bags (all tokens of those kinds)
    tokens: statement (statement text only) | all (BOS and chat-template tokens too, as the reference)
    """
    if tokens not in TOKEN_KINDS:
        raise ToolkitError(f"tokens={tokens!r}: use one of {', '.join(TOKEN_KINDS)} (probe.tokens=...)")
    kinds = TOKEN_KINDS[tokens]
    if representation == "bags":
        X, offsets = store.bags(layer, kinds)
        features = Features(torch.from_numpy(X), torch.from_numpy(offsets))
    elif representation == "last":
        features = Features(torch.from_numpy(store.last_token(layer, kinds)))
    elif representation == "mean":
        features = Features(torch.from_numpy(store.mean(layer, kinds)))
    else:
        raise ToolkitError(f"unknown representation {representation!r}: use one of {', '.join(REPRESENTATIONS)}")
    if not bool(torch.isfinite(features.X).all()):
        raise ToolkitError(f"{store.path}: layer {layer} holds NaN or inf values: re-extract it (overwrite=true), "
                           "with dtype=float32 if it overflowed")
    return features


def statement_vectors(data: Features, representation: str) -> torch.Tensor:
    """float32 [N, d]: one vector per statement.

    Per-statement features (no offsets) are returned as they are: the caller loaded the layer in the
    representation the probe asked for. Bags are reduced here: "last" takes each bag's last token,
    "mean" averages its tokens (an empty bag gives zeros).
    """
    if representation not in ("last", "mean"):
        raise ValueError(f"representation must be 'last' or 'mean', got {representation!r}")
    X = data.X
    if not data.is_bags:
        return X.float()
    offsets = data.offsets.to(torch.long)
    lengths = offsets[1:] - offsets[:-1]
    if representation == "last":
        if bool((lengths == 0).any()):
            raise ValueError("an empty bag has no last token")
        return X[offsets[1:] - 1].float()
    rows = torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), lengths)
    out = torch.zeros(len(lengths), X.shape[1], dtype=torch.float32, device=X.device)
    out.index_add_(0, rows.to(X.device), X.float())
    return out / lengths.clamp(min=1).to(out)[:, None]
