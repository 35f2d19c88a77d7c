"""ggml's quantized blocks de-quantized with torch operations on the tensor's own device: the
CUDA path of ``mdiedge.model.qlayers`` (a Jetson's GPU in FP32 only). The blocks stay in GPU
memory as the file holds them (a quarter to an eighth of float32's bytes) and each product
widens its weight to float32 on the device just before it multiplies, so activations,
accumulators and outputs stay float32.

The same arithmetic as the reference de-quantizer of ``mdiedge.model.quant`` (ggml's
``dequantize_row_<type>``, layouts in that module's docstring), there in numpy on the CPU, here
in torch: equal to it value for value (tests compare them on the CPU).
"""
from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from .quant import qtype_of, row_bytes


def _f16(blocks: Tensor, at: int) -> Tensor:
    """The f16 field at byte ``at`` of every block, as float32 (blocks, 1)."""
    return blocks[:, at:at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: Tensor) -> Tensor:
    """Low nibbles of each run of bytes, then its high nibbles: (n, b) bytes to (n, 2b)."""
    return torch.cat([qs & 0x0F, qs >> 4], -1)


def _k4_scales(scales: Tensor) -> Tuple[Tensor, Tensor]:
    """Q4_K's eight 6-bit scales and mins of each block (ggml's get_scale_min_k4)."""
    q = scales.to(torch.int32)
    sc = torch.cat([q[:, 0:4] & 63, (q[:, 8:12] & 0x0F) | ((q[:, 0:4] >> 6) << 4)], 1)
    mn = torch.cat([q[:, 4:8] & 63, (q[:, 8:12] >> 4) | ((q[:, 4:8] >> 6) << 4)], 1)
    return sc.float(), mn.float()


def _q4_k(b: Tensor) -> Tensor:
    sc, mn = _k4_scales(b[:, 4:16])
    q = _nibbles(b[:, 16:].reshape(-1, 4, 32)).reshape(-1, 8, 32).float()
    d, dmin = _f16(b, 0) * sc, _f16(b, 2) * mn
    return (d[:, :, None] * q - dmin[:, :, None]).reshape(-1, 256)


def _q6_k(b: Tensor) -> Tensor:
    ql = b[:, :128].reshape(-1, 2, 2, 32)
    qh = b[:, 128:192].reshape(-1, 2, 1, 32).to(torch.int32)
    low = torch.cat([ql & 0x0F, ql >> 4], 2).to(torch.int32)  # (n, half, quarter, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.int32, device=b.device).view(1, 1, 4, 1)
    high = (qh >> shifts) & 3
    q = (low | (high << 4)).float() - 32
    scale = b[:, 192:208].contiguous().view(torch.int8).float() * _f16(b, 208)
    return (q.reshape(-1, 16, 16) * scale[:, :, None]).reshape(-1, 256)


def _blocks(b: Tensor, name: str) -> Tensor:
    """Every block of ``b`` (blocks, block_bytes) de-quantized: (blocks, block) float32."""
    if name == "Q8_0":
        return _f16(b, 0) * b[:, 2:].contiguous().view(torch.int8).float()
    if name == "Q4_0":
        return _f16(b, 0) * (_nibbles(b[:, 2:]).float() - 8)
    if name == "Q4_1":
        return _f16(b, 0) * _nibbles(b[:, 4:]).float() + _f16(b, 2)
    if name == "Q4_K":
        return _q4_k(b)
    if name == "Q6_K":
        return _q6_k(b)
    raise ValueError(f"no device de-quantizer for {name}")


def dequantize_on_device(qweight: Tensor, qtype: str, in_features: int) -> Tensor:
    """The float32 weight (rows, in) that ``qweight`` (uint8 (rows, row_bytes), any device)
    encodes, computed on ``qweight``'s device."""
    t = qtype_of(qtype)
    if qweight.dtype != torch.uint8 or qweight.dim() != 2 or \
            qweight.shape[1] != row_bytes(t.name, in_features):
        raise ValueError(f"{t.name} rows {tuple(qweight.shape)} {qweight.dtype} do not hold "
                         f"{in_features} weights each")
    values = _blocks(qweight.reshape(-1, t.block_bytes), t.name)  # (blocks, block)
    return values.reshape(qweight.shape[0], in_features)
