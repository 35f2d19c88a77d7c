"""The building blocks shared by dense and mixture-of-experts decoders: RMSNorm, rotary position
embeddings (RoPE, Su et al. 2021, with Llama 3 scaling), a Linear tuned for few-row products, and
the gated feed-forward, SwiGLU or GeGLU (Shazeer 2020). Plain torch, no state beyond weights."""
from __future__ import annotations

import functools
from typing import Any, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..base.accel import Twins
from . import _pymatvec, rope
from .config import ModelConfig

_matvec_failed: Optional[ImportError] = None
try:
    from . import _cmatvec
except ImportError as e:  # not built, or built from other sources: the twin serves
    _cmatvec, _matvec_failed = None, e  # type: ignore[assignment]

MATVEC = Twins(_pymatvec, _cmatvec, _matvec_failed)
_matvec = MATVEC.select()

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Over the last dimension, in fp32."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> Tensor:
    """``(head_dim/2,)`` fp32, ``llama3`` scaling if set; ``local``: the sliding layers'
    (``model.rope``, the one source)."""
    return torch.from_numpy(rope.rope_inv_freq(cfg, local))


def rope_tables(cfg: ModelConfig, max_seq_len: int, local: bool = False
                ) -> Tuple[Tensor, Tensor]:
    """``(max_seq_len, head_dim)`` fp32, rotate-half layout: the torch-free path's own, so both
    rotate alike."""
    cos, sin = rope.rope_tables(cfg, max_seq_len, local)
    return torch.from_numpy(cos), torch.from_numpy(sin)


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: (B, heads, T, head_dim); cos, sin: (B, 1, T, head_dim)."""
    return (x.float() * cos + rotate_half(x.float()) * sin).to(x.dtype)


class Linear(nn.Linear):
    """Bias-free unless asked. Up to ``MAX_ROWS`` float32 CPU rows (decode) take ``_cmatvec``'s
    few-row product (it reads the weight once for three rows, where CPU BLAS runs thin products far
    below the memory bound; ``bin/bench-decode``) or its twin; the rest, and transposed weights,
    take ``F.linear``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        out = project(x, self.weight)
        return out if self.bias is None else out + self.bias


def project(x: Tensor, weight: Tensor) -> Tensor:
    """``x @ weight.T``: the few-row product where it applies, else ``F.linear``."""
    flat = x.reshape(-1, weight.shape[1])  # (rows, in)
    if _matvec.usable(flat, weight):
        out = torch.empty(flat.shape[0], weight.shape[0], dtype=torch.float32)  # (rows, out)
        _matvec.rows(flat.contiguous(), weight, out, torch.get_num_threads())
        return out.view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight)


def fuse(linears: Sequence[Linear], attr: str = "weight") -> Tensor:
    """``linears``' weights (or ``attr``) as consecutive row blocks of one returned buffer; each
    keeps its parameter as a view of its rows (names, loading and values unchanged), and one product
    computes all."""
    weights = [getattr(layer, attr) for layer in linears]
    buffer = torch.cat([w.detach() for w in weights])  # (sum of outs, in)
    offset = 0
    for layer, w in zip(linears, weights):
        rows = w.shape[0]
        setattr(layer, attr, nn.Parameter(buffer[offset:offset + rows],
                                          requires_grad=w.requires_grad))
        offset += rows
    return buffer


def fuse_layers(linears: Sequence[nn.Module]) -> Optional[Any]:
    """One product for ``linears`` of one input width: ``fuse``'s buffer for float ones,
    ``fuse_group``'s for a type that has one (quantized), else None."""
    kinds = {type(layer) for layer in linears}
    if kinds == {Linear}:
        return fuse(linears)  # type: ignore[arg-type]
    group = getattr(kinds.pop(), "fuse_group", None) if len(kinds) == 1 else None
    return group(linears) if group is not None else None


def _held(layer_or_fused: Any) -> Tensor:
    """A float buffer itself, a layer's ``weight``, or a quantized layer's (group's) ``qweight``."""
    if isinstance(layer_or_fused, Tensor):
        return layer_or_fused
    held = getattr(layer_or_fused, "qweight", None)
    return held if held is not None else layer_or_fused.weight


def fused_with(buffer: Optional[Any], first: nn.Module) -> bool:
    """Nothing replaced the weights (a device move gives each parameter its own tensor); a quantized
    group holds them while ``first`` is its first."""
    if buffer is None:
        return False
    group = getattr(buffer, "layers", None)
    if group is not None:
        return group[0] is first
    mine, theirs = _held(buffer), _held(first)
    return theirs.data_ptr() == mine.data_ptr() and theirs.device == mine.device


def project_fused(x: Tensor, fused: Any) -> Tensor:
    return project(x, fused) if isinstance(fused, Tensor) else fused(x)


def transposed_head_pays() -> bool:
    """With the product in use."""
    return bool(_matvec.TRANSPOSED_HEAD)


ACTIVATIONS = {"silu": F.silu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh")}


class MLP(nn.Module):
    """down(act(gate(x)) * up(x)), ``activation`` "silu" (SwiGLU) or "gelu_tanh" (GeGLU)."""

    def __init__(self, dim: int, hidden: int, activation: str = "silu") -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r} (known: "
                             f"{', '.join(ACTIVATIONS)})")
        self.activation = activation
        self._act = ACTIVATIONS[activation]
        self.hidden = hidden
        self.gate = Linear(dim, hidden)
        self.up = Linear(dim, hidden)
        self.down = Linear(hidden, dim)
        self.gate_up: Optional[Any] = None  # see fuse_projections

    def fuse_projections(self) -> None:
        self.gate_up = fuse_layers([self.gate, self.up])

    def forward(self, x: Tensor) -> Tensor:
        if fused_with(self.gate_up, self.gate):
            both = project_fused(x, self.gate_up)  # (…, 2 * hidden)
            return self.down(self._act(both[..., :self.hidden]) * both[..., self.hidden:])
        return self.down(self._act(self.gate(x)) * self.up(x))
