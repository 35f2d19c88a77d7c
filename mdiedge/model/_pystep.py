"""The decode step, pure torch: the twin of ``ext/_cstep.pyx`` with the same API (see
``mdiedge/model/_stepspec.py``). The same computation as ``ext/step.h``, one torch operation
at a time, its sums and exp in torch's own order (equal within float32 rounding, not bit for
bit), a ``QuantMatrix`` (each part of a ``StackedMatrix``) multiplied by the quantized product's twin (``_pyquant``, the
reference de-quantizer then float32); ``threads`` is torch's own thread count here."""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from . import _pyquant
from ._stepspec import (ACTIVATIONS, MAX_PARTS, MAX_ROWS, BlockWeights,  # noqa: F401
                        Experts, Limits, QuantMatrix, StackedMatrix, check, check_call,
                        check_logits, logits_usable, usable)
from .layers import apply_rope, rms_norm

# Row by row in torch operations this is no faster than the model's own batched torch path,
# so the model keeps that path for decode where this twin is the one selected.
PREFERRED = False


class Plan(Limits):
    """Consecutive blocks to run in one call."""

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
    for weights in plan_.weights:
        _block(weights, x, out, slots, positions, dot)
        x = out.clone()


def block(weights: BlockWeights, x: Any, out: Any, slots: Sequence[int],
          positions: Sequence[int], threads: int, dot: int = 0) -> None:
    check(weights, x, out, slots, positions, threads)
    _block(weights, x, out, slots, positions, dot)


def logits(norm: Any, eps: float, head: Any, x: Any, out: Any, threads: int,
           dot: int = 0) -> None:
    check_logits(norm, head, x, out, threads)
    out.copy_(_product(rms_norm(x, norm, eps), head, dot))


def _product(x: Any, w: Any, dot: int) -> Any:
    """x (rows, in) times w^T, w float32 (out, in), a ``QuantMatrix`` or a ``StackedMatrix``
    (its parts' products side by side): (rows, out); dot 1, a quantized part in the q8 mode
    (``_pyquant.matmul``)."""
    if isinstance(w, StackedMatrix):
        return torch.cat([_product(x, part, dot) for part in w.parts], 1)
    if isinstance(w, QuantMatrix):
        out = torch.empty(x.shape[0], w.shape[0])  # (rows, out)
        return _pyquant.matmul(x.contiguous(), w.data, w.qtype, out, 1, dot)
    return F.linear(x, w)


def _block(w: BlockWeights, x: Any, out: Any, slots: Sequence[int],
           positions: Sequence[int], dot: int) -> None:
    rows = x.shape[0]
    n_kv, head_dim = w.k.shape[1], w.k.shape[3]
    q_dim, kv_dim = w.n_heads * head_dim, n_kv * head_dim
    qkv = _product(rms_norm(x, w.attn_norm, w.eps), w.qkv, dot)  # (rows, q_dim + 2 kv_dim)
    if w.qkv_bias is not None:
        qkv = qkv + w.qkv_bias
    index = torch.as_tensor(list(positions))
    cos, sin = w.cos[index][:, None], w.sin[index][:, None]  # (rows, 1, hd)
    q = _normed(qkv[:, :q_dim].reshape(rows, w.n_heads, head_dim), w.q_norm, w.eps)
    k = _normed(qkv[:, q_dim:q_dim + kv_dim].reshape(rows, n_kv, head_dim), w.k_norm, w.eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    v = qkv[:, q_dim + kv_dim:].reshape(rows, n_kv, head_dim)
    att = torch.empty(rows, w.n_heads, head_dim)
    group = w.n_heads // n_kv
    scale = 1.0 / math.sqrt(head_dim) if w.attn_scale is None else w.attn_scale
    for r, (slot, pos) in enumerate(zip(slots, positions)):
        w.k[slot, :, pos], w.v[slot, :, pos] = k[r], v[r]
        first = pos + 1 - w.window if w.window and pos >= w.window else 0
        keys, values = w.k[slot, :, first:pos + 1], w.v[slot, :, first:pos + 1]  # (kv, L, hd)
        query = q[r].reshape(n_kv, group, head_dim)  # (kv, group, hd)
        scores = (query @ keys.transpose(1, 2)) * scale  # (kv, group, L)
        att[r] = (torch.softmax(scores, -1) @ values).reshape(w.n_heads, head_dim)
    mid = x + _normed(_product(att.reshape(rows, q_dim), w.wo, dot), w.post_attn_norm, w.eps)
    h = rms_norm(mid, w.mlp_norm, w.eps)
    fed = _dense(h, w.gate_up, w.down, w.activation, dot) if w.experts is None \
        else _moe(h, w.experts, dot)
    out.copy_(mid + _normed(fed, w.post_mlp_norm, w.eps))


def _dense(h: Any, gate_up: Any, down: Any, activation: str, dot: int) -> Any:
    """The gated feed-forward of h (rows, dim): (rows, dim)."""
    both = _product(h, gate_up, dot)  # (rows, 2 hidden)
    hidden = both.shape[1] // 2
    gate = both[:, :hidden]
    gate = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
    return _product(gate * both[:, hidden:], down, dot)


def _moe(h: Any, experts: Experts, dot: int) -> Any:
    """The mixture of experts of h (rows, dim), each row alone: the router's softmax, its
    top k (renormalized where the experts say), the chosen experts' outputs times their
    weights summed in ascending expert order; the rows counted per expert."""
    probs = torch.softmax(_product(h, experts.router, dot), -1)  # (rows, E)
    weights, ids = torch.topk(probs, experts.top_k, -1)  # (rows, k) each
    if experts.renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    fed = torch.zeros_like(h)  # (rows, dim)
    for r in range(h.shape[0]):
        order = torch.argsort(ids[r])
        for j in order.tolist():
            e = int(ids[r, j])
            y = _dense(h[r:r + 1], experts.gate_up[e], experts.down[e], "silu", dot)
            fed[r:r + 1] += y * weights[r, j]
        if experts.counts is not None:
            experts.counts[ids[r]] += 1
    return fed


def _normed(x: Any, weight: Any, eps: float) -> Any:
    """x normed over its last dimension by RMSNorm of ``weight`` (a head's Q/K norm, a
    sandwich norm); None: x as it is."""
    return x if weight is None else rms_norm(x, weight, eps)
