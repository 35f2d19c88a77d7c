"""Layers whose weights stay in a GGUF block type with a kernel (``quant.TYPES``), multiplied on the
CPU as the process's dot mode says (``mdiedge.base.cpudot``): q8, activations quantized to 8 bits
and integer dot products (as llama.cpp does); f32, weights widened to float32 inside the kernels.

- ``QuantLinear``: up to ``KERNEL_ROWS`` rows (decode) take the compiled product (``_cquant`` or
  its twin), which reads each block once for every row; more rows (prefill) too where
  ``npprefill.integer_prefill`` says, else a tile of rows at a time de-quantized into one reused
  float32 buffer and multiplied with torch.
- ``QuantEmbedding``: a token's row de-quantized when looked up.

On CUDA the blocks move with the model and each product de-quantizes there with torch
(``quant.dequantize_on_device``). ``keep_quantized`` swaps float layers for these where the file
stores a kernel type; ``quantize_blocks`` serves ``--quantize``."""
from __future__ import annotations

import logging
import threading
from typing import Any, Dict, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor, nn

from ..base.cpudot import cpu_dot, dot_code
from ..base.errors import CheckpointError, QuantError
from .kernels import QUANT
from .layers import Linear
from .npprefill import KERNEL_ROWS, TILE_BYTES, integer_prefill  # the torch-free prefill's
from .qtypes import kernel_qtype  # noqa: F401  (known here too)
from .quant import TYPES, check_blocks, dequantize_on_device, qtype_of, quantize, row_bytes

_quant = QUANT.select()
log = logging.getLogger("mdiedge.quant")


def _threads() -> int:
    return max(1, torch.get_num_threads())


_local = threading.local()


