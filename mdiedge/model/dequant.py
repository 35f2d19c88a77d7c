"""The reference de-quantizer of every type in ``mdiedge.model.quant.TYPES``: ggml's
``dequantize_row_<type>`` in torch operations, so that one code serves the CPU (numpy arrays pass
through ``torch.from_numpy``) and a CUDA device (the blocks widened where they lie, just before a
product). Each value equals the ``gguf`` package's ``gguf.quants.dequantize`` (the same float32
operations in the same order; tests compare them bit for bit). Layouts are described in
``mdiedge.model.quant``'s docstring."""
from __future__ import annotations

from typing import Callable, Dict, Tuple

import torch
from torch import Tensor

from .dequantvalues import IQ4_VALUES



def _f16(b: Tensor, at: int) -> Tensor:
    """The f16 field at byte ``at`` of every block, as float32 (blocks, 1)."""
    return b[:, at:at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: Tensor) -> Tensor:
    """Low nibbles of each run of bytes, then its high nibbles: (…, b) bytes to (…, 2b)."""
    return torch.cat([qs & 0x0F, qs >> 4], -1)


def _shifted(q: Tensor, shifts: Tuple[int, ...]) -> Tensor:
    """``q`` (…, n) shifted right by each of ``shifts``: (…, len(shifts), n)."""
    by = torch.tensor(shifts, dtype=q.dtype, device=q.device).view(-1, 1)
    return q.unsqueeze(-2) >> by


def _bits(qh: Tensor) -> Tensor:
    """Bits of bytes (…, n), least significant first: (…, 8 n) of 0 or 1."""
    return (_shifted(qh, tuple(range(8))) & 1).transpose(-1, -2).reshape(*qh.shape[:-1], -1)


def _k4_scales(scales: Tensor) -> Tuple[Tensor, Tensor]:
    """Q4_K's and Q5_K's eight 6-bit scales and mins per block (ggml's get_scale_min_k4)."""
    q = scales.to(torch.int32)
    sc = torch.cat([q[:, 0:4] & 63, (q[:, 8:12] & 0x0F) | ((q[:, 0:4] >> 6) << 4)], 1)
    mn = torch.cat([q[:, 4:8] & 63, (q[:, 8:12] >> 4) | ((q[:, 4:8] >> 6) << 4)], 1)
    return sc.float(), mn.float()


def _iq4(idx: Tensor) -> Tensor:
    table = torch.tensor(IQ4_VALUES, dtype=torch.float32, device=idx.device)
    return table[idx.long()]


def _q8_0(b: Tensor) -> Tensor:
    return b[:, 2:].contiguous().view(torch.int8).float() * _f16(b, 0)


def _q4_0(b: Tensor) -> Tensor:
    return _f16(b, 0) * (_nibbles(b[:, 2:]).float() - 8)


def _q4_1(b: Tensor) -> Tensor:
    return _f16(b, 0) * _nibbles(b[:, 4:]).float() + _f16(b, 2)


def _five(qh: Tensor, qs: Tensor) -> Tensor:
    """Q5_0's and Q5_1's 32 five-bit quants: nibbles of qs, fifth bits from qh's 32 bits."""
    return (_nibbles(qs) | (_bits(qh) << 4)).float()


def _q5_0(b: Tensor) -> Tensor:
    return _f16(b, 0) * (_five(b[:, 2:6], b[:, 6:]) - 16)


def _q5_1(b: Tensor) -> Tensor:
    return _f16(b, 0) * _five(b[:, 4:8], b[:, 8:]) + _f16(b, 2)


def _q2_k(b: Tensor) -> Tensor:
    scales = b[:, :16]
    dl = (_f16(b, 80) * (scales & 0x0F).float()).unsqueeze(-1)  # (n, 16, 1)
    ml = (_f16(b, 82) * (scales >> 4).float()).unsqueeze(-1)
    q = _shifted(b[:, 16:80].reshape(-1, 2, 32), (0, 2, 4, 6)) & 3  # (n, half, shift, 32)
    return (dl * q.reshape(-1, 16, 16).float() - ml).reshape(-1, 256)


