"""Quantized weights as GGUF files hold them (ggml's block layouts): the torch forms.

The torch-free facts live in ``mdiedge.model.qtypes`` and are re-exported here (types, ggml ids,
block sizes, scale offsets, ``TYPES``' kernel codes that ``ext/quant.h`` must match,
``row_bytes``, the numpy ``dequantize_array`` / ``quantize_array`` and the quantized product's
argument checks). Added here: ``dequantize``, ``dequantize_on_device`` (CUDA), ``quantize`` and
``quantized_activations`` on tensors.

A weight of ``out`` rows and ``in`` columns is uint8 (out, row_bytes): each row ``in / block``
ggml ``block_<type>`` structs (ggml-common.h):

- F16, BF16: one 2-byte value per weight.
- Q8_0 ``{f16 d; int8 qs[32]}``: w = d * q.
- Q4_0 ``{f16 d; uint8 qs[16]}``: element i < 16 is the low nibble of qs[i], element 16 + i
  the high one; w = d * (q - 8).
- Q4_1 ``{f16 d, m; uint8 qs[16]}``: nibbles as Q4_0; w = d * q + m.
- Q5_0 ``{f16 d; uint8 qh[4]; uint8 qs[16]}``: nibbles as Q4_0, bit i of qh (little-endian)
  element i's fifth bit; w = d * (q - 16). Q5_1 ``{f16 d, m; uint8 qh[4]; uint8 qs[16]}``:
  w = d * q + m.
- IQ4_NL ``{f16 d; uint8 qs[16]}``: nibbles as Q4_0 index 16 fixed values; w = d * value.
- Q2_K ``{uint8 scales[16]; uint8 qs[64]; f16 d, dmin}``: 256 elements in two halves of
  128; element 32 j + l of a half is bits 2j of its qs[l]; per 16 elements a 4-bit scale and
  min (low and high nibble); w = d * sc * q - dmin * m.
- Q3_K ``{uint8 hmask[32]; uint8 qs[64]; uint8 scales[12]; f16 d}``: Q2_K's low bits, the
  third from bit 4 half + j of hmask[l] (clear: minus 4); 16 packed 6-bit scales less 32.
- Q4_K ``{f16 d, dmin; uint8 scales[12]; uint8 qs[128]}``: 256 elements, eight sub-blocks
  of 32 with 6-bit scales and mins packed in ``scales``; 64 elements per 32 bytes of qs (low
  nibbles, then high); w = d * sc * q - dmin * m.
- Q5_K ``{f16 d, dmin; uint8 scales[12]; uint8 qh[32]; uint8 qs[128]}``: Q4_K's, with bit i
  of qh[l] the fifth bit of sub-block i's element l.
- Q6_K ``{uint8 ql[128], qh[64]; int8 scales[16]; f16 d}``: 256 elements in two halves of
  128, each 6-bit quant four bits from ql and two from qh; w = d * scale * (q - 32) with one
  int8 scale per 16 elements.
- IQ4_XS ``{f16 d; uint16 scales_h; uint8 scales_l[4]; uint8 qs[128]}``: eight IQ4_NL-like
  sub-blocks of 32, each scaled by d * (6-bit scale - 32).
"""
from __future__ import annotations

from typing import Any

import torch

from .dequant import blocks_to_float
from .qtypes import (KERNEL_TYPES, QUANTIZERS, TYPES, check_blocks, check_compiled,
                     dequantize_array, qtype_of, quantize_array, row_bytes)

# with the names of .qtypes that callers know from this module
__all__ = ["KERNEL_TYPES", "QUANTIZERS", "TYPES", "check_blocks", "check_compiled", "dequantize",
           "dequantize_array", "dequantize_on_device", "qtype_of", "quantize", "quantize_array",
           "quantized_activations", "row_bytes"]


def quantized_activations(x: torch.Tensor, block: int) -> torch.Tensor:
    """x (rows, k) as the q8 kernels see it (``ext/quant_q8.h``), float32: per 32 values (Q8_0) d =
    max|x| / 127, x -> d * round(x / d); per 256 (Q8_K) d = -m / 127, m the largest-magnitude value,
    quants capped at 127. Halves round away from zero, as the kernels do."""
    rows, k = x.shape
    blocks = x.reshape(rows, k // block, block)
    if block == 32:
        d = blocks.abs().amax(-1, keepdim=True) / 127
        inverse = torch.where(d != 0, 1 / d, torch.zeros_like(d))
        inverse = torch.where(inverse.isinf(), torch.zeros_like(d), inverse)  # a tiny block: 0
    else:
        top = torch.gather(blocks, -1, blocks.abs().argmax(-1, keepdim=True))
        inverse = torch.where(top != 0, -127 / top, torch.zeros_like(top))
        inverse = torch.where(inverse.isinf(), torch.zeros_like(top), inverse)
        d = torch.where(inverse != 0, 1 / inverse, torch.zeros_like(inverse))
    scaled = blocks * inverse
    q = torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)
    return (q.clamp(max=127) * d).reshape(rows, k)


def dequantize(data: Any, qtype: str, in_features: int) -> torch.Tensor:
    """``qtypes.dequantize_array`` as a tensor; blocks with a non-finite scale refused."""
    return torch.from_numpy(dequantize_array(data, qtype, in_features))


def dequantize_on_device(qweight: torch.Tensor, qtype: str, in_features: int) -> torch.Tensor:
    """``qweight``'s float32 weight computed on its device (the CUDA path of ``qlayers``)."""
    t = qtype_of(qtype)
    if qweight.dtype != torch.uint8 or qweight.dim() != 2 or \
            qweight.shape[1] != row_bytes(t.name, in_features):
        raise ValueError(f"{t.name} rows {tuple(qweight.shape)} {qweight.dtype} do not hold "
                         f"{in_features} weights each")
    values = blocks_to_float(qweight.reshape(-1, t.block_bytes), t.name)  # (blocks, block)
    return values.reshape(qweight.shape[0], in_features)


def quantize(weight: Any, qtype: str) -> torch.Tensor:
    """The bytes llama.cpp's reference quantizer writes, uint8 (out, row_bytes), as a tensor."""
    w = weight.detach().cpu().float() if isinstance(weight, torch.Tensor) else weight
    return torch.from_numpy(quantize_array(w, qtype))
