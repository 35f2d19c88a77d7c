"""The decode step, pure numpy: the twin of ``ext/_cstep.pyx`` (API: ``_stepconstants``),
``ext/step.h``'s computation one numpy operation at a time (equal within float32 rounding, not bit
for bit); quantized matrices through ``_pyquant``; ``threads`` is BLAS's own count here. Arrays
(numpy or torch CPU) are read and written in place through their numpy views."""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from . import _pyquant
from ._stepconstants import (ACTIVATIONS, MAX_PAIRED_HEAD_DIM, MAX_PARTS, MAX_ROWS, STEP_ROWS,
                             BlockWeights, Experts, Limits, QuantMatrix, StackedMatrix, check,
                             check_act_mul, check_call, check_halves, check_logits,
                             logits_usable, unpaired, usable)
from .arrays import numpy_view as _np

# the API both twins share
__all__ = ["ACTIVATIONS", "MAX_PAIRED_HEAD_DIM", "MAX_PARTS", "MAX_ROWS", "PREFERRED",
           "STEP_ROWS", "BlockWeights", "Experts", "Limits", "Plan", "QuantMatrix",
           "StackedMatrix", "block", "blocks", "check", "check_call", "check_logits", "halves",
           "logits", "logits_usable", "plan", "usable", "widen_halves"]

# Row by row in Python this is no faster than the model's own batched torch path, so the
# torch model keeps that path for decode where this twin is the one selected.
PREFERRED = False


class Plan(Limits):

    def __init__(self, weights: Sequence[BlockWeights]) -> None:
        super().__init__(weights)
        self.weights = list(weights)


def plan(weights: Sequence[BlockWeights]) -> Plan:
    return Plan(weights)


def blocks(plan_: Plan, x: Any, out: Any, slots: Sequence[int], positions: Sequence[int],
           threads: int, dot: int = 0) -> None:
    if not isinstance(plan_, Plan):
        raise ValueError(f"plan {type(plan_).__name__} is not this module's Plan")
    check_call(plan_, plan_.wants_grad, x, out, slots, positions, threads)
    rows, into = _np(x), _np(out)
    for weights in plan_.weights:
        into[...] = _block(weights, rows, slots, positions, dot)
        rows = into.copy()


def block(weights: BlockWeights, x: Any, out: Any, slots: Sequence[int],
          positions: Sequence[int], threads: int, dot: int = 0) -> None:
    check(weights, x, out, slots, positions, threads)
    _np(out)[...] = _block(weights, _np(x), slots, positions, dot)