def _q3_k(b: Tensor) -> Tensor:
    packed = b[:, 96:108]
    low = _nibbles(packed[:, :8])  # scales 0..7 low nibbles, then 8..15
    high = (_shifted(packed[:, 8:12], (0, 2, 4, 6)) & 3).reshape(-1, 16)
    scales = (low | (high << 4)).float() - 32
    dl = (_f16(b, 108) * scales).unsqueeze(-1)  # (n, 16, 1)
    ql = _shifted(b[:, 32:96].reshape(-1, 2, 32), (0, 2, 4, 6)) & 3  # (n, half, shift, 32)
    hbit = _shifted(b[:, :32], tuple(range(8))) & 1  # (n, 8, 32): bit 4 half + shift
    q = ql.reshape(-1, 16, 16).float() - ((hbit ^ 1) << 2).reshape(-1, 16, 16).float()
    return (dl * q).reshape(-1, 256)


def _q4_k(b: Tensor) -> Tensor:
    sc, mn = _k4_scales(b[:, 4:16])
    q = _nibbles(b[:, 16:].reshape(-1, 4, 32)).reshape(-1, 8, 32).float()
    d, dmin = _f16(b, 0) * sc, _f16(b, 2) * mn
    return (d[:, :, None] * q - dmin[:, :, None]).reshape(-1, 256)


def _q5_k(b: Tensor) -> Tensor:
    sc, mn = _k4_scales(b[:, 4:16])
    low = _nibbles(b[:, 48:].reshape(-1, 4, 32)).reshape(-1, 8, 32)
    high = _shifted(b[:, 16:48], tuple(range(8))) & 1  # (n, 8, 32): sub-block i's bit i
    q = (low | (high << 4)).float()
    d, dmin = _f16(b, 0) * sc, _f16(b, 2) * mn
    return (d[:, :, None] * q - dmin[:, :, None]).reshape(-1, 256)


def _q6_k(b: Tensor) -> Tensor:
    ql = b[:, :128].reshape(-1, 2, 2, 32)
    qh = b[:, 128:192].reshape(-1, 2, 1, 32).to(torch.int32)
    low = torch.cat([ql & 0x0F, ql >> 4], 2).to(torch.int32)  # (n, half, quarter, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.int32, device=b.device).view(1, 1, 4, 1)
    q = (low | (((qh >> shifts) & 3) << 4)).float() - 32
    scale = b[:, 192:208].contiguous().view(torch.int8).float() * _f16(b, 208)
    return (q.reshape(-1, 16, 16) * scale[:, :, None]).reshape(-1, 256)


def _iq4_nl(b: Tensor) -> Tensor:
    return _f16(b, 0) * _iq4(_nibbles(b[:, 2:]))


def _iq4_xs(b: Tensor) -> Tensor:
    high = (_shifted(b[:, 2:4].contiguous().view(torch.int16).to(torch.int32),
                     tuple(range(0, 16, 2))) & 3).reshape(-1, 8)
    low = (_shifted(b[:, 4:8], (0, 4)) & 0x0F).transpose(1, 2).reshape(-1, 8)
    dl = (_f16(b, 0) * ((low.to(torch.int32) | (high << 4)).float() - 32)).unsqueeze(-1)
    return (dl * _iq4(_nibbles(b[:, 8:].reshape(-1, 8, 16)))).reshape(-1, 256)


def _f32(b: Tensor) -> Tensor:
    return b.contiguous().view(torch.float32).clone()


def _f16_values(b: Tensor) -> Tensor:
    return b.contiguous().view(torch.float16).float()


def _bf16(b: Tensor) -> Tensor:
    return (b.contiguous().view(torch.int16).to(torch.int32) << 16).view(torch.float32)


DEQUANTIZERS: Dict[str, Callable[[Tensor], Tensor]] = {
    "F32": _f32, "F16": _f16_values, "BF16": _bf16, "Q4_0": _q4_0, "Q4_1": _q4_1,
    "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0, "Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k,
    "Q5_K": _q5_k, "Q6_K": _q6_k, "IQ4_NL": _iq4_nl, "IQ4_XS": _iq4_xs}


def blocks_to_float(blocks: Tensor, name: str) -> Tensor:
    """Every block of ``blocks`` (count, block_bytes) uint8, on any device, de-quantized:
    (count, weights per block) float32 on that device."""
    return DEQUANTIZERS[name](blocks)
