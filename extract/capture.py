"""Capture: render statements to token ids, form length-sorted batches, and run one forward pass per
batch that returns every requested layer's hidden states of the real (non-padding) tokens.

Layer numbering (README "Store layout"): 0 = embedding output (the input of decoder block 1), k = 1..L = the
residual stream after decoder block k, before any final norm. Blocks after the last requested layer
are not run, nor is the final norm or the LM head.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
from torch import nn

from extract.models import ModelError, decoder_layers
from extract.padded_forward import PaddedForward
from extract.scorer import common_prefix_length
from extract.store import KIND_CONTEXT, KIND_SPECIAL, KIND_STATEMENT, KIND_TEMPLATE

_SLOT = "\ue000truthprobe-statement\ue001"  # stands for the statement while the template is rendered


def render(tokenizer, statement: str, use_chat_template: bool,
           system_prompt: str | None = None, context: str = "") -> tuple[np.ndarray, np.ndarray]:
    """Token ids int64 [n] and kinds int8 [n] of one statement's model input.

    The user's content is `context + statement` (context "" for none). With a chat template it is
    the user turn (no generation prompt, as in the reference code) and the template alone decides
    the special tokens (so BOS is never doubled); without one the tokenizer adds its usual special
    tokens. Kind: statement text where a token's character offsets overlap the statement's
    characters, special for the tokenizer's special ids, context text where they overlap the
    context's, chat-template text otherwise. Where the content sits in the rendered text is learnt
    by rendering the template around a placeholder (never by searching the statement's text, which
    may also occur in the template).
    """
    content = context + statement
    if use_chat_template:
        text, around = _chat(tokenizer, content, system_prompt), _around(tokenizer, system_prompt)
        start = len(around[0])
        if len(around) != 2 or text != around[0] + content + around[1]:
            raise ModelError("the chat template changes or repeats the user's text, so the statement's tokens "
                             "cannot be located: set model.chat_template=false")
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    else:
        text, start = content, 0
        enc = tokenizer(text, add_special_tokens=True, return_offsets_mapping=True)
    ids = np.asarray(enc["input_ids"], dtype=np.int64)
    spans = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
    special = np.isin(ids, tokenizer.all_special_ids)
    begin = start + len(context)  # the statement's first character
    in_statement = (spans[:, 0] < begin + len(statement)) & (spans[:, 1] > begin) & ~special
    in_context = (spans[:, 0] < begin) & (spans[:, 1] > start) & ~special & ~in_statement
    kinds = np.select([in_statement, special, in_context], [KIND_STATEMENT, KIND_SPECIAL, KIND_CONTEXT],
                      KIND_TEMPLATE)
    return ids, kinds.astype(np.int8)


def _chat(tokenizer, content: str, system_prompt: str | None) -> str:
    messages = [{"role": "user", "content": content}]
    if system_prompt is not None:
        messages.insert(0, {"role": "system", "content": system_prompt})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)


@lru_cache(maxsize=4)
def _around(tokenizer, system_prompt: str | None) -> list[str]:
    """The rendered template's text before and after the user's content."""
    return _chat(tokenizer, _SLOT, system_prompt).split(_SLOT)


@dataclass
class Inputs:
    """The rendered inputs of a run, split after the prefix they all share (P tokens, 0 for none)."""
    prefix_ids: np.ndarray      # int64 [P]
    prefix_kinds: np.ndarray    # int8 [P]
    ids: list[np.ndarray]       # per statement: int64 [n_i - P], its input after the prefix
    kinds: list[np.ndarray]     # per statement: int8 [n_i - P]

    p = property(lambda self: len(self.prefix_ids))
    n_rows = property(lambda self: self.p + sum(len(t) for t in self.ids))          # token rows stored
    n_tokens = property(lambda self: self.p * len(self.ids) + sum(len(t) for t in self.ids))  # tokens read


def split_prefix(ids: list[np.ndarray], kinds: list[np.ndarray], shared: bool = True) -> Inputs:
    """Whole inputs (ids int64 [n_i], kinds int8 [n_i] per statement) split after the longest prefix of
    ids and kinds they all share (`shared`; none for a single input), leaving each at least one token."""
    p = min(common_prefix_length(ids, 1), common_prefix_length(kinds, 1)) if shared and len(ids) > 1 else 0
    return Inputs(ids[0][:p], kinds[0][:p], [i[p:] for i in ids], [k[p:] for k in kinds])


def plan_windows(offsets: np.ndarray, window_tokens: int, start: int = 0) -> list[tuple[int, int]]:
    """Consecutive statement ranges [a, b), each at most `window_tokens` tokens (at least one
    statement), planned from statement 0 so that a resumed run forms the same windows (and hence
    the same batches and bit-identical values) as an uninterrupted one; ranges before `start` are
    dropped. A window is the unit written to the store and of resumption."""
    windows, a, n = [], 0, len(offsets) - 1
    while a < n:
        b = min(n, max(a + 1, int(np.searchsorted(offsets, offsets[a] + window_tokens, side="right")) - 1))
        if b > start:
            windows.append((max(a, start), b))
        a = b
    return windows


def plan_batches(lengths: np.ndarray, batch_tokens: int) -> list[np.ndarray]:
    """Split statement indices into batches sorted by length, each padded batch (size x longest)
    at most `batch_tokens` tokens (at least one statement)."""
    order = np.argsort(lengths, kind="stable")
    batches, current = [], []
    for i in order:
        if current and (len(current) + 1) * lengths[i] > batch_tokens:
            batches.append(np.asarray(current))
            current = []
        current.append(i)
    if current:
        batches.append(np.asarray(current))
    return batches


class _StopForward(Exception):
    """Raised by the hook of the last requested block: nothing after it is computed."""


@dataclass
class BatchOutput:
    """Hidden states of one batch: layers[k] is [n_real_tokens, d] in the batch's statement order."""
    layers: dict[int, torch.Tensor]
    ready: torch.cuda.Event | None  # device-to-host copies finished (CUDA only)

    def wait(self) -> dict[int, torch.Tensor]:
        if self.ready is not None:
            self.ready.synchronize()
        return self.layers


