"""Expert routing of a mixture-of-experts layer, pure Python (twin of ``ext/_cmoe.pyx``).

``group_by_expert`` turns the router's top-k choices into one contiguous group per expert, so
that each expert runs a single batched call on exactly its tokens (the "group by expert"
dispatch of Switch Transformers, Fedus et al. 2022, and MegaBlocks, Gale et al. 2023, applied
to Mixtral's top-2 routing, Jiang et al. 2024). It is a counting sort of the ``N * k``
(token, expert) assignments by expert: O(N*k + E), stable, so the tokens of one expert come out
in ascending order.
"""
from __future__ import annotations

from typing import Any, List, Tuple

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
    return idx, weights


def group_by_expert(topk_idx: Any, topk_w: Any, n_experts: int
                    ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Group the assignments ``topk_idx`` (N, k) int64 with weights ``topk_w`` (N, k) float32
    by expert.

    Returns ``(offsets, token_idx, weights)``: ``offsets`` int64 (n_experts + 1,); expert
    ``e``'s assignments are ``token_idx[offsets[e]:offsets[e + 1]]`` (token rows, ascending)
    with ``weights[offsets[e]:offsets[e + 1]]``. An index outside ``[0, n_experts)`` is a
    ``ValueError``.
    """
    idx, weights = _check(topk_idx, topk_w, n_experts)
    k = idx.shape[1]
    flat_idx: List[int] = idx.reshape(-1).tolist()  # (N*k,) row-major: assignment a = t*k + j
    flat_w: List[float] = weights.reshape(-1).tolist()
    offsets = [0] * (n_experts + 1)
    for e in flat_idx:  # pass 1: count (and validate)
        if not 0 <= e < n_experts:
            raise ValueError(f"expert index {e} outside [0, {n_experts})")
        offsets[e + 1] += 1
    for e in range(n_experts):  # counts -> exclusive prefix sums
        offsets[e + 1] += offsets[e]
    cursor = offsets[:-1]  # next free position of each expert
    tokens = [0] * len(flat_idx)
    out_w = [0.0] * len(flat_idx)
    for a, e in enumerate(flat_idx):  # pass 2: scatter, in token order (stable)
        pos = cursor[e]
        tokens[pos] = a // k
        out_w[pos] = flat_w[a]
        cursor[e] = pos + 1
    return (np.array(offsets, dtype=np.int64), np.array(tokens, dtype=np.int64),
            np.array(out_w, dtype=np.float32))
