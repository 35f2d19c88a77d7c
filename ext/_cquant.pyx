# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Products with quantized weights, compiled: the twin of ``mdiedge/model/_pyquant.py`` with the
same API. The kernels are ``ext/quant.h``: float32 arithmetic with each block's quants widened
in registers, a scalar reference and a vector path (AVX2+FMA+F16C on x86-64, NEON on aarch64)
chosen at import (the q8 mode's integer kernels with AVX512-VNNI where the CPU has it), OpenMP threads over the output columns, the GIL released. Arguments are
checked by ``mdiedge.model.qtypes`` (one line each, ``QuantError``); arrays are numpy arrays or
torch CPU tensors."""
import numpy as _np

from mdiedge.base.errors import QuantError as _QuantError
from mdiedge.model.arrays import address as _address, row_stride as _row_stride
from mdiedge.model.arrays import contiguous_cpu as _contiguous_cpu, ndim as _ndim
from mdiedge.model.qtypes import check_compiled as _check_compiled, check_matmul, check_rows
from mdiedge.model.qtypes import qtype_of as _qtype_of
from mdiedge.model.x8layout import check_pack as _check_pack, pack_into as _pack_into

cdef extern from "quant.h" nogil:
    int QM_TYPES
    const char *qm_names[]
    const int qm_block[]
    const int qm_block_bytes[]
    void qm_init()
    const char *qm_use_simd(int on)
    const char *qm_ipath
    int qm_q8_usable(int type)
    int QM_DOT_WIDE
    int qm_rows_into_x8(int type, const unsigned char *w, const unsigned char *x8,
                        const float *x, float *y, Py_ssize_t ldy, Py_ssize_t n, Py_ssize_t k,
                        int rows, int threads, int dot)
    int qm_x8_usable(int type)
    size_t qm_x8_bytes(int type, Py_ssize_t k)
    int qm_pack_x8(int type, const unsigned char *w, Py_ssize_t n, Py_ssize_t k,
                   unsigned char *out, int threads)
    void qm_dequant(int type, const unsigned char *w, Py_ssize_t k, Py_ssize_t count,
                    float *out, int threads)

qm_init()
# ext/quant.h's types, in enum order: (name, weights per block, bytes per block)
COMPILED_TYPES = tuple((qm_names[i].decode(), qm_block[i], qm_block_bytes[i])
                       for i in range(QM_TYPES))
_check_compiled(COMPILED_TYPES, __name__)
_path = qm_use_simd(1).decode()


def simd_path():
    """The kernels in use: "avx2", "neon" or "scalar" (the plain reference)."""
    return _path


def integer_path():
    """The q8 mode's integer kernels in use: "avx2+avx512vnni" (vpdpbusd / vpdpwssd where
    the CPU has them), "avx2", "neon-dotprod", "float32" (none on this CPU's vector path) or
    "scalar"."""
    return qm_ipath.decode()


def q8_types():
    """The types the q8 mode multiplies in integer dot products on the path in use (the
    others in float32): every quantized type on the scalar reference; on a vector path, those
    with a kernel there for this CPU."""
    return tuple(qm_names[i].decode() for i in range(QM_TYPES) if qm_q8_usable(i))


def set_simd(on):
    """Use the vector kernels (where this CPU has them) or, ``on`` false, the scalar
    reference; returns ``simd_path()``. Not while a product runs (tests, benchmarks)."""
    global _path
    _path = qm_use_simd(1 if on else 0).decode()
    return _path


def x8_types():
    """The types whose x8 layout (``pack_x8``) the q8 mode multiplies on the path in use."""
    return tuple(qm_names[i].decode() for i in range(QM_TYPES) if qm_x8_usable(i))


def pack_x8(w, qtype, int threads=1, out=None):
    """Rows ``w`` (uint8 (n, row_bytes)) of ``qtype`` in the x8 layout: groups of 8 rows
    interleaved block by block (``ext/quant_q8.h``), uint8 (n / 8, group bytes), written into
    ``out`` where given (``x8layout.pack_into``); QuantError where the type has none or n is
    not a multiple of 8."""
    t = _qtype_of(qtype)
    _check_pack(w, t.name, threads)
    cdef int code = t.kernel
    cdef Py_ssize_t n = w.shape[0], k = w.shape[1] // qm_block_bytes[code] * qm_block[code]
    cdef size_t group = qm_x8_bytes(code, k)
    if group == 0:  # a layout x8layout knows and ext/quant_q8.h does not: a stale build
        raise _QuantError(f"{t.name}: no x8 layout in this build of {__name__}")
    out = _pack_into(out, (n // 8, group), t.name)
    cdef size_t w_ptr = _address(w), o_ptr = _address(out)
    with nogil:
        qm_pack_x8(code, <const unsigned char *>w_ptr, n, k, <unsigned char *>o_ptr, threads)
    return out


def matmul(x, w, qtype, out, int threads=1, int dot=0, x8=None):
    """out = x @ W^T with W the de-quantized ``w`` (uint8 (n, row_bytes)) of type ``qtype``;
    x float32 (rows, in), out float32 (rows, n), its rows contiguous (out may be a stretch of
    columns of a wider array); dot 1: the q8 mode (x quantized to 8 bits, integer dot
    products, ``mdiedge.model.cpudot``; the K-quants' wide kernels, which scale 8 rows' sums
    at once: the step's kernels round a row otherwise), which reads ``x8`` (``pack_x8``'s
    of w) instead of w where given and usable; returns out."""
    t = check_matmul(x, w, qtype, out, threads)
    cdef int code = t.kernel, rows = x.shape[0], status
    cdef size_t w_ptr = _address(w), x_ptr = _address(x), y_ptr = _address(out)
    cdef size_t x8_ptr = 0 if x8 is None else _address(x8)
    cdef Py_ssize_t n = w.shape[0], k = x.shape[1], ldy = _row_stride(out)
    if x8 is not None and not (_contiguous_cpu(x8, "uint8") and _ndim(x8) == 2
                               and x8.shape[0] * 8 == n and x8.shape[1] == qm_x8_bytes(code, k)):
        raise _QuantError(f"x8 layout {tuple(getattr(x8, 'shape', ()))} is not that of "
                          f"{qtype} {tuple(w.shape)} (contiguous uint8, one row per 8)")
    with nogil:
        status = qm_rows_into_x8(code, <const unsigned char *>w_ptr,
                                 <const unsigned char *>x8_ptr, <const float *>x_ptr,
                                 <float *>y_ptr, ldy, n, k, rows, threads,
                                 QM_DOT_WIDE if dot else 0)
    if status:
        raise MemoryError(f"no memory for the activations of {rows} rows of {k}")
    return out


def dequantize_rows(w, qtype, first, count, out, int threads=1):
    """out (count, in) float32 = rows [first, first + count) of ``w`` de-quantized; returns
    out."""
    t = check_rows(w, qtype, first, count, out, threads)
    cdef int code = t.kernel
    cdef size_t w_ptr = _address(w) + first * w.shape[1], y_ptr = _address(out)
    cdef Py_ssize_t k = out.shape[1], c = count
    with nogil:
        qm_dequant(code, <const unsigned char *>w_ptr, k, c, <float *>y_ptr, threads)
    return out
