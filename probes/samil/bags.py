"""Bags of instances in the padding-free layout, and the tensor helpers the sAwMIL code shares.

* ``X``          float ``[T, d]``  all tokens of all bags, concatenated;
* ``offsets``    int64 ``[N + 1]`` bag ``i`` owns rows ``offsets[i]:offsets[i+1]``
  (``offsets[0] == 0``, ``offsets[-1] == T``);
* ``candidates`` bool ``[T]``      instances that may be relabelled positive in stage 2.

numpy arrays and torch tensors are both accepted.
"""
from __future__ import annotations

import numpy as np
import torch

CHUNK_ROWS = 16384   # row block for matrix products over many rows (bounds temporaries)


def as_tensor(a, dtype=None, device=None) -> torch.Tensor:
    if isinstance(a, torch.Tensor):
        t = a
    else:
        t = torch.as_tensor(np.asarray(a))
    if dtype is not None or device is not None:
        t = t.to(device=device if device is not None else t.device,
                 dtype=dtype if dtype is not None else t.dtype)
    return t


def check_offsets(offsets: torch.Tensor, T: int) -> torch.Tensor:
    offsets = offsets.to(torch.int64).reshape(-1)
    if offsets.numel() < 1 or int(offsets[0]) != 0 or int(offsets[-1]) != T:
        raise ValueError(f"offsets must start at 0 and end at T={T}; got "
                         f"{offsets[:1].tolist()}..{offsets[-1:].tolist()}")
    if bool((offsets[1:] < offsets[:-1]).any()):
        raise ValueError("offsets must be non-decreasing")
    return offsets


def bag_index(offsets: torch.Tensor) -> torch.Tensor:
    """``[T]`` index of the bag owning each row (``offsets``: ``[N+1]``)."""
    lengths = offsets[1:] - offsets[:-1]
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=offsets.device), lengths)


def segment_max(values: torch.Tensor, offsets: torch.Tensor, empty: float = float("-inf")) -> torch.Tensor:
    """Per-bag maximum of ``values`` ``[T]`` -> ``[N]`` (no Python loop over bags).

    Empty bags get ``empty``.
    """
    offsets = offsets.to(device=values.device, dtype=torch.int64)
    n = offsets.numel() - 1
    idx = bag_index(offsets)
    out = torch.full((n,), float("-inf"), dtype=values.dtype, device=values.device)
    out = out.scatter_reduce(0, idx, values, reduce="amax", include_self=True)
    if empty != float("-inf"):
        lengths = offsets[1:] - offsets[:-1]
        out = torch.where(lengths > 0, out, torch.full_like(out, empty))
    return out


def last_k_candidates(offsets, k: int = 2) -> torch.Tensor:
    """Boolean ``[T]`` mask of the last ``k`` instances of every bag."""
    offsets = as_tensor(offsets).to(torch.int64)
    T = int(offsets[-1])
    idx = bag_index(offsets)
    end = offsets[1:][idx]                       # exclusive end of the owning bag
    pos_from_end = end - torch.arange(T, device=offsets.device)  # 1 == last token
    return pos_from_end <= int(k)


def matvec(X: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``X @ w`` in float64, chunked when ``X`` is not float64 (bounded temporaries)."""
    if X.dtype == torch.float64:
        return X @ w
    out = torch.empty(X.shape[0], dtype=torch.float64, device=X.device)
    for s in range(0, X.shape[0], CHUNK_ROWS):
        out[s:s + CHUNK_ROWS] = X[s:s + CHUNK_ROWS].to(torch.float64) @ w
    return out
