"""The facts of quantized weights, torch-free: ``TYPES``, row bytes, the numpy reference
de-quantizer and quantizer, the q8 mode's activation rounding, and the quantized product's argument
checks both implementations apply. ``quant``'s docstring describes the block layouts."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np

from ..base.dtypes import QUANTIZERS as _QUANTIZERS
from ..base.errors import QuantError
from . import npdequant
from .arrays import contiguous_cpu, dtype_name, numpy_view, row_stride


@dataclass(frozen=True)
class QType:
    """Scale offsets: of each block's f16 scales; ``code``: ``ext/quant.h``'s enum value (None:
    de-quantized to float32 at load)."""

    name: str
    ggml_id: int
    block: int
    block_bytes: int
    scales: Tuple[int, ...]
    kernel: Optional[int]

    @property
    def native(self) -> bool:
        return self.kernel is not None

    @property
    def act_block(self) -> int:
        """The q8 mode's activation block: the weights' (32 or 256); 0 for a float type."""
        return self.block if self.native and self.block > 1 else 0


TYPES: Dict[str, QType] = {t.name: t for t in (
    QType("F32", 0, 1, 4, (), None),
    QType("F16", 1, 1, 2, (), 5),
    QType("Q4_0", 2, 32, 18, (0,), 1),
    QType("Q4_1", 3, 32, 20, (0, 2), 2),
    QType("Q5_0", 6, 32, 22, (0,), 7),
    QType("Q5_1", 7, 32, 24, (0, 2), 8),
    QType("Q8_0", 8, 32, 34, (0,), 0),
    QType("Q2_K", 10, 256, 84, (80, 82), 9),
    QType("Q3_K", 11, 256, 110, (108,), 10),
    QType("Q4_K", 12, 256, 144, (0, 2), 3),
    QType("Q5_K", 13, 256, 176, (0, 2), 11),
    QType("Q6_K", 14, 256, 210, (208,), 4),
    QType("IQ4_NL", 20, 32, 18, (0,), 12),
    QType("IQ4_XS", 23, 256, 136, (0,), 13),
    QType("BF16", 30, 1, 2, (), 6),
)}
KERNEL_TYPES: Tuple[str, ...] = tuple(n for n, t in TYPES.items() if t.native)
QUANTIZERS: Tuple[str, ...] = _QUANTIZERS  # mdiedge.base.dtypes: the one list
SCALE_FIELDS = {n: t.scales for n, t in TYPES.items()}  # byte offsets of each block's f16 scales


def qtype_of(name: str) -> QType:
    """As GGUF and llama.cpp write it, any case."""
    found = TYPES.get(str(name).upper())
    if found is None:
        raise QuantError(f"weight type {name!r} is not one of {', '.join(TYPES)}")
    return found


def check_compiled(compiled: Sequence[Tuple[Any, int, int]], module: str) -> None:
    """Refuses a stale build whose kernel table is not ``TYPES``' kernel codes."""
    want = {t.kernel: (t.name, t.block, t.block_bytes) for t in TYPES.values() if t.native}
    got = {code: (name.decode() if isinstance(name, bytes) else str(name), int(b), int(bb))
           for code, (name, b, bb) in enumerate(compiled)}
    for code in sorted(set(want) | set(got), key=int):
        if want.get(code) != got.get(code):
            raise QuantError(f"{module} was built with quant type {code} = {got.get(code)}, "
                             f"but mdiedge.model.quant.TYPES has {want.get(code)}: rebuild it "
                             "(python setup.py build_ext --inplace)")


def row_bytes(qtype: str, in_features: int) -> int:
    t = qtype_of(qtype)
    if in_features < 1 or in_features % t.block:
        raise QuantError(f"width {in_features} is not a positive multiple of {t.name}'s "
                         f"block of {t.block}")
    return in_features // t.block * t.block_bytes


# -- the reference de-quantizer and quantizer ------------------------------------------------

def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """As float32 (blocks, 1)."""
    return np.ascontiguousarray(blocks[:, at:at + 2]).view("<f2").astype(np.float32)


def kernel_qtype(source: Any, theirs: str) -> Optional[str]:
    """The stored type when the kernels run it (a vector such as an F16 norm reads as float)."""
    qtype = getattr(source, "qtype", None)
    if qtype is None:
        return None
    name = str(qtype(theirs)).upper()
    shape = getattr(source, "shape", None)
    if shape is not None and len(shape(theirs) or ()) == 1:
        return None
    return name if name in TYPES and TYPES[name].native else None