class LayerCapture:
    """Forward hooks that keep the real tokens of the requested layers of the running batch.

    Usage: `with LayerCapture(model, layers, out_dtype, prefix=ids) as cap: out = cap.run(tails)`.
    With a `prefix` (int ids [P], shared by every input) entering runs it once through
    extract.padded_forward.PaddedForward: `prefix_states[k]` is its layer k [P, d] (out_dtype, on the
    host), its key/value cache is extended by every batch, and `run` takes each input's tail (the
    ids after the prefix). On CUDA the gathered states are copied to pinned host memory on a side
    stream, so the copy of one batch overlaps the forward pass of the next; `BatchOutput.wait()`
    returns them.
    """

    def __init__(self, model: nn.Module, layers: list[int], out_dtype: torch.dtype, pad_id: int = 0,
                 prefix: np.ndarray | None = None):
        self.model, self.layers, self.out_dtype, self.pad_id = model, sorted(layers), out_dtype, pad_id
        self.prefix = None if prefix is None or len(prefix) == 0 else np.asarray(prefix, dtype=np.int64)
        self.blocks = decoder_layers(model)
        self.device = next(model.parameters()).device
        self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._handles, self._captured, self._index, self._stop = [], {}, None, True
        self.forward: PaddedForward | None = None
        self.prefix_states: dict[int, torch.Tensor] = {}

    def __enter__(self):
        if 0 in self.layers:
            self._handles.append(self.blocks[0].register_forward_pre_hook(self._pre_hook, with_kwargs=True))
        for k in self.layers:
            if k > 0:
                self._handles.append(self.blocks[k - 1].register_forward_hook(self._make_hook(k)))
        try:
            self._index, self._captured, self._stop = None, {}, False  # the prefix: every token, every block
            self.forward = PaddedForward(self.model, self.pad_id, self.device, self.prefix, stop=_StopForward)
            if self.prefix is not None:
                self.prefix_states = self._to_host(self._captured).wait()
        except BaseException:
            self.__exit__()
            raise
        finally:
            self._stop = True
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles = []

    def _keep(self, k: int, hidden: torch.Tensor) -> None:
        """hidden [B, W, d] -> its real tokens [n, d] (every token when no index is set)."""
        flat = hidden.reshape(-1, hidden.shape[-1])
        if self._index is not None:
            flat = flat.index_select(0, self._index.to(hidden.device))
        self._captured[k] = flat.to(self.out_dtype)
        if k == self.layers[-1] and self._stop:
            raise _StopForward

    def _pre_hook(self, module, args, kwargs):
        self._keep(0, args[0] if args else kwargs["hidden_states"])

    def _make_hook(self, k: int):
        def hook(module, args, output):
            self._keep(k, output[0] if isinstance(output, tuple) else output)
        return hook

    def run(self, tails: list[np.ndarray]) -> BatchOutput:
        """One forward pass over a right-padded batch of tails (whole inputs without a prefix) -> the
        real tokens of every requested layer, [sum of tail lengths, d] each."""
        lengths = torch.tensor([len(x) for x in tails])
        mask = torch.arange(int(lengths.max()))[None, :] < lengths[:, None]
        self._index = torch.nonzero(mask.reshape(-1)).squeeze(1).to(self.device, non_blocking=True)
        self._captured = {}
        self.forward.run(tails)
        return self._to_host(self._captured)

    def _to_host(self, captured: dict[int, torch.Tensor]) -> BatchOutput:
        if self.copy_stream is None:
            return BatchOutput(captured, None)
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        host = {}
        with torch.cuda.stream(self.copy_stream):
            for k, t in captured.items():
                host[k] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host[k].copy_(t, non_blocking=True)
                t.record_stream(self.copy_stream)
            ready = torch.cuda.Event()
            ready.record(self.copy_stream)
        return BatchOutput(host, ready)
