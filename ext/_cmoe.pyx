# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""Expert routing of a mixture-of-experts layer, compiled (twin of ``mdiedge/_pymoe.py``, same
API and errors).

A counting sort of the ``N * k`` (token, expert) assignments by expert, O(N*k + E), in two
``nogil`` passes over typed memoryviews: count, then scatter. It gives each expert one
contiguous, ascending list of tokens, so that the expert runs one batched call on exactly its
tokens (group-by-expert dispatch: Switch Transformers, Fedus et al. 2022; MegaBlocks, Gale et
al. 2023; Mixtral top-2 routing, Jiang et al. 2024).
"""
import numpy as np

from libc.stdint cimport int64_t


def _check(topk_idx, topk_w, n_experts):
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


def group_by_expert(topk_idx, topk_w, n_experts):
    """Group the assignments ``topk_idx`` (N, k) int64 with weights ``topk_w`` (N, k) float32
    by expert.

    Returns ``(offsets, token_idx, weights)``: ``offsets`` int64 (n_experts + 1,); expert
    ``e``'s assignments are ``token_idx[offsets[e]:offsets[e + 1]]`` (token rows, ascending)
    with ``weights[offsets[e]:offsets[e + 1]]``. An index outside ``[0, n_experts)`` is a
    ``ValueError``.
    """
    idx_arr, w_arr = _check(topk_idx, topk_w, n_experts)
    cdef const int64_t[:, ::1] idx = idx_arr
    cdef const float[:, ::1] w = w_arr
    cdef Py_ssize_t n = idx.shape[0], k = idx.shape[1], n_exp = n_experts
    cdef Py_ssize_t i, j, pos
    cdef int64_t e, bad = 0
    cdef bint found_bad = False

    offsets_arr = np.zeros(n_exp + 1, dtype=np.int64)
    cursor_arr = np.empty(n_exp, dtype=np.int64)
    tokens_arr = np.empty(n * k, dtype=np.int64)
    weights_arr = np.empty(n * k, dtype=np.float32)
    cdef int64_t[::1] offsets = offsets_arr
    cdef int64_t[::1] cursor = cursor_arr
    cdef int64_t[::1] tokens = tokens_arr
    cdef float[::1] weights = weights_arr

    with nogil:
        for i in range(n):  # pass 1: count (and validate, first bad value in row-major order)
            for j in range(k):
                e = idx[i, j]
                if e < 0 or e >= n_exp:
                    bad = e
                    found_bad = True
                    break
                offsets[e + 1] += 1
            if found_bad:
                break
        if not found_bad:
            for e in range(n_exp):  # counts -> exclusive prefix sums
                offsets[e + 1] += offsets[e]
                cursor[e] = offsets[e]
            for i in range(n):  # pass 2: scatter, in token order (stable)
                for j in range(k):
                    e = idx[i, j]
                    pos = cursor[e]
                    tokens[pos] = i
                    weights[pos] = w[i, j]
                    cursor[e] = pos + 1
    if found_bad:
        raise ValueError(f"expert index {bad} outside [0, {n_experts})")
    return offsets_arr, tokens_arr, weights_arr
