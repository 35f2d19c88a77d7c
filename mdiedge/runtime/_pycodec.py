"""Activation codecs, pure Python (numpy): the twin of ``ext/_ccodec.pyx``, with the same API,
errors and bytes. The formats (``fp16``, blockwise ``int8``) and their treatment of inf, NaN and
out-of-range values are documented in ``mdiedge/base/codecs.py``.

``encode(codec, src, dst)`` writes the float32 values of the C-contiguous buffer ``src`` into the
writable byte buffer ``dst`` of exactly ``encoded_size(codec, n)`` bytes; ``decode(codec, src,
dst)`` writes them back into the float32 buffer ``dst`` (the preallocated receive tensor's memory).
Sizes are checked first (FrameError)."""
from __future__ import annotations

from typing import Any, Tuple

import numpy as np

from ..base.codecs import (BLOCK, FP16, FP16_MAX, INT8, INT8_MAX, INT8_NAN, INT8_NEG_INF,
                           INT8_POS_INF, check_encoded, encoded_size)
from ._framingconstants import byte_view

# the API both twins share
__all__ = ["BLOCK", "FP16", "FP16_MAX", "INT8", "INT8_MAX", "INT8_NAN", "INT8_NEG_INF",
           "INT8_POS_INF", "check_encoded", "decode", "encode", "encoded_size"]

_HALF_NAN = np.uint16(0x7E00)


def _floats(buffer: Any, writable: bool) -> np.ndarray:
    view = byte_view(buffer, writable)
    if len(view) % 4:
        from ..base.errors import FrameError

        raise FrameError(f"a float32 buffer of {len(view)} bytes is not whole values")
    return np.frombuffer(view, dtype="<f4") if not writable else \
        np.asarray(view).view("<f4")


def _bytes(buffer: Any, writable: bool) -> np.ndarray:
    view = byte_view(buffer, writable)
    return np.asarray(view) if writable else np.frombuffer(view, dtype=np.uint8)


def _to_half(x: np.ndarray) -> np.ndarray:
    """fp16 bits of float32 ``x``: finite values saturated at +-65504, NaN canonical."""
    with np.errstate(over="ignore", invalid="ignore"):
        h = np.where(np.isinf(x), x, np.clip(x, -FP16_MAX, FP16_MAX)).astype("<f2").view("<u2")
    h[np.isnan(x)] = _HALF_NAN
    return h


def _split(codec: int, n: int, raw: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """The int8 payload as its scales (fp16 bits) and its values."""
    blocks = (n + BLOCK - 1) // BLOCK
    return raw[:2 * blocks].view("<u2"), raw[2 * blocks:].view(np.int8)


def _scales(x: np.ndarray) -> np.ndarray:
    """Each block's fp16 scale bits: its largest finite magnitude over INT8_MAX."""
    n = x.size
    blocks = (n + BLOCK - 1) // BLOCK
    padded = np.zeros(blocks * BLOCK, dtype=np.float32)
    finite = np.isfinite(x)
    padded[:n] = np.where(finite, np.abs(x), np.float32(0))
    absmax = padded.reshape(blocks, BLOCK).max(axis=1)
    return _to_half(absmax / np.float32(INT8_MAX))


def encode(codec: int, src: Any, dst: Any) -> None:
    x = _floats(src, writable=False)
    out = _bytes(dst, writable=True)
    check_encoded(codec, x.size, out.size)
    if codec == FP16:
        out.view("<u2")[:] = _to_half(x)
        return
    n = x.size
    scale_bits, q = _split(codec, n, out)
    if n == 0:
        return
    scale_bits[:] = _scales(x)
    d = np.repeat(scale_bits.view("<f2").astype(np.float32), BLOCK)[:n]
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(d > 0, x / np.where(d > 0, d, np.float32(1)), np.float32(0))
    r = np.rint(np.clip(r, -INT8_MAX, INT8_MAX))
    r = np.where(np.isnan(x), INT8_NAN, np.where(
        x == np.inf, INT8_POS_INF, np.where(x == -np.inf, INT8_NEG_INF, np.nan_to_num(r))))
    q[:] = r.astype(np.int8)


def decode(codec: int, src: Any, dst: Any) -> None:
    raw = _bytes(src, writable=False)
    y = _floats(dst, writable=True)
    check_encoded(codec, y.size, raw.size)
    if codec == FP16:
        y[:] = raw.view("<f2").astype(np.float32)
        return
    n = y.size
    scale_bits, q = _split(codec, n, raw)
    if n == 0:
        return
    d = np.repeat(scale_bits.view("<f2").astype(np.float32), BLOCK)[:n]
    y[:] = q.astype(np.float32) * d
    y[q == INT8_POS_INF] = np.inf
    y[q == INT8_NEG_INF] = -np.inf
    y[q == INT8_NAN] = np.nan
