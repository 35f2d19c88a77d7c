"""The Llama-style decoder block the families build: RMSNorm, grouped-query attention with
rotate-half RoPE over a slotted KV cache (each row its own slot and position), optional Q/K/V biases
(Qwen2), Q/K head norms (Qwen3, Gemma 3), sandwich norms, scale and sliding window (Gemma 3), and
the family's feed-forward. ``step_weights`` hands a block's tensors to the compiled decode step."""
from __future__ import annotations

import math
from typing import Any, Dict, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._stepconstants import (ACTIVATIONS, BlockWeights, Experts, QuantMatrix, StackedMatrix,
                        plain)
from .config import ModelConfig
from .layers import (MLP, Linear, RMSNorm, apply_rope, fuse, fuse_layers, fused_with,
                     project_fused)

_HAS_SDPA = hasattr(F, "scaled_dot_product_attention")
_SHORT_QUERY = 4096  # T * L below which explicit attention beats the fused CPU kernel


class KVCache(nn.Module):
    """Preallocated keys and values of one block for ``n_slots`` samples, KV heads only."""

    def __init__(self, n_slots: int, n_kv_heads: int, max_seq_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        shape = (n_slots, n_kv_heads, max_seq_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, slots: Tensor, positions: Sequence[int], k: Tensor, v: Tensor
               ) -> Tuple[Tensor, Tensor]:
        """Write k, v (B, kv_heads, T, hd) at each row's slot and position; the slots' keys and
        values up to the furthest position written."""
        batch, _, seq_len, _ = k.shape
        length = max(positions) + seq_len
        if batch == 1:
            slot = int(slots[0])
            pos = positions[0]
            self.k[slot, :, pos:pos + seq_len] = k[0]
            self.v[slot, :, pos:pos + seq_len] = v[0]
            return self.k[slot:slot + 1, :, :length], self.v[slot:slot + 1, :, :length]
        if seq_len == 1:
            pos_index = torch.as_tensor(positions, device=k.device)
            self.k[slots, :, pos_index] = k[:, :, 0]
            self.v[slots, :, pos_index] = v[:, :, 0]
        else:
            for row, pos in enumerate(positions):
                slot = int(slots[row])
                self.k[slot, :, pos:pos + seq_len] = k[row]
                self.v[slot, :, pos:pos + seq_len] = v[row]
        first = int(slots[0]) if slots.device.type == "cpu" else -1  # no device sync
        if first >= 0 and slots.tolist() == list(range(first, first + batch)):  # no copy
            return self.k[first:first + batch, :, :length], self.v[first:first + batch, :, :length]
        return (self.k[:, :, :length].index_select(0, slots),
                self.v[:, :, :length].index_select(0, slots))


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor],
              causal: bool = False, scale: Optional[float] = None) -> Tensor:
    """q: (B, heads, T, hd); k, v: (B, kv_heads, L, hd); mask: (B, 1, T, L) bool or None; ``causal``
    (no cache) masks the upper triangle instead. Short queries (decode) take a grouped matmul that
    never copies K/V per query head; long ones the fused kernel where torch has one."""
    batch, n_heads, seq_len, head_dim = q.shape
    n_kv, length = k.shape[1], k.shape[2]
    groups = n_heads // n_kv
    if _HAS_SDPA and seq_len * length > _SHORT_QUERY:
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)  # (B, heads, L, hd)
            v = v.repeat_interleave(groups, dim=1)
        scaled = {} if scale is None else {"scale": scale}
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                              **scaled)
    q = q.reshape(batch, n_kv, groups * seq_len, head_dim)  # (B, kv_heads, g*T, hd)
    factor = 1.0 / math.sqrt(head_dim) if scale is None else scale
    scores = (q @ k.transpose(-2, -1)).float() * factor  # (B, kv, g*T, L)
    if causal:
        mask = torch.ones(seq_len, length, dtype=torch.bool, device=q.device).tril()[None, None]
    if mask is not None:
        mask = mask.unsqueeze(2).expand(batch, 1, groups, seq_len, length)
        scores = scores.masked_fill(~mask.reshape(batch, 1, groups * seq_len, length), float("-inf"))
    out = torch.softmax(scores, dim=-1).to(v.dtype) @ v  # (B, kv_heads, g*T, hd)
    return out.view(batch, n_heads, seq_len, head_dim)


