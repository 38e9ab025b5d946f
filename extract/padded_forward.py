"""Forward passes over right-padded batches of token sequences that share a prefix.

The prefix (a chat template's system turn and user-turn opening, a few-shot primer) is run once;
its key/value cache is copied and repeated for every batch, which then runs only each sequence's
tail. The one shared-prefix mechanism of the toolkit: the behavioural methods' scorer
(extract/scorer.py) reads the logits, extraction (extract/capture.py) hooks the decoder blocks
during the same calls (`run`), the prefix's own pass included.
"""
from __future__ import annotations

import copy
import inspect

import numpy as np
import torch

from toolkit.errors import ToolkitError


def padded_batch(tails: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """ids int64 [B, W] right-padded with 0 (the caller's pad id is written by `PaddedForward`) and the
    mask bool [B, W] of real positions, W = the longest tail."""
    lengths = torch.tensor([len(t) for t in tails])
    width = int(lengths.max())
    ids = torch.zeros((len(tails), width), dtype=torch.long)
    for row, t in enumerate(tails):
        ids[row, : len(t)] = torch.from_numpy(np.asarray(t, dtype=np.int64))
    return ids, torch.arange(width)[None, :] < lengths[:, None]


class PaddedForward:
    """`forward(tails)` -> logits [B, W, V] of prefix + tail for each tail (int ids [len_i]), W = the
    longest tail; row i's real positions are 0..len_i-1 (right padding, attention-masked).

    `stop`: an exception type that forward hooks may raise to end a pass of `run` early (extraction
    stops after its last requested block); they must let the prefix's pass run to the end, so that
    its cache covers every block."""

    def __init__(self, model, pad_id: int, device: torch.device, prefix: np.ndarray | None = None,
                 stop: type[BaseException] | None = None):
        self.model, self.pad_id, self.device, self.stop = model, pad_id, device, stop
        self.prefix_len = 0 if prefix is None else len(prefix)
        self.cache = None
        if self.prefix_len:
            # transformers >= 5.2x calls the key/value cache `cache`, older versions `past_key_values`
            self.cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
            with torch.inference_mode():
                ids = torch.from_numpy(np.asarray(prefix, dtype=np.int64))[None].to(device)
                out = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True)
            self.cache = getattr(out, self.cache_arg, None)
            if self.cache is None or not hasattr(self.cache, "batch_repeat_interleave"):
                raise ToolkitError(f"{type(model).__name__} returns no reusable key/value cache: set prefix_cache=false")

    @torch.inference_mode()
    def run(self, tails: list[np.ndarray]):
        """One pass of prefix + tails: the model's output, or None when a hook raised `stop`."""
        b, p = len(tails), self.prefix_len
        ids, mask = padded_batch(tails)
        ids[~mask] = self.pad_id
        mask = mask.long()
        kwargs = {"use_cache": False}
        if p:
            cache = copy.deepcopy(self.cache)
            cache.batch_repeat_interleave(b)
            mask = torch.cat([torch.ones(b, p, dtype=torch.long), mask], dim=1)
            kwargs = {"use_cache": True, self.cache_arg: cache}
        try:
            return self.model(input_ids=ids.to(self.device, non_blocking=True),
                              attention_mask=mask.to(self.device, non_blocking=True), **kwargs)
        except self.stop or ():
            return None

    def forward(self, tails: list[np.ndarray]) -> torch.Tensor:
        return self.run(tails).logits
