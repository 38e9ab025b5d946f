"""Steering: a vector added to the residual stream at one layer and chosen positions while the batched scorer
(extract.scorer, extract.padded_forward) runs, and the two readouts of what the model then says.

Layer k is the store's layer k, the tensor a probe at layer k reads: k = 0 the embeddings as block 0 receives
them, k >= 1 the output of block k - 1. Positions index the whole sequence; the scorer's shared prefix, run
once without steering, must end before a sequence's first steered position (each readout's `keep`).

Readouts (each the `reduce` of extract.scorer.score):
  SteeredOptions     the zero-shot prompt -> float32 [B, 7] option probabilities at its last token
                     (zero_shot.scoring.PromptScorer);
  SteeredCompletion  a context + completion -> float64 [B] the completion's summed log-probability
                     (truthfulqa.likelihood.LoglikScorer).
"""
from __future__ import annotations

import numpy as np
import torch

from extract.models import decoder_layers
from truthfulqa.likelihood import LoglikScorer
from zero_shot.scoring import PromptScorer


class Steering:
    """Context manager: while `rows` is set, delta [d] is added to layer k's hidden state [B, W, d] of the running
    batch at (rows, positions) (int tensors [n], positions in the batch's tail coordinates)."""

    def __init__(self, model, layer: int):
        self.blocks, self.layer = decoder_layers(model), int(layer)
        self.rows: tuple[torch.Tensor, torch.Tensor] | None = None
        self.delta: torch.Tensor | None = None
        self._handle = None

    def _add(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.rows is None:
            return hidden
        rows, positions = self.rows
        hidden = hidden.clone()
        hidden[rows.to(hidden.device), positions.to(hidden.device)] += self.delta.to(hidden.device, hidden.dtype)
        return hidden

    def _pre_hook(self, module, args, kwargs):
        if args:
            return (self._add(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": self._add(kwargs["hidden_states"])}

    def _hook(self, module, args, output):
        return (self._add(output[0]), *output[1:]) if isinstance(output, tuple) else self._add(output)

    def __enter__(self) -> "Steering":
        if self.layer == 0:
            self._handle = self.blocks[0].register_forward_pre_hook(self._pre_hook, with_kwargs=True)
        else:
            self._handle = self.blocks[self.layer - 1].register_forward_hook(self._hook)
        return self

    def __exit__(self, *exc):
        self._handle.remove()
        self.rows = None

    def run(self, reduce, forward, seqs: list[np.ndarray], index: np.ndarray, positions: list[np.ndarray],
            delta: torch.Tensor):
        """reduce(forward, seqs, index) with `delta` added at each sequence's `positions` (whole-sequence indices,
        all after the forward's prefix)."""
        p = forward.prefix_len
        at = [np.asarray(positions[i], dtype=np.int64) - p for i in index]
        if any(len(a) and a.min() < 0 for a in at):
            raise ValueError("a steered position lies in the shared prefix: raise the readout's keep")
        self.rows = (torch.from_numpy(np.repeat(np.arange(len(at)), [len(a) for a in at])),
                     torch.from_numpy(np.concatenate(at)))
        self.delta = delta
        try:
            return reduce(forward, seqs, index)
        finally:
            self.rows = None


def prefix_keep(seqs: list[np.ndarray], positions: list[np.ndarray], keep) -> np.ndarray:
    """int [N]: tokens each sequence keeps out of the shared prefix: its readout's own `keep` and at least
    every token from its first steered position on."""
    first = np.array([len(x) - int(np.min(p)) for x, p in zip(seqs, positions)], dtype=np.int64)
    return np.maximum(np.broadcast_to(np.asarray(keep, dtype=np.int64), first.shape), first)


class SteeredOptions:
    """extract.scorer reduce: the zero-shot prompts' option probabilities float32 [B, 7] (PromptScorer) with
    `delta` added at `positions` of each prompt (no steering at all where delta is None: exactly PromptScorer)."""

    def __init__(self, prompt: PromptScorer, steering: Steering, seqs, positions, delta: torch.Tensor | None):
        self.prompt, self.steering, self.positions, self.delta = prompt, steering, positions, delta
        self.shape, self.dtype = prompt.shape, prompt.dtype
        self.keep = prompt.keep if delta is None else prefix_keep(seqs, positions, prompt.keep)

    def __call__(self, forward, seqs, index):
        if self.delta is None:
            return self.prompt(forward, seqs, index)
        return self.steering.run(self.prompt, forward, seqs, index, self.positions, self.delta)


class SteeredCompletion:
    """extract.scorer reduce: float64 [B] summed log-probability of each sequence's last n_cont ids
    (LoglikScorer) with `delta` added at `positions` (in the context; none where delta is None)."""
    shape, dtype = (), np.float64

    def __init__(self, n_cont: list[int], steering: Steering, seqs, positions, delta: torch.Tensor | None):
        self.loglik, self.steering, self.positions, self.delta = LoglikScorer(n_cont), steering, positions, delta
        self.keep = self.loglik.keep if delta is None else prefix_keep(seqs, positions, self.loglik.keep)

    def __call__(self, forward, seqs, index):
        if self.delta is None:
            return self.loglik(forward, seqs, index)
        return self.steering.run(self.loglik, forward, seqs, index, self.positions, self.delta)