def as_blocks(data: Any) -> np.ndarray:
    """2-D uint8 numpy sharing them."""
    raw = numpy_view(data)
    if raw.dtype != np.uint8 or raw.ndim != 2:
        raise QuantError(f"quantized weights must be 2-D uint8 (rows, bytes), not "
                         f"{raw.dtype} {tuple(raw.shape)}")
    return raw


def check_blocks(data: Any, qtype: str) -> None:
    """Refuses a non-finite scale (a corrupt file), naming the first such block."""
    t, raw = qtype_of(qtype), as_blocks(data)
    blocks = raw.reshape(-1, t.block_bytes)
    for at in t.scales:
        bad = np.flatnonzero(~np.isfinite(_f16(blocks, at)))
        if bad.size:
            per_row = raw.shape[-1] // t.block_bytes
            row, block = divmod(int(bad[0]), per_row)
            raise QuantError(f"{t.name} block {block} of row {row} has a scale of "
                             f"{float(_f16(blocks[bad[:1]], at)[0, 0])} (not finite)")


def dequantize_array(data: Any, qtype: str, in_features: int) -> np.ndarray:
    """Float32 (out, in) numpy; non-finite scales refused."""
    raw = as_blocks(data)
    t, width = qtype_of(qtype), row_bytes(qtype, in_features)
    if raw.shape[1] != width:
        raise QuantError(f"rows of {raw.shape[1]} bytes do not hold {in_features} {t.name} "
                         f"weights ({width} bytes)")
    check_blocks(raw, t.name)
    blocks = np.ascontiguousarray(raw).reshape(-1, t.block_bytes)
    return npdequant.blocks_to_float(blocks, t.name).reshape(raw.shape[0], in_features)


def _round_away(v: np.ndarray) -> np.ndarray:
    """Half away from zero, as C's roundf (adding 0.5 would round 0.49999997 up in float32)."""
    a = np.abs(v)
    whole = np.floor(a)
    return np.sign(v) * (whole + np.floor(2 * (a - whole)))


def _inverse(d: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)


def _pack(qs: np.ndarray) -> np.ndarray:
    """32 nibbles per block to 16 bytes: element i low, 16 + i high."""
    q = qs.astype(np.uint8)
    return q[:, :16] | (q[:, 16:] << 4)


def _half_bytes(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16).view(np.uint8)


def _quantize_blocks(b: np.ndarray, name: str) -> np.ndarray:
    if name == "Q8_0":
        d = np.abs(b).max(axis=1, keepdims=True) / np.float32(127)
        qs = _round_away(b * _inverse(d)).astype(np.int8).view(np.uint8)
        return np.concatenate([_half_bytes(d), qs], axis=1)
    if name == "Q4_0":
        at = np.abs(b).argmax(axis=1)[:, None]
        d = np.take_along_axis(b, at, axis=1) / np.float32(-8)
        qs = np.minimum(np.trunc(b * _inverse(d) + np.float32(8.5)), 15)
        return np.concatenate([_half_bytes(d), _pack(qs)], axis=1)
    lo, hi = b.min(axis=1, keepdims=True), b.max(axis=1, keepdims=True)
    d = (hi - lo) / np.float32(15)
    qs = np.minimum(np.trunc((b - lo) * _inverse(d) + np.float32(0.5)), 15)
    return np.concatenate([_half_bytes(d), _half_bytes(lo), _pack(qs)], axis=1)


def quantize_array(weight: Any, qtype: str) -> np.ndarray:
    """The bytes llama.cpp's reference quantizer writes. Q8_0, Q4_0 and Q4_1 only."""
    t = qtype_of(qtype)
    if t.name not in QUANTIZERS:
        raise QuantError(f"cannot quantize to {t.name}: only to {', '.join(QUANTIZERS)}")
    w = np.asarray(numpy_view(weight), dtype=np.float32)
    if w.ndim != 2 or not np.isfinite(w).all():
        raise QuantError(f"cannot quantize a weight of shape {tuple(w.shape)} that is not "
                         "2-D or not finite")
    width = row_bytes(t.name, w.shape[1])
    packed = _quantize_blocks(w.reshape(-1, t.block).astype(np.float32), t.name)
    return np.ascontiguousarray(packed).reshape(w.shape[0], width)