def band_mask(seq_len: int, window: int, device: torch.device) -> Tensor:
    """(1, 1, T, T): causal, each query seeing its last ``window`` positions, itself included."""
    rows = torch.arange(seq_len, device=device)
    distance = rows[:, None] - rows[None, :]  # query - key
    return ((distance >= 0) & (distance < window))[None, None]


class Attention(nn.Module):
    """``qk_norm``: RMS norm per Q and K head before RoPE; ``scale`` None: 1/sqrt(head_dim);
    ``window`` > 0: a sliding layer (the caller makes its mask)."""

    def __init__(self, cfg: ModelConfig, qkv_bias: bool = False, qk_norm: bool = False,
                 window: int = 0) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        norm = (lambda: RMSNorm(cfg.head_dim, cfg.rms_norm_eps)) if qk_norm else (lambda: None)
        self.q_norm: Optional[RMSNorm] = norm()
        self.k_norm: Optional[RMSNorm] = norm()
        self.scale: Optional[float] = (cfg.query_pre_attn_scalar ** -0.5
                                       if cfg.query_pre_attn_scalar else None)
        self.window = window
        self.wq = Linear(cfg.dim, cfg.q_dim, bias=qkv_bias)
        self.wk = Linear(cfg.dim, cfg.kv_dim, bias=qkv_bias)
        self.wv = Linear(cfg.dim, cfg.kv_dim, bias=qkv_bias)
        self.wo = Linear(cfg.q_dim, cfg.dim)
        self.cache: Optional[KVCache] = None
        self.qkv: Optional[Any] = None  # see fuse_projections
        self.qkv_bias: Optional[Tensor] = None

    def fuse_projections(self) -> None:
        """Q, K and V as one product (float or quantized, each its own type), biases as one vector.
        """
        projections = [self.wq, self.wk, self.wv]
        self.qkv = fuse_layers(projections)
        if all(getattr(p, "bias", None) is not None for p in projections):
            self.qkv_bias = fuse(projections, "bias")

    def _fused_bias(self) -> Optional[Tensor]:
        """The fused vector while the layers' biases are still its views, else a copy."""
        bias = getattr(self.wq, "bias", None)
        if bias is None:
            return None
        if self.qkv_bias is not None and bias.data_ptr() == self.qkv_bias.data_ptr() \
                and bias.device == self.qkv_bias.device:
            return self.qkv_bias
        return torch.cat([self.wq.bias, self.wk.bias, self.wv.bias])

    def _project_qkv(self, x: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        if fused_with(self.qkv, self.wq):
            out = project_fused(x, self.qkv)  # (B, T, q_dim + 2 * kv_dim)
            bias = self._fused_bias()
            if bias is not None:
                out = out + bias
            q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
            return out[..., :q_dim], out[..., q_dim:q_dim + kv_dim], out[..., q_dim + kv_dim:]
        return self.wq(x), self.wk(x), self.wv(x)

    def fill_kv(self, x: Tensor, cos: Tensor, sin: Tensor, slots: Tensor,
                positions: Sequence[int]) -> None:
        """Write the keys and values of the normed ``x`` as ``forward`` would, without the
        attention."""
        batch, seq_len, _ = x.shape
        k = self.wk(x).view(batch, seq_len, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, seq_len, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if self.k_norm is not None:
            k = self.k_norm(k)
        assert self.cache is not None
        self.cache.update(slots, positions, apply_rope(k, cos, sin), v)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Optional[Tensor],
                slots: Tensor, positions: Sequence[int]) -> Tensor:
        batch, seq_len, _ = x.shape
        q, k, v = self._project_qkv(x)
        q = q.view(batch, seq_len, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(batch, seq_len, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(batch, seq_len, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # (B, heads, T, hd)
        if self.cache is None:  # training: the whole sequence at once, causal
            band = band_mask(seq_len, self.window, x.device) if self.window else None
            out = attention(q, k, v, band, causal=band is None, scale=self.scale)
        else:
            keys, values = self.cache.update(slots, positions, k, v)  # (B, kv_heads, L, hd)
            out = attention(q, keys, values, mask, scale=self.scale)  # (B, heads, T, hd)
        return self.wo(out.transpose(1, 2).reshape(batch, seq_len, -1))


class Block(nn.Module):
    """Pre-norm; ``sandwich_norms`` (Gemma 3) norm each output before its residual add."""

    def __init__(self, cfg: ModelConfig, mlp: nn.Module, qkv_bias: bool = False,
                 qk_norm: bool = False, sandwich_norms: bool = False, window: int = 0) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.rms_norm_eps)
        self.attn = Attention(cfg, qkv_bias, qk_norm, window)
        self.post_attn_norm = RMSNorm(cfg.dim, cfg.rms_norm_eps) if sandwich_norms else None
        self.mlp_norm = RMSNorm(cfg.dim, cfg.rms_norm_eps)
        self.mlp = mlp
        self.post_mlp_norm = RMSNorm(cfg.dim, cfg.rms_norm_eps) if sandwich_norms else None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Optional[Tensor],
                slots: Tensor, positions: Sequence[int]) -> Tensor:
        attended = self.attn(self.attn_norm(x), cos, sin, mask, slots, positions)
        if self.post_attn_norm is not None:
            attended = self.post_attn_norm(attended)
        x = x + attended
        fed = self.mlp(self.mlp_norm(x))
        if self.post_mlp_norm is not None:
            fed = self.post_mlp_norm(fed)
        return x + fed

    def fuse_projections(self) -> None:
        self.attn.fuse_projections()
        experts = getattr(self.mlp, "experts", None)
        for mlp in [self.mlp] if experts is None else experts:
            mlp.fuse_projections()

    def fill_kv(self, x: Tensor, cos: Tensor, sin: Tensor, slots: Tensor,
                positions: Sequence[int]) -> None:
        self.attn.fill_kv(self.attn_norm(x), cos, sin, slots, positions)

    def step_weights(self, cos: Tensor, sin: Tensor) -> Optional[BlockWeights]:
        """This block's tensors for the compiled decode step; None where it does not apply (unfused
        projections, float beside quantized layers in one group, no KV cache, a part the step
        lacks)."""
        attn = self.attn
        if attn.cache is None or not fused_with(attn.qkv, attn.wq):
            return None
        matrices = [step_matrix(m) for m in (attn.qkv, attn.wo)]
        tensors = (self.attn_norm.weight, self.mlp_norm.weight, attn.cache.k, attn.cache.v,
                   cos, sin)
        options, fed = self.step_options(), self._step_feed_forward()
        if (any(m is None for m in matrices) or not all(plain(t) for t in tensors)
                or options is None or fed is None):
            return None
        qkv, wo = matrices
        gate_up, down, experts = fed
        return BlockWeights(self.attn_norm.weight, qkv, wo, self.mlp_norm.weight, gate_up, down,
                            attn.cache.k, attn.cache.v, cos, sin, attn.n_heads,
                            self.attn_norm.eps, experts=experts, **options)

    def _step_feed_forward(self) -> Optional[Tuple[Any, Any, Optional[Experts]]]:
        """(gate_up, down, None) dense, (None, None, experts) MoE; None where the step cannot read
        it."""
        mlp = self.mlp
        if not isinstance(mlp, MLP):
            experts = step_experts(mlp)
            return None if experts is None else (None, None, experts)
        if not fused_with(mlp.gate_up, mlp.gate):
            return None
        gate_up, down = step_matrix(mlp.gate_up), step_matrix(mlp.down)
        return None if gate_up is None or down is None else (gate_up, down, None)

    def step_options(self) -> Optional[Dict[str, Any]]:
        """The optional parts of ``BlockWeights`` this block has; None where a norm's eps differs, a
        tensor is not plain CPU float32 or the activation is not the step's."""
        attn, eps = self.attn, self.attn_norm.eps
        norms = {"q_norm": getattr(attn, "q_norm", None), "k_norm": getattr(attn, "k_norm", None),
                 "post_attn_norm": getattr(self, "post_attn_norm", None),
                 "post_mlp_norm": getattr(self, "post_mlp_norm", None)}
        if any(n is not None and n.eps != eps for n in norms.values()):
            return None
        options: Dict[str, Any] = {name: None if n is None else n.weight
                                   for name, n in norms.items()}
        options["qkv_bias"] = attn._fused_bias()
        if not all(t is None or plain(t) for t in options.values()):
            return None
        options.update(activation=getattr(self.mlp, "activation", "silu"),
                       attn_scale=getattr(attn, "scale", None),
                       window=getattr(attn, "window", 0) or 0)
        return options if options["activation"] in ACTIVATIONS else None

    def step_refusal(self) -> str:
        """Why ``step_weights`` gives None, in a few words."""
        attn = self.attn
        if attn.cache is None:
            return "no KV cache"
        mlps = list(getattr(self.mlp, "experts", [self.mlp]))
        if not isinstance(self.mlp, MLP) and not _is_moe(self.mlp):
            return f"its feed-forward is a {type(self.mlp).__name__}, not one the step has"
        if not fused_with(attn.qkv, attn.wq) or not all(
                isinstance(m, MLP) and fused_with(m.gate_up, m.gate) for m in mlps):
            return "Q/K/V or gate/up are not fused"
        held = [("qkv", attn.qkv), ("wo", attn.wo)] + (
            [("gate_up", self.mlp.gate_up), ("down", self.mlp.down)] if isinstance(self.mlp, MLP)
            else [("router", self.mlp.router)] + [
                (f"expert {e} {name}", getattr(m, name)) for e, m in enumerate(mlps)
                for name in ("gate_up", "down")])
        for name, matrix in held:
            if step_matrix(matrix) is None:
                return f"matrix {name} ({_held_type(matrix)}) has no kernel in the step"
        wanted = ACTIVATIONS if isinstance(self.mlp, MLP) else ("silu",)  # experts: SwiGLU
        for m in mlps:
            if m.activation not in wanted:
                return f"activation {m.activation!r} is not one the step has here " \
                       f"({', '.join(wanted)})"
        eps = {n.eps for n in (getattr(attn, "q_norm", None), getattr(attn, "k_norm", None),
                               getattr(self, "post_attn_norm", None),
                               getattr(self, "post_mlp_norm", None)) if n is not None}
        if eps - {self.attn_norm.eps}:
            return f"norms of eps {sorted(eps)} beside the block's {self.attn_norm.eps}"
        return "a tensor is not contiguous float32 on the CPU"


def _is_moe(mlp: Any) -> bool:
    return all(hasattr(mlp, name) for name in ("router", "experts", "top_k", "renormalize",
                                               "expert_counts"))


def step_experts(moe: Any) -> Optional[Experts]:
    """A mixture of experts as the compiled step reads it (router, fused gate/up and down per
    expert, top k, renormalization, row counts); None where it cannot (unfused, not SwiGLU, no
    kernel)."""
    if not _is_moe(moe) or not all(isinstance(m, MLP) and m.activation == "silu"
                                   and fused_with(m.gate_up, m.gate) for m in moe.experts):
        return None
    router = step_matrix(moe.router)
    gate_up = [step_matrix(m.gate_up) for m in moe.experts]
    down = [step_matrix(m.down) for m in moe.experts]
    if router is None or any(m is None for m in gate_up + down):
        return None
    try:
        return Experts(router, gate_up, down, moe.top_k, moe.renormalize, moe.expert_counts)
    except ValueError:  # mixed widths, a counter that is not plain int64
        return None


def _held_type(held: Any) -> str:
    group = getattr(held, "layers", None)
    if group is not None:
        return " + ".join(_held_type(layer) for layer in group)
    qtype = getattr(held, "qtype", None)
    if qtype is not None:
        return str(qtype)
    weight = held if isinstance(held, Tensor) else getattr(held, "weight", None)
    return str(getattr(weight, "dtype", type(held).__name__)).replace("torch.", "")


def step_matrix(held: Any) -> Optional[Any]:
    """Plain float32 as is, a quantized layer as ``QuantMatrix``, a ``QuantGroup`` as
    ``StackedMatrix``; else None."""
    group = getattr(held, "layers", None)
    if group is not None:
        parts = [step_matrix(layer) for layer in group]
        if not all(isinstance(part, QuantMatrix) for part in parts):
            return None
        try:
            return StackedMatrix(parts)
        except ValueError:  # more parts than the step takes
            return None
    qweight = getattr(held, "qweight", None)
    if qweight is not None:
        try:
            return QuantMatrix(qweight, held.qtype)
        except ValueError:  # on another device, or a type the step has no kernel for
            return None
    weight = held if isinstance(held, Tensor) else getattr(held, "weight", None)
    return weight if isinstance(weight, Tensor) and plain(weight) else None