def _tile_buffer(floats: int) -> Tensor:
    """This thread's float32 buffer of at least ``floats`` values (prefill tiles)."""
    buffer = getattr(_local, "tile", None)
    if buffer is None or buffer.numel() < floats:
        buffer = _local.tile = torch.empty(max(floats, TILE_BYTES // 4))
    return buffer


def widens_on_device(held: Tensor) -> bool:
    """Whether blocks ``held`` are de-quantized on their device by torch (CUDA), not CPU kernels."""
    return held.device.type != "cpu"


class QuantLinear(nn.Module):
    """W held as ``qweight`` (uint8 (out, row_bytes)) of type ``qtype``, plus a float32 ``bias``
    where made ``with_bias`` (Qwen2's Q/K/V)."""

    def __init__(self, qweight: Tensor, qtype: str, in_features: int,
                 with_bias: bool = False) -> None:
        super().__init__()
        self.qtype = qtype_of(qtype).name
        self.in_features, self.out_features = in_features, int(qweight.shape[0])
        want = (self.out_features, row_bytes(self.qtype, in_features))
        if qweight.dtype != torch.uint8 or tuple(qweight.shape) != want:
            raise ValueError(f"{self.qtype} weight of {tuple(qweight.shape)} {qweight.dtype}, "
                             f"expected uint8 {want}")
        self.register_buffer("qweight", qweight, persistent=False)
        self.bias = nn.Parameter(torch.zeros(self.out_features), requires_grad=False) \
            if with_bias else None

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"qtype={self.qtype}"

    @torch.no_grad()
    def forward(self, x: Tensor) -> Tensor:
        """Inference only: nothing is recorded for autograd."""
        out = self.product(x)
        return out if self.bias is None else out + self.bias

    @torch.no_grad()
    def product(self, x: Tensor) -> Tensor:
        """The bias left out."""
        if widens_on_device(self.qweight):
            weight = dequantize_on_device(self.qweight, self.qtype, self.in_features)
            return torch.nn.functional.linear(x.float(), weight)  # (…, out)
        flat = x.reshape(-1, self.in_features).float().contiguous()  # (rows, in)
        out = torch.empty(flat.shape[0], self.out_features, dtype=torch.float32,
                          device=flat.device)  # (rows, out)
        dot = dot_code()
        if flat.shape[0] <= KERNEL_ROWS or integer_prefill(self.qtype, dot):
            _quant.matmul(flat, self.qweight, self.qtype, out, _threads(), dot)
        else:
            self._tiled(flat, out)
        return out.view(*x.shape[:-1], self.out_features)

    def _tiled(self, flat: Tensor, out: Tensor) -> None:
        """Prefill: W de-quantized a tile of rows at a time into this thread's one shared buffer."""
        step = max(1, min(self.out_features, TILE_BYTES // (4 * self.in_features)))
        buffer = _tile_buffer(step * self.in_features)
        for first in range(0, self.out_features, step):
            count = min(step, self.out_features - first)
            tile = buffer[:count * self.in_features].view(count, self.in_features)
            _quant.dequantize_rows(self.qweight, self.qtype, first, count, tile, _threads())
            torch.mm(flat, tile.t(), out=out[:, first:first + count])

    @staticmethod
    def fuse_group(layers: Sequence["QuantLinear"]) -> Optional["QuantGroup"]:
        """One product for ``layers`` of one input width, each of its own type; None for mixed
        widths."""
        if len({layer.in_features for layer in layers}) != 1:
            return None
        return QuantGroup(layers)

    def dequantized(self) -> Tensor:
        weight = torch.empty(self.out_features, self.in_features)
        _quant.dequantize_rows(self.qweight, self.qtype, 0, self.out_features, weight,
                               _threads())
        return weight


class QuantGroup:
    """Quantized layers of one input width as one product, outputs side by side. Each layer's blocks
    are read where they lie (a GGUF mapping: no copy) and of its own type (Q4_K_M's Q6_K V beside
    Q4_K Q and K). Not a module, so a block holding it does not count or move the bytes twice."""

    def __init__(self, layers: Sequence[QuantLinear]) -> None:
        self.layers = tuple(layers)
        self.in_features = self.layers[0].in_features

    def __call__(self, x: Tensor) -> Tensor:
        """Without biases (the caller adds them fused: ``block.Attention``)."""
        return torch.cat([layer.product(x) for layer in self.layers], -1)


class QuantEmbedding(nn.Module):

    def __init__(self, qweight: Tensor, qtype: str, dim: int) -> None:
        super().__init__()
        self.rows = QuantLinear(qweight, qtype, dim)  # shares its checks and its buffer

    @torch.no_grad()
    def forward(self, tokens: Tensor) -> Tensor:
        held = self.rows.qweight
        if widens_on_device(held):  # the tokens' rows widened on their device
            rows = held[tokens.reshape(-1).to(held.device)]  # (tokens, row_bytes)
            out = dequantize_on_device(rows, self.rows.qtype, self.rows.in_features)
            return out.view(*tokens.shape, self.rows.in_features)
        flat = tokens.reshape(-1).tolist()
        out = torch.empty(len(flat), self.rows.in_features)  # (tokens, dim)
        for i, token in enumerate(flat):
            _quant.dequantize_rows(self.rows.qweight, self.rows.qtype, int(token), 1,
                                   out[i:i + 1], 1)
        return out.view(*tokens.shape, self.rows.in_features)


def _parent(net: nn.Module, ours: str) -> Tuple[nn.Module, str]:
    """The module holding parameter ``ours`` ("layers.3.attn.wq.weight") and its attribute ("wq").
    """
    path = ours.rsplit(".", 1)[0]  # the layer: "layers.3.attn.wq"
    owner, _, attr = path.rpartition(".")
    return (net.get_submodule(owner) if owner else net), attr


def keep_quantized(net: nn.Module, source: Any, plan: Dict[str, str]) -> Set[str]:
    """Swap each float layer whose tensor ``source`` stores in a kernel type for a quantized one
    holding those bytes; the parameter names now held so (no float read needed). A tied head shares
    the embedding's bytes."""
    held: Set[str] = set()
    _log_widened(source, plan.values())
    for ours, theirs in plan.items():
        qtype = kernel_qtype(source, theirs)
        owner, attr = _parent(net, ours)
        layer = getattr(owner, attr, None)
        if qtype is None or not isinstance(layer, (nn.Linear, nn.Embedding)):
            continue
        raw = source.raw(theirs)
        try:
            check_blocks(raw, qtype)
        except QuantError as e:
            raise CheckpointError(f"{source.path}: tensor {theirs!r}: {e}") from None
        if isinstance(layer, nn.Embedding):
            setattr(owner, attr, QuantEmbedding(raw, qtype, layer.embedding_dim))
        else:
            setattr(owner, attr, QuantLinear(raw, qtype, layer.in_features,
                                             getattr(layer, "bias", None) is not None))
        held.add(ours)
        log_float_dots(qtype)
    _tie_quantized(net, held)
    return held


_logged_float_dots: Set[str] = set()


def log_float_dots(qtype: str) -> None:
    """Once per process and type: the q8 mode multiplies it in float32 here (no integer kernel on
    this CPU)."""
    if cpu_dot() != "q8" or not TYPES[qtype].act_block or qtype in _logged_float_dots \
            or qtype in _quant.q8_types():
        return
    _logged_float_dots.add(qtype)
    log.warning("%s weights have no integer kernel on this CPU (%s kernels): their products "
                "run in float32 under --cpu-dot q8", qtype, _quant.simd_path())


def _log_widened(source: Any, names: Any) -> None:
    """Once per type without a kernel: the tensors of it de-quantized to float32 as read."""
    qtype = getattr(source, "qtype", None)
    if qtype is None:
        return
    widened: Dict[str, list] = {}
    for name in names:
        stored = str(qtype(name)).upper()
        if stored != "F32" and not (stored in TYPES and TYPES[stored].native):
            widened.setdefault(stored, []).append(name)
    for stored, tensors in sorted(widened.items()):
        log.warning("%s: %d tensor(s) of type %s have no kernel and are de-quantized to "
                    "float32 at load: %s", getattr(source, "path", "model"), len(tensors),
                    stored, ", ".join(tensors))


def _tie_quantized(net: nn.Module, held: Set[str]) -> None:
    embed, head = getattr(net, "embed", None), getattr(net, "lm_head", None)
    if isinstance(embed, QuantEmbedding) and head is not None and getattr(
            net, "cfg").tie_embeddings:
        net.lm_head = embed.rows
        held.add("lm_head.weight")


def quantize_blocks(net: nn.Module, qtype: str) -> int:
    """``--quantize``: the count of the blocks' float linear layers quantized to ``qtype``; widths
    not a whole number of blocks stay float, biases too. Q/K/V and gate/up are fused again."""
    count = 0
    for name, layer in list(net.named_modules()):
        if not name.startswith("layers.") or type(layer) is not Linear \
                or layer.in_features % qtype_of(qtype).block:
            continue
        owner, attr = _parent(net, name + ".weight")
        made = QuantLinear(quantize_weight(layer.weight, qtype), qtype, layer.in_features,
                           layer.bias is not None)
        if layer.bias is not None:
            made.bias.data.copy_(layer.bias.detach())
        setattr(owner, attr, made)
        for fused in ("qkv", "gate_up"):  # float buffers of fused products: gone with them
            if getattr(owner, fused, None) is not None:
                setattr(owner, fused, None)
        count += 1
    fuse_projections = getattr(net, "fuse_projections", None)
    if count and fuse_projections is not None:  # the float groups now quantized ones
        fuse_projections()
    return count


def quantize_weight(weight: Tensor, qtype: str) -> Tensor:
    return quantize(weight.detach().float().cpu().contiguous(), qtype)