def quantized_activations_array(x: np.ndarray, block: int) -> np.ndarray:
    """``quant.quantized_activations`` in numpy."""
    rows, k = x.shape
    blocks = x.reshape(rows, k // block, block)
    zero = np.float32(0)
    with np.errstate(divide="ignore"):
        if block == 32:
            d = np.abs(blocks).max(-1, keepdims=True) / np.float32(127)
            inverse = np.where(d != 0, np.float32(1) / d, zero)
            inverse = np.where(np.isinf(inverse), zero, inverse)  # a tiny block: 0
        else:
            top = np.take_along_axis(blocks, np.abs(blocks).argmax(-1)[..., None], -1)
            # torch divides a number by a tensor as the reciprocal times the number
            inverse = np.where(top != 0, (np.float32(1) / top) * np.float32(-127), zero)
            inverse = np.where(np.isinf(inverse), zero, inverse)
            d = np.where(inverse != 0, np.float32(1) / inverse, zero)
    scaled = blocks * inverse
    q = np.sign(scaled) * np.floor(np.abs(scaled) + np.float32(0.5))
    return (np.minimum(q, np.float32(127)) * d).astype(np.float32).reshape(rows, k)


# -- the boundary of the quantized product (both implementations) -----------------------------

def _weight_fits(w: Any, t: QType, k: int) -> None:
    if not (contiguous_cpu(w, "uint8") and len(w.shape) == 2):
        shown = tuple(w.shape) if hasattr(w, "shape") else type(w).__name__
        raise QuantError(f"quantized weight {shown} {getattr(w, 'dtype', '')} is not a "
                         "contiguous uint8 CPU tensor (rows, bytes)")
    width = row_bytes(t.name, k)
    if w.shape[1] != width:
        raise QuantError(f"weight rows of {w.shape[1]} bytes do not hold {k} {t.name} "
                         f"weights ({width} bytes)")


def _float_rows(what: str, v: Any, shape: Tuple[int, int]) -> None:
    if not (contiguous_cpu(v, "float32") and tuple(v.shape) == shape):
        shown = tuple(v.shape) if hasattr(v, "shape") else type(v).__name__
        raise QuantError(f"{what} {shown} {getattr(v, 'dtype', '')} is not a contiguous "
                         f"float32 CPU tensor of shape {shape}")


def _float_columns(what: str, v: Any, shape: Tuple[int, int]) -> None:
    """``v`` a float32 CPU array of ``shape`` whose rows are each contiguous (a stretch of
    columns of a wider array will do)."""
    if not (getattr(v, "shape", None) is not None and tuple(v.shape) == shape
            and dtype_name(v) == "float32" and row_stride(v) > 0):
        shown = tuple(v.shape) if hasattr(v, "shape") else type(v).__name__
        raise QuantError(f"{what} {shown} {getattr(v, 'dtype', '')} is not a float32 CPU "
                         f"tensor of shape {shape} with contiguous rows")


def _kernel_type(qtype: str, threads: int) -> QType:
    t = qtype_of(qtype)
    if not t.native:
        raise QuantError(f"no quantized kernel for {t.name}: they run "
                         f"{', '.join(KERNEL_TYPES)}")
    if threads < 1:
        raise QuantError(f"threads {threads} is not >= 1")
    return t


def check_matmul(x: Any, w: Any, qtype: str, out: Any, threads: int) -> QType:
    """x (rows >= 1, in), w uint8 (n, row_bytes(in)) contiguous; out (rows, n), its rows
    contiguous."""
    t = _kernel_type(qtype, threads)
    if len(getattr(x, "shape", ())) != 2 or x.shape[0] < 1:
        raise QuantError(f"activations {tuple(getattr(x, 'shape', ()))} are not 2-D "
                         "(rows >= 1, width)")
    _weight_fits(w, t, x.shape[1])
    _float_rows("activations", x, (x.shape[0], x.shape[1]))
    _float_columns("out", out, (x.shape[0], w.shape[0]))
    return t


def check_rows(w: Any, qtype: str, first: int, count: int, out: Any, threads: int) -> QType:
    """Rows [first, first + count) of w into float32 out (count, in)."""
    t = _kernel_type(qtype, threads)
    n = w.shape[0] if hasattr(w, "shape") and len(w.shape) == 2 else 0
    if not (0 <= first and count >= 1 and first + count <= n):
        raise QuantError(f"rows {first}..{first + count - 1} are not rows of a weight of "
                         f"{n} rows")
    width = w.shape[1]
    if width % t.block_bytes:
        raise QuantError(f"rows of {width} bytes are not whole {t.name} blocks of "
                         f"{t.block_bytes} bytes")
    k = width // t.block_bytes * t.block
    _weight_fits(w, t, k)
    _float_rows("out", out, (count, k))
    return t