def logits(norm: Any, eps: float, head: Any, x: Any, out: Any, threads: int,
           dot: int = 0) -> None:
    check_logits(norm, head, x, out, threads)
    _np(out)[...] = _product(rms_norm(_np(x), _np(norm), eps), head, dot)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """Over the last dimension, in float32."""
    scale = np.float32(1) / np.sqrt(np.mean(x * x, -1, keepdims=True) + np.float32(eps))
    return (weight * (x * scale)).astype(np.float32)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate-half, cos and sin broadcast to x."""
    half = x.shape[-1] // 2
    rotated = np.concatenate((-x[..., half:], x[..., :half]), -1)
    return x * cos + rotated * sin


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def activate(gate: np.ndarray, activation: str) -> np.ndarray:
    """silu, or gelu's tanh approximation 0.5 g (1 + tanh y) as the equal g / (1 + e^-2y), as
    the compiled step computes them (exact where tanh y nears -1)."""
    y = gate
    if activation != "silu":
        y = np.float32(2 * math.sqrt(2 / math.pi)) * (gate + np.float32(0.044715) * gate ** 3)
    with np.errstate(over="ignore"):  # e^-y past float32: the value is 0, as it should be
        return gate / (np.float32(1) + np.exp(-y))


def halves(values: Any, out: Any) -> Any:
    """float32 ``values`` as IEEE halves into uint16 ``out``, rounded to nearest even; returns
    out."""
    check_halves(values, out, "float32", "uint16")
    with np.errstate(over="ignore"):  # beyond 65504: infinity, as it should be
        _np(out)[...] = _np(values).astype(np.float16).view(np.uint16)
    return out


def widen_halves(values: Any, out: Any, reference: bool = False) -> Any:
    """uint16 ``values``, IEEE halves, into float32 ``out`` exactly (``reference``: one path
    here); returns out."""
    check_halves(values, out, "uint16", "float32")
    _np(out)[...] = _np(values).view(np.float16).astype(np.float32)
    return out


def act_mul(both: Any, out: Any, activation: str, threads: int = 1) -> Any:
    """out (rows, hidden) = activation(gate) * up of both = [gate | up] (rows, 2 hidden);
    returns out."""
    check_act_mul(both, out, activation, threads)
    gates, into = _np(both), _np(out)
    hidden = into.shape[1]
    into[...] = activate(gates[:, :hidden], activation) * gates[:, hidden:]
    return out


def _product(x: np.ndarray, w: Any, dot: int) -> np.ndarray:
    """x times w^T for float32 w, a ``QuantMatrix`` or a ``StackedMatrix`` (parts side by side);
    ``dot`` 1: q8 mode for quantized parts."""
    if isinstance(w, StackedMatrix):
        return np.concatenate([_product(x, part, dot) for part in w.parts], 1)
    if isinstance(w, QuantMatrix):
        out = np.empty((x.shape[0], w.shape[0]), np.float32)  # (rows, out)
        return _pyquant.matmul(np.ascontiguousarray(x), w.data, w.qtype, out, 1, dot)
    return x @ _np(w).T


def _block(w: BlockWeights, x: np.ndarray, slots: Sequence[int], positions: Sequence[int],
           dot: int) -> np.ndarray:
    rows = x.shape[0]
    n_kv, head_dim = w.k.shape[1], w.k.shape[3]
    q_dim, kv_dim = w.n_heads * head_dim, n_kv * head_dim
    qkv = _product(rms_norm(x, _np(w.attn_norm), w.eps), w.qkv, dot)  # (rows, q + 2 kv)
    if w.qk_pairs:
        qkv[:, :q_dim + kv_dim] = unpaired(qkv[:, :q_dim + kv_dim], head_dim)
    if w.qkv_bias is not None:
        qkv = qkv + _np(w.qkv_bias)
    index = np.asarray(list(positions), dtype=np.int64)
    cos, sin = _np(w.cos)[index][:, None], _np(w.sin)[index][:, None]  # (rows, 1, hd)
    q = _normed(qkv[:, :q_dim].reshape(rows, w.n_heads, head_dim), w.q_norm, w.eps)
    k = _normed(qkv[:, q_dim:q_dim + kv_dim].reshape(rows, n_kv, head_dim), w.k_norm, w.eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    v = qkv[:, q_dim + kv_dim:].reshape(rows, n_kv, head_dim)
    att = np.empty((rows, w.n_heads, head_dim), np.float32)
    group = w.n_heads // n_kv
    scale = np.float32(1.0 / math.sqrt(head_dim) if w.attn_scale is None else w.attn_scale)
    cache_k, cache_v = _np(w.k), _np(w.v)
    for r, (slot, pos) in enumerate(zip(slots, positions)):
        cache_k[slot, :, pos], cache_v[slot, :, pos] = k[r], v[r]
        first = pos + 1 - w.window if w.window and pos >= w.window else 0
        keys = cache_k[slot, :, first:pos + 1]  # (kv, L, hd)
        values = cache_v[slot, :, first:pos + 1]
        query = q[r].reshape(n_kv, group, head_dim)  # (kv, group, hd)
        scores = (query @ keys.transpose(0, 2, 1)) * scale  # (kv, group, L)
        att[r] = (softmax(scores) @ values).reshape(w.n_heads, head_dim)
    attended = _product(att.reshape(rows, q_dim), w.wo, dot)
    mid = x + _normed(attended, w.post_attn_norm, w.eps)
    h = rms_norm(mid, _np(w.mlp_norm), w.eps)
    fed = _dense(h, w.gate_up, w.down, w.activation, dot) if w.experts is None \
        else _moe(h, w.experts, dot)
    return mid + _normed(fed, w.post_mlp_norm, w.eps)


def _dense(h: np.ndarray, gate_up: Any, down: Any, activation: str, dot: int) -> np.ndarray:
    both = _product(h, gate_up, dot)  # (rows, 2 hidden)
    hidden = both.shape[1] // 2
    gate = activate(both[:, :hidden], activation)
    return _product(np.ascontiguousarray(gate * both[:, hidden:]), down, dot)


def _moe(h: np.ndarray, experts: Experts, dot: int) -> np.ndarray:
    """Each row alone: router softmax, top k (renormalized where the experts say), chosen outputs
    times weights summed in ascending expert order; rows counted per expert."""
    probs = softmax(_product(h, experts.router, dot))  # (rows, E)
    ids = np.argsort(-probs, -1, kind="stable")[:, :experts.top_k]  # (rows, k)
    weights = np.take_along_axis(probs, ids, -1)
    if experts.renormalize:
        weights = weights / weights.sum(-1, keepdims=True)
    fed = np.zeros_like(h)  # (rows, dim)
    counts = None if experts.counts is None else _np(experts.counts)
    for r in range(h.shape[0]):
        for j in np.argsort(ids[r]).tolist():
            e = int(ids[r, j])
            y = _dense(h[r:r + 1], experts.gate_up[e], experts.down[e], "silu", dot)
            fed[r:r + 1] += y * weights[r, j]
        if counts is not None:
            counts[ids[r]] += 1
    return fed


def _normed(x: np.ndarray, weight: Any, eps: float) -> np.ndarray:
    """``weight`` None: x as it is."""
    return x if weight is None else rms_norm(x, _np(weight), eps)
