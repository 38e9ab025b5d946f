"""Bags of instances in the padding-free layout, and the tensor helpers the sAwMIL code shares.

* ``X``          float ``[T, d]``  all tokens of all bags, concatenated;
* ``offsets``    int64 ``[N + 1]`` bag ``i`` owns rows ``offsets[i]:offsets[i+1]``
  (``offsets[0] == 0``, ``offsets[-1] == T``);
* ``candidates`` bool ``[T]``      instances that may be relabelled positive in stage 2.

numpy arrays and torch tensors are both accepted.
"""
from __future__ import annotations

from functools import cache

import numpy as np
import torch
from scipy.linalg import blas
from threadpoolctl import ThreadpoolController

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


@cache
def _blas_threads() -> ThreadpoolController:
    """The loaded BLAS libraries, inspected once (``threadpool_limits`` inspects them on every call:
    ~1 ms, 14 % of a 250-bag sAwMIL fit)."""
    return ThreadpoolController()


def gram(Xs: torch.Tensor) -> torch.Tensor:
    """``Xs^T Xs`` ``[d, d]`` for ``Xs [n, d]``, accumulated in ``Xs``'s precision (float32 or
    float64; BLAS syrk on CPU: half the work of a general product), returned as float64.
    The BLAS runs on one thread: its threads and torch's spin-wait on each other otherwise (a
    SmolLM2 sAwMIL fit at torch's 2 threads: 10.8 s, 7.8 s with this, 7.2 s all on one thread)."""
    if Xs.device.type == "cpu":     # Xs^T as a Fortran-ordered [d, n] array: no copy
        syrk = blas.ssyrk if Xs.dtype == torch.float32 else blas.dsyrk
        with _blas_threads().limit(limits=1, user_api="blas"):
            G = torch.from_numpy(syrk(1.0, Xs.contiguous().numpy().T, trans=0, lower=1)).to(torch.float64)
        return G + G.tril(-1).T
    return (Xs.T @ Xs).to(torch.float64)


def unique_rows(X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Groups of identical rows of ``X [T, d]``: ``(rows [U], inverse [T])``.

    ``rows[g]`` is one row of group ``g`` and ``inverse[t]`` the group of row ``t``, so
    ``X[rows][inverse]`` equals ``X`` exactly.  Rows are ordered by a random-projection hash
    and a group starts wherever the hash or the row itself differs from the previous one, so
    no two different rows ever share a group (a hash tie of different rows, or identical rows
    whose hashes round differently, only leaves identical rows in separate groups).
    Causal LM activations repeat a lot (every statement opening with the same words has the same
    prefix activations): 41 604 SmolLM2 city_locations training tokens hold 17 780 distinct rows.
    """
    T, d = X.shape
    r = torch.randn(d, generator=torch.Generator().manual_seed(0), dtype=torch.float64).to(X.device, X.dtype)
    h, order = torch.sort(X @ r, stable=True)
    new = torch.ones(T, dtype=torch.bool, device=X.device)
    for s in range(1, T, CHUNK_ROWS):
        e = min(T, s + CHUNK_ROWS)
        blk = X.index_select(0, order[s - 1:e])                            # rows s-1 .. e-1 in hash order
        new[s:e] = (h[s:e] != h[s - 1:e - 1]) | (blk[1:] != blk[:-1]).any(1)
    group = torch.cumsum(new, 0) - 1                                       # [T] in hash order
    inverse = torch.empty_like(group)
    inverse[order] = group
    return order[new], inverse


def bag_sums(Xu: torch.Tensor, inverse: torch.Tensor, bag: torch.Tensor, n_bags: int) -> torch.Tensor:
    """Per-bag sums ``[N, d]`` of rows ``Xu[inverse]`` (``Xu [U, d]``, ``inverse [T]``, ``bag [T]``).

    Chunked, so the ``[T, d]`` rows are never materialised at once.
    """
    out = torch.zeros(n_bags, Xu.shape[1], dtype=Xu.dtype, device=Xu.device)
    for s in range(0, inverse.numel(), CHUNK_ROWS):
        out.index_add_(0, bag[s:s + CHUNK_ROWS], Xu.index_select(0, inverse[s:s + CHUNK_ROWS]))
    return out
