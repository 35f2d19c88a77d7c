"""Expert routing of a mixture-of-experts layer on the CPU: ``group_by_expert`` turns the router's
top-k choices into one contiguous group per expert, so that each expert runs a single batched call
on exactly its tokens (the "group by expert" dispatch of Switch Transformers, Fedus et al. 2022, and
MegaBlocks, Gale et al. 2023, applied to Mixtral's top-2 routing, Jiang et al. 2024).

It is a stable sort of the ``N * k`` (token, expert) assignments by expert, in numpy: the tokens of
one expert come out in ascending order."""
from __future__ import annotations

from typing import Any, Tuple

import numpy as np


def _check(topk_idx: Any, topk_w: Any, n_experts: int) -> Tuple[np.ndarray, np.ndarray]:
    """The inputs as C-contiguous int64 / float32 arrays (no copy when they already are)."""
    if n_experts < 1:
        raise ValueError(f"n_experts must be positive, got {n_experts}")
    idx = np.ascontiguousarray(topk_idx, dtype=np.int64)
    weights = np.ascontiguousarray(topk_w, dtype=np.float32)
    if idx.ndim != 2:
        raise ValueError(f"topk_idx must be 2-D (N, k), got shape {tuple(idx.shape)}")
    if weights.shape != idx.shape:
        raise ValueError(f"topk_w shape {tuple(weights.shape)} differs from topk_idx shape "
                         f"{tuple(idx.shape)}")
    bad = np.flatnonzero((idx < 0) | (idx >= n_experts))
    if bad.size:  # the first one in row-major order
        raise ValueError(f"expert index {idx.reshape(-1)[bad[0]]} outside [0, {n_experts})")
    return idx, weights


def group_by_expert(topk_idx: Any, topk_w: Any, n_experts: int
                    ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Group the assignments ``topk_idx`` (N, k) int64 with weights ``topk_w`` (N, k) float32 by
    expert.

    Returns ``(offsets, token_idx, weights)``: ``offsets`` int64 (n_experts + 1,); expert ``e``'s
    assignments are ``token_idx[offsets[e]:offsets[e + 1]]`` (token rows, ascending) with
    ``weights[offsets[e]:offsets[e + 1]]``. An index outside ``[0, n_experts)`` is a ``ValueError``.
    """
    idx, weights = _check(topk_idx, topk_w, n_experts)
    flat = idx.reshape(-1)  # (N*k,) row-major: assignment a = token * k + j
    order = np.argsort(flat, kind="stable").astype(np.int64, copy=False)  # (N*k,) by expert
    offsets = np.zeros(n_experts + 1, dtype=np.int64)
    np.cumsum(np.bincount(flat, minlength=n_experts), out=offsets[1:])
    return offsets, order // max(idx.shape[1], 1), weights.reshape(-1)[order]
