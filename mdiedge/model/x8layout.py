"""The x8 layout of a quantized matrix, in numpy: 8 consecutive rows interleaved block by block,
so that a vector kernel multiplies 4 bytes of an activation by the same 4 bytes of all 8 rows
in one instruction (``ext/quant_q8.h``, ``qm_pack_x8``, which this reproduces byte for byte:
the twin's ``pack_x8`` and the tests' reference). Per block of a group: for Q4_K the 8 rows'
d and dmin (f16), the sub-blocks' 6-bit scales (one byte per row), their minimums in pairs of
sub-blocks, then the quants 4 bytes of each row at a time; for Q4_0, Q4_1 and Q8_0 the rows'
d (and Q4_1's m), then the quants 4 bytes of each row at a time."""
from __future__ import annotations

from typing import Any, Dict

import numpy as np

from ..base.errors import QuantError
from .arrays import contiguous_cpu, ndim

GROUP = 8  # rows interleaved
Q4K_BLOCK_BYTES = 144
# the 32-weight types: (block bytes, bytes of scales first, bytes of quants)
BLOCKS32 = {"Q8_0": (34, 2, 32), "Q4_0": (18, 2, 16), "Q4_1": (20, 4, 16)}
LAYOUTS = ("Q8_0", "Q4_0", "Q4_1", "Q4_K")  # in ext/quant.h's type order, as it names them


def _scales_mins(packed: np.ndarray) -> np.ndarray:
    """Q4_K's 12 packed scale bytes (..., 12) as (..., 2, 8): the 6-bit scales, then the mins
    (ggml's get_scale_min_k4)."""
    q = packed.astype(np.uint8)
    low, high = q[..., :4], q[..., 4:8]
    rest = q[..., 8:12]
    scales = np.concatenate([low & 63, (rest & 0xF) | ((low >> 6) << 4)], axis=-1)
    mins = np.concatenate([high & 63, (rest >> 4) | ((high >> 6) << 4)], axis=-1)
    return np.stack([scales, mins], axis=-2)


def pack_q4k(w: np.ndarray) -> np.ndarray:
    """Rows w (n, k / 256 * 144) of Q4_K blocks, n a multiple of 8, in the x8 layout:
    (n / 8, k / 256 * 1184) uint8."""
    n, row_bytes = w.shape
    if n % GROUP or row_bytes % Q4K_BLOCK_BYTES:
        raise QuantError(f"Q4_K matrix {(n, row_bytes)} has no x8 layout: Q4_K rows of whole "
                         f"blocks, a multiple of {GROUP} of them")
    nb = row_bytes // Q4K_BLOCK_BYTES
    blocks = w.reshape(n // GROUP, GROUP, nb, Q4K_BLOCK_BYTES).transpose(0, 2, 1, 3)
    lead = blocks.shape[:2]
    sm = _scales_mins(blocks[..., 4:16])  # (g, nb, row, 2, sub-block)
    parts: Dict[str, np.ndarray] = {
        "d": blocks[..., 0:2],
        "dmin": blocks[..., 2:4],
        "scales": sm[..., 0, :].swapaxes(-1, -2),  # (g, nb, sub-block, row)
        "mins": sm[..., 1, :].reshape(*lead, GROUP, 4, 2).transpose(0, 1, 3, 2, 4),
        "quants": blocks[..., 16:].reshape(*lead, GROUP, 4, 8, 4).transpose(0, 1, 3, 4, 2, 5),
    }
    flat = [np.ascontiguousarray(p).reshape(*lead, -1) for p in parts.values()]
    return np.ascontiguousarray(np.concatenate(flat, axis=-1).reshape(n // GROUP, -1))


def pack32(w: np.ndarray, qtype: str) -> np.ndarray:
    """Rows w (n, k / 32 * block bytes) of a 32-weight type of ``BLOCKS32``, n a multiple of 8,
    in the x8 layout: (n / 8, k / 32 * 8 * block bytes) uint8."""
    block, scales, quants = BLOCKS32[qtype]
    n, row_bytes = w.shape
    if n % GROUP or row_bytes % block:
        raise QuantError(f"{qtype} matrix {(n, row_bytes)} has no x8 layout: {qtype} rows of "
                         f"whole blocks, a multiple of {GROUP} of them")
    nb = row_bytes // block
    blocks = w.reshape(n // GROUP, GROUP, nb, block).transpose(0, 2, 1, 3)
    lead = blocks.shape[:2]
    parts = [blocks[..., at:at + 2] for at in range(0, scales, 2)]  # (g, nb, row, 2) each
    parts.append(blocks[..., scales:].reshape(*lead, GROUP, quants // 4, 4).swapaxes(-2, -3))
    flat = [np.ascontiguousarray(p).reshape(*lead, -1) for p in parts]
    return np.ascontiguousarray(np.concatenate(flat, axis=-1).reshape(n // GROUP, -1))


def check_pack(w: Any, qtype: str, threads: int = 1) -> None:
    """``pack_x8``'s arguments (both modules'): contiguous uint8 CPU rows of a type with a
    layout, a multiple of 8 of them, of whole blocks, and a thread count of at least 1;
    QuantError naming what is wrong."""
    if qtype not in LAYOUTS:
        raise QuantError(f"{qtype} has no x8 layout: only {', '.join(LAYOUTS)}")
    if not (contiguous_cpu(w, "uint8") and ndim(w) == 2):
        raise QuantError(f"{qtype} matrix {tuple(getattr(w, 'shape', ()))} "
                         f"{getattr(w, 'dtype', type(w).__name__)} is not contiguous uint8 CPU "
                         f"rows")
    block = Q4K_BLOCK_BYTES if qtype == "Q4_K" else BLOCKS32[qtype][0]
    if w.shape[0] % GROUP or w.shape[1] % block or w.shape[1] == 0:
        raise QuantError(f"{qtype} matrix {tuple(w.shape)} has no x8 layout: {qtype} rows of "
                         f"whole blocks, a multiple of {GROUP} of them")
    if not isinstance(threads, int) or threads < 1:
        raise QuantError(f"threads must be a positive int, got {threads!r}")


def pack(w: np.ndarray, qtype: str) -> np.ndarray:
    """Rows w of ``qtype`` in the x8 layout (``check_pack``'s arguments)."""
    check_pack(w, qtype)
    return pack_q4k(w) if qtype == "Q4_K" else pack32(w, qtype)
