"""The reference de-quantizer in numpy: ``mdiedge.model.dequant``'s operations (ggml's
``dequantize_row_<type>``) one for one, in float32 and in the same order, for the torch-free
CPU path; tests compare the two bit for bit. Layouts: ``mdiedge.model.quant``'s docstring."""
from __future__ import annotations

from typing import Callable, Dict, Tuple

import numpy as np

from .dequantvalues import IQ4_VALUES

_IQ4 = np.array(IQ4_VALUES, dtype=np.float32)


def _f16(b: np.ndarray, at: int) -> np.ndarray:
    """The f16 field at byte ``at`` of every block, as float32 (blocks, 1)."""
    return np.ascontiguousarray(b[:, at:at + 2]).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Low nibbles of each run of bytes, then its high nibbles: (…, b) bytes to (…, 2b)."""
    return np.concatenate([qs & 0x0F, qs >> 4], -1)


def _shifted(q: np.ndarray, shifts: Tuple[int, ...]) -> np.ndarray:
    """``q`` (…, n) shifted right by each of ``shifts``: (…, len(shifts), n)."""
    by = np.array(shifts, dtype=q.dtype).reshape(-1, 1)
    return q[..., None, :] >> by


def _bits(qh: np.ndarray) -> np.ndarray:
    """Bits of bytes (…, n), least significant first: (…, 8 n) of 0 or 1."""
    bits = _shifted(qh, tuple(range(8))) & 1  # (…, 8, n)
    return np.swapaxes(bits, -1, -2).reshape(*qh.shape[:-1], -1)


def _f(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float32)


def _k4_scales(scales: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    q = scales.astype(np.int32)
    sc = np.concatenate([q[:, 0:4] & 63, (q[:, 8:12] & 0x0F) | ((q[:, 0:4] >> 6) << 4)], 1)
    mn = np.concatenate([q[:, 4:8] & 63, (q[:, 8:12] >> 4) | ((q[:, 4:8] >> 6) << 4)], 1)
    return _f(sc), _f(mn)


def _q8_0(b: np.ndarray) -> np.ndarray:
    return _f(np.ascontiguousarray(b[:, 2:]).view(np.int8)) * _f16(b, 0)


def _q4_0(b: np.ndarray) -> np.ndarray:
    return _f16(b, 0) * (_f(_nibbles(b[:, 2:])) - np.float32(8))


def _q4_1(b: np.ndarray) -> np.ndarray:
    return _f16(b, 0) * _f(_nibbles(b[:, 4:])) + _f16(b, 2)


def _five(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    return _f(_nibbles(qs) | (_bits(qh) << 4))


def _q5_0(b: np.ndarray) -> np.ndarray:
    return _f16(b, 0) * (_five(b[:, 2:6], b[:, 6:]) - np.float32(16))


def _q5_1(b: np.ndarray) -> np.ndarray:
    return _f16(b, 0) * _five(b[:, 4:8], b[:, 8:]) + _f16(b, 2)


def _q2_k(b: np.ndarray) -> np.ndarray:
    scales = b[:, :16]
    dl = (_f16(b, 80) * _f(scales & 0x0F))[..., None]  # (n, 16, 1)
    ml = (_f16(b, 82) * _f(scales >> 4))[..., None]
    q = _shifted(b[:, 16:80].reshape(-1, 2, 32), (0, 2, 4, 6)) & 3  # (n, half, shift, 32)
    return (dl * _f(q.reshape(-1, 16, 16)) - ml).reshape(-1, 256)


def _q3_k(b: np.ndarray) -> np.ndarray:
    packed = b[:, 96:108]
    low = _nibbles(packed[:, :8])
    high = (_shifted(packed[:, 8:12], (0, 2, 4, 6)) & 3).reshape(-1, 16)
    scales = _f(low | (high << 4)) - np.float32(32)
    dl = (_f16(b, 108) * scales)[..., None]  # (n, 16, 1)
    ql = _shifted(b[:, 32:96].reshape(-1, 2, 32), (0, 2, 4, 6)) & 3
    hbit = _shifted(b[:, :32], tuple(range(8))) & 1  # (n, 8, 32)
    q = _f(ql.reshape(-1, 16, 16)) - _f(((hbit ^ 1) << 2).reshape(-1, 16, 16))
    return (dl * q).reshape(-1, 256)


def _q4_k(b: np.ndarray) -> np.ndarray:
    sc, mn = _k4_scales(b[:, 4:16])
    q = _f(_nibbles(b[:, 16:].reshape(-1, 4, 32)).reshape(-1, 8, 32))
    d, dmin = _f16(b, 0) * sc, _f16(b, 2) * mn
    return (d[:, :, None] * q - dmin[:, :, None]).reshape(-1, 256)


def _q5_k(b: np.ndarray) -> np.ndarray:
    sc, mn = _k4_scales(b[:, 4:16])
    low = _nibbles(b[:, 48:].reshape(-1, 4, 32)).reshape(-1, 8, 32)
    high = _shifted(b[:, 16:48], tuple(range(8))) & 1  # (n, 8, 32)
    q = _f(low | (high << 4))
    d, dmin = _f16(b, 0) * sc, _f16(b, 2) * mn
    return (d[:, :, None] * q - dmin[:, :, None]).reshape(-1, 256)


def _q6_k(b: np.ndarray) -> np.ndarray:
    ql = b[:, :128].reshape(-1, 2, 2, 32)
    qh = b[:, 128:192].reshape(-1, 2, 1, 32).astype(np.int32)
    low = np.concatenate([ql & 0x0F, ql >> 4], 2).astype(np.int32)  # (n, half, quarter, 32)
    shifts = np.array([0, 2, 4, 6], dtype=np.int32).reshape(1, 1, 4, 1)
    q = _f(low | (((qh >> shifts) & 3) << 4)) - np.float32(32)
    scale = _f(np.ascontiguousarray(b[:, 192:208]).view(np.int8)) * _f16(b, 208)
    return (q.reshape(-1, 16, 16) * scale[:, :, None]).reshape(-1, 256)


def _iq4_nl(b: np.ndarray) -> np.ndarray:
    return _f16(b, 0) * _IQ4[_nibbles(b[:, 2:])]


def _iq4_xs(b: np.ndarray) -> np.ndarray:
    scales_h = np.ascontiguousarray(b[:, 2:4]).view(np.int16).astype(np.int32)
    high = (_shifted(scales_h, tuple(range(0, 16, 2))) & 3).reshape(-1, 8)
    low = np.swapaxes(_shifted(b[:, 4:8], (0, 4)) & 0x0F, 1, 2).reshape(-1, 8)
    dl = (_f16(b, 0) * (_f(low.astype(np.int32) | (high << 4)) - np.float32(32)))[..., None]
    return (dl * _IQ4[_nibbles(b[:, 8:].reshape(-1, 8, 16))]).reshape(-1, 256)


def _f32(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float32).copy()


def _f16_values(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _bf16(b: np.ndarray) -> np.ndarray:
    return (np.ascontiguousarray(b).view(np.uint16).astype(np.uint32) << 16).view(np.float32)


DEQUANTIZERS: Dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "F32": _f32, "F16": _f16_values, "BF16": _bf16, "Q4_0": _q4_0, "Q4_1": _q4_1,
    "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0, "Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k,
    "Q5_K": _q5_k, "Q6_K": _q6_k, "IQ4_NL": _iq4_nl, "IQ4_XS": _iq4_xs}


def blocks_to_float(blocks: np.ndarray, name: str) -> np.ndarray:
    """Every block of ``blocks`` (count, block_bytes) uint8 de-quantized: (count, weights
    per block) float32."""
    return np.ascontiguousarray(DEQUANTIZERS[name](blocks), dtype=np.float32)
