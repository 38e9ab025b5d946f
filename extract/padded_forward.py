"""Forward passes over right-padded batches of token sequences that share a prefix.

The prefix (e.g. a system turn or a few-shot primer) is run once; its key/value cache is copied and
repeated for every batch, which then runs only each sequence's tail. Used by extract/scorer.py (the
behavioural methods' scorer); activations are captured by extract/capture.py.
"""
from __future__ import annotations

import copy
import inspect

import numpy as np
import torch

from extract.errors import ToolkitError


class PaddedForward:
    """`forward(tails)` -> logits [B, W, V] of prefix + tail for each tail (int ids [len_i]), W = the
    longest tail; row i's real positions are 0..len_i-1 (right padding, attention-masked)."""

    def __init__(self, model, pad_id: int, device: torch.device, prefix: np.ndarray | None = None):
        self.model, self.pad_id, self.device = model, pad_id, device
        self.prefix_len = 0 if prefix is None else len(prefix)
        self.cache = None
        if self.prefix_len:
            # transformers >= 5.2x calls the key/value cache `cache`, older versions `past_key_values`
            self.cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
            with torch.inference_mode():
                ids = torch.from_numpy(np.asarray(prefix))[None].to(device)
                out = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True)
            self.cache = getattr(out, self.cache_arg, None)
            if self.cache is None or not hasattr(self.cache, "batch_repeat_interleave"):
                raise ToolkitError(f"{type(model).__name__} returns no reusable key/value cache: set prefix_cache=false")

    @torch.inference_mode()
    def forward(self, tails: list[np.ndarray]) -> torch.Tensor:
        b, p = len(tails), self.prefix_len
        lengths = torch.tensor([len(t) for t in tails])
        width = int(lengths.max())
        ids = torch.full((b, width), self.pad_id, dtype=torch.long)
        for row, t in enumerate(tails):
            ids[row, : len(t)] = torch.from_numpy(np.asarray(t))
        mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
        kwargs = {"use_cache": False}
        if p:
            cache = copy.deepcopy(self.cache)
            cache.batch_repeat_interleave(b)
            mask = torch.cat([torch.ones(b, p, dtype=torch.long), mask], dim=1)
            kwargs = {"use_cache": True, self.cache_arg: cache}
        return self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device), **kwargs).logits
