"""The x8 layout of a quantized matrix, in numpy: 8 consecutive rows interleaved block by block,
so that a vector kernel multiplies 4 bytes of an activation by the same 4 bytes of all 8 rows
in one instruction (``ext/quant_q8.h``, ``qm_pack_x8``, which this reproduces byte for byte:
the twin's ``pack_x8`` and the tests' reference). Per block of a group: for Q4_K the 8 rows'
d and dmin (f16), the sub-blocks' 6-bit scales (one byte per row), their minimums in pairs of
sub-blocks, then the quants 4 bytes of each row at a time; for Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL
and Q8_0 the rows' d (and Q4_1's and Q5_1's m), then the quants 4 bytes of each row at a time
(Q5_0's and Q5_1's fifth bits after them, a 32-bit mask per 32 nibbles); for IQ4_XS the rows'
d, their sub-blocks' scales (less 32, int8) in pairs of sub-blocks as Q4_K's minimums, then
the quants as Q4_K's."""
from __future__ import annotations

from typing import Any, List, Tuple

import numpy as np

from ..base.errors import QuantError
from .arrays import contiguous_cpu, ndim, numpy_view
from .qtypes import TYPES

GROUP = 8  # rows interleaved
SCALE_BYTES32 = {"Q8_0": 2, "Q4_0": 2, "Q4_1": 4, "Q5_0": 2, "Q5_1": 4,
                 "IQ4_NL": 2}  # the 32-weight types' f16 scales, first in a block
LAYOUTS = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "IQ4_NL",
           "IQ4_XS")  # in ext/quant.h's type order, its names


def _scales_mins(packed: np.ndarray) -> np.ndarray:
    """Q4_K's 12 packed scale bytes (..., 12) as (..., 2, 8): the 6-bit scales, then the mins
    (ggml's get_scale_min_k4)."""
    q = packed.astype(np.uint8)
    low, high = q[..., :4], q[..., 4:8]
    rest = q[..., 8:12]
    scales = np.concatenate([low & 63, (rest & 0xF) | ((low >> 6) << 4)], axis=-1)
    mins = np.concatenate([high & 63, (rest >> 4) | ((high >> 6) << 4)], axis=-1)
    return np.stack([scales, mins], axis=-2)


