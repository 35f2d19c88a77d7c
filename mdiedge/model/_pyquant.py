"""Products with quantized weights, pure numpy: the twin of ``ext/_cquant.pyx`` with the same
API. The weight is de-quantized by the reference (``mdiedge.model.qtypes``) a tile of rows at
a time and multiplied in float32 by numpy; ``threads`` is numpy's BLAS's own count here.
Arguments are numpy arrays or torch CPU tensors (written in place through ``.numpy()``),
checked as the compiled module checks them."""
from __future__ import annotations

from typing import Any

from . import x8layout
from .arrays import numpy_view
from .qtypes import (KERNEL_TYPES, TYPES, check_matmul, check_rows,  # noqa: F401
                     dequantize_array, qtype_of, quantized_activations_array)

TILE_BYTES = 1 << 20  # quantized bytes de-quantized per step of ``matmul``
# the types multiplied natively, in kernel-code order: (name, weights per block, bytes per block)
COMPILED_TYPES = tuple((t.name, t.block, t.block_bytes)
                       for t in sorted((TYPES[n] for n in KERNEL_TYPES), key=lambda t: t.kernel))


def simd_path() -> str:
    """The kernels in use: "numpy" (this module has no vector kernels of its own)."""
    return "numpy"


def integer_path() -> str:
    """The integer kernels in use: "numpy", as ``simd_path()``."""
    return simd_path()


def q8_types() -> tuple:
    """The types the q8 mode rounds the activations for (every quantized type)."""
    return tuple(name for name, _, _ in COMPILED_TYPES if TYPES[name].act_block)


def set_simd(on: bool) -> str:
    """Nothing to switch here; returns ``simd_path()`` (the compiled module's API)."""
    return simd_path()


def x8_types() -> tuple:
    """The types whose x8 layout the q8 mode multiplies here: none (``matmul`` reads the rows)."""
    return ()


def pack_x8(w: Any, qtype: str, threads: int = 1, out: Any = None) -> Any:
    """Rows ``w`` of ``qtype`` (a multiple of 8 of them) in the x8 layout
    (``mdiedge.model.x8layout``), as the compiled module packs them, into ``out`` where
    given."""
    name = qtype_of(qtype).name
    packed = x8layout.pack(w, name, threads)
    into = x8layout.pack_into(out, packed.shape, name)
    into[...] = packed
    return into


def matmul(x: Any, w: Any, qtype: str, out: Any, threads: int = 1, dot: int = 0,
           x8: Any = None) -> Any:
    """out = x @ W^T with W the de-quantized ``w`` (uint8 (n, row_bytes)) of type ``qtype``;
    x float32 (rows, in), out float32 (rows, n); dot 1: the q8 mode, x first rounded as the
    integer kernels quantize it (``quantized_activations_array``); ``x8``, the rows' x8
    layout, is the compiled module's to read (this twin reads ``w``); returns out."""
    t = check_matmul(x, w, qtype, out, threads)
    rows, weights, into = numpy_view(x), numpy_view(w), numpy_view(out)
    if dot and t.act_block:
        rows = quantized_activations_array(rows, t.act_block)
    step = max(1, TILE_BYTES // weights.shape[1])
    for first in range(0, weights.shape[0], step):
        tile = dequantize_array(weights[first:first + step], t.name, rows.shape[1])
        into[:, first:first + tile.shape[0]] = rows @ tile.T
    return out


def dequantize_rows(w: Any, qtype: str, first: int, count: int, out: Any,
                    threads: int = 1) -> Any:
    """out (count, in) float32 = rows [first, first + count) of ``w`` de-quantized; returns out."""
    t = check_rows(w, qtype, first, count, out, threads)
    k = w.shape[1] // TYPES[t.name].block_bytes * t.block
    numpy_view(out)[...] = dequantize_array(numpy_view(w)[first:first + count], t.name, k)
    return out