def _groups(w: np.ndarray, qtype: str) -> np.ndarray:
    """Rows w as (groups, blocks, 8 rows, block bytes)."""
    n, block = w.shape[0], TYPES[qtype].block_bytes
    return w.reshape(n // GROUP, GROUP, -1, block).transpose(0, 2, 1, 3)


def _joined(parts: List[np.ndarray], n: int) -> np.ndarray:
    """Each group block's parts (groups, blocks, ...) one after another: (n / 8, bytes)."""
    lead = parts[0].shape[:2]
    flat = [np.ascontiguousarray(p).reshape(*lead, -1) for p in parts]
    return np.ascontiguousarray(np.concatenate(flat, axis=-1).reshape(n // GROUP, -1))


def pack_q4k(w: np.ndarray) -> np.ndarray:
    """Rows w (n, k / 256 * 144) of Q4_K blocks, n a multiple of 8, in the x8 layout:
    (n / 8, k / 256 * 1184) uint8."""
    blocks = _groups(w, "Q4_K")
    lead = blocks.shape[:2]
    sm = _scales_mins(blocks[..., 4:16])  # (g, nb, row, 2, sub-block)
    return _joined([
        blocks[..., 0:2],  # d
        blocks[..., 2:4],  # dmin
        sm[..., 0, :].swapaxes(-1, -2),  # scales (g, nb, sub-block, row)
        sm[..., 1, :].reshape(*lead, GROUP, 4, 2).transpose(0, 1, 3, 2, 4),  # mins in pairs
        blocks[..., 16:].reshape(*lead, GROUP, 4, 8, 4).transpose(0, 1, 3, 4, 2, 5),  # quants
    ], w.shape[0])


def _iq4xs_scales(blocks: np.ndarray) -> np.ndarray:
    """IQ4_XS blocks' (..., 136) eight sub-block scales less 32 (..., 8), int8 as uint8 bytes."""
    ib = np.arange(8)
    high = blocks[..., 2].astype(np.uint16) | (blocks[..., 3].astype(np.uint16) << 8)
    low = (blocks[..., 4 + ib // 2] >> (4 * (ib % 2)).astype(np.uint8)) & 0xF
    six = low.astype(np.int16) | (((high[..., None] >> (2 * ib).astype(np.uint16)) & 3) << 4)
    return (six - 32).astype(np.int8).view(np.uint8)


def pack_iq4xs(w: np.ndarray) -> np.ndarray:
    """Rows w (n, k / 256 * 136) of IQ4_XS blocks, n a multiple of 8, in the x8 layout:
    (n / 8, k / 256 * 1104) uint8."""
    blocks = _groups(w, "IQ4_XS")
    lead = blocks.shape[:2]
    return _joined([
        blocks[..., 0:2],  # d
        _iq4xs_scales(blocks).reshape(*lead, GROUP, 4, 2).transpose(0, 1, 3, 2, 4),  # pairs
        blocks[..., 8:].reshape(*lead, GROUP, 4, 8, 4).transpose(0, 1, 3, 4, 2, 5),  # quants
    ], w.shape[0])


def pack32(w: np.ndarray, qtype: str) -> np.ndarray:
    """Rows w (n, k / 32 * block bytes) of a 32-weight type of ``SCALE_BYTES32`` without fifth
    bits (Q5_0 and Q5_1: ``pack_q5``), n a multiple of 8, in the x8 layout: (n / 8, k / 32 * 8 *
    block bytes) uint8."""
    blocks = _groups(w, qtype)
    scales = SCALE_BYTES32[qtype]
    parts = [blocks[..., at:at + 2] for at in range(0, scales, 2)]  # (g, nb, row, 2) each
    quants = blocks[..., scales:]
    parts.append(quants.reshape(*quants.shape[:3], -1, 4).swapaxes(-2, -3))
    return _joined(parts, w.shape[0])


def pack_q5(w: np.ndarray, qtype: str) -> np.ndarray:
    """Rows w (n, k / 32 * block bytes) of Q5_0 or Q5_1 blocks, n a multiple of 8, in the x8
    layout: the rows' d (and Q5_1's m), their nibbles as Q4_0's, then per 32 nibbles (4 of each
    row) the mask of their fifth bits, bit 4 i + m row i's nibble m: (n / 8, k / 32 * (176 or
    192)) uint8."""
    blocks = _groups(w, qtype)
    scales = SCALE_BYTES32[qtype]
    qs = blocks[..., scales + 4:]
    fifth = np.ascontiguousarray(blocks[..., scales:scales + 4]).view("<u4")[..., 0]
    fifth = fifth.astype(np.uint64)
    shifts = np.arange(GROUP, dtype=np.uint64) * 4
    masks = [((fifth >> np.uint64(16 * (t % 2) + 4 * (t // 2))) & 0xF) << shifts
             for t in range(8)]  # (g, nb, row) each: mask t, nibbles t // 2's low or high
    joined = np.stack([m.sum(axis=-1) for m in masks], axis=-1).astype("<u4")
    return _joined([blocks[..., at:at + 2] for at in range(0, scales, 2)]
                   + [qs.reshape(*qs.shape[:3], -1, 4).swapaxes(-2, -3), joined.view(np.uint8)],
                   w.shape[0])


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
    block = TYPES[qtype].block_bytes
    if w.shape[0] % GROUP or w.shape[1] % block or w.shape[1] == 0:
        raise QuantError(f"{qtype} matrix {tuple(w.shape)} has no x8 layout: {qtype} rows of "
                         f"whole blocks, a multiple of {GROUP} of them")
    if not isinstance(threads, int) or threads < 1:
        raise QuantError(f"threads must be a positive int, got {threads!r}")


def pack_into(out: Any, packed_shape: Tuple[int, int], qtype: str) -> Any:
    """``out``, where ``pack_x8`` is to write its layout (``packed_shape``), checked: None (a
    new array), or contiguous uint8 CPU of that shape; QuantError naming what is wrong."""
    if out is None:
        return np.empty(packed_shape, np.uint8)
    if not (contiguous_cpu(out, "uint8") and ndim(out) == 2
            and tuple(out.shape) == tuple(packed_shape)):
        raise QuantError(f"{qtype} x8 layout out {tuple(getattr(out, 'shape', ()))} "
                         f"{getattr(out, 'dtype', type(out).__name__)} is not contiguous uint8 "
                         f"CPU {tuple(packed_shape)}")
    return out


def pack(w: Any, qtype: str, threads: int = 1) -> np.ndarray:
    """Rows w (numpy or a CPU tensor) of ``qtype`` in the x8 layout, ``check_pack``'s
    arguments (the threads only checked: the twin's ``pack_x8``)."""
    check_pack(w, qtype, threads)
    w = numpy_view(w)
    if qtype in ("Q5_0", "Q5_1"):
        return pack_q5(w, qtype)
    packers = {"Q4_K": pack_q4k, "IQ4_XS": pack_iq4xs}
    return packers[qtype](w) if qtype in packers else pack32(w, qtype)
