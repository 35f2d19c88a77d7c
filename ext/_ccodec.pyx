# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False, cdivision=True
"""Activation codecs, compiled: the twin of ``mdiedge/runtime/_pycodec.py``, with the same API,
errors and bytes. The formats (``fp16``, blockwise ``int8``) and their treatment of inf, NaN
and out-of-range values are documented in ``mdiedge/base/codecs.py``.

``encode(codec, src, dst)`` writes the float32 values of the C-contiguous buffer ``src`` into
the writable byte buffer ``dst`` of exactly ``encoded_size(codec, n)`` bytes;
``decode(codec, src, dst)`` writes them back into the float32 buffer ``dst`` (the
preallocated receive tensor's memory). Sizes are checked first (FrameError). The loops run
with the GIL released; fp16 conversion is portable C (round to nearest even), so the bytes
are the twin's on every platform.
"""
from libc.math cimport rintf
from libc.stdint cimport int8_t, uint16_t, uint32_t
from libc.string cimport memcpy

from mdiedge.base.codecs import (  # the constants are part of this module's API
    BLOCK, FP16, FP16_MAX, INT8, INT8_MAX, INT8_NAN, INT8_NEG_INF, INT8_POS_INF, check_encoded,
    encoded_size)
from mdiedge.base.errors import FrameError
from mdiedge.runtime._framingconstants import byte_view

cdef enum:
    C_BLOCK = 32
    C_INT8_MAX = 126
    C_POS_INF = 127
    C_NEG_INF = -127
    C_NAN = -128
    C_FP16 = 1
    C_INT8 = 2

if (C_BLOCK, C_INT8_MAX, C_POS_INF, C_NEG_INF, C_NAN, C_FP16, C_INT8) != \
        (BLOCK, INT8_MAX, INT8_POS_INF, INT8_NEG_INF, INT8_NAN, FP16, INT8):
    raise ImportError("ext/_ccodec.pyx codes another format than mdiedge.base.codecs")

cdef float C_FP16_MAX = 65504.0


cdef inline uint32_t _bits(float f) noexcept nogil:
    cdef uint32_t u
    memcpy(&u, &f, 4)
    return u


cdef inline float _float(uint32_t u) noexcept nogil:
    cdef float f
    memcpy(&f, &u, 4)
    return f


cdef inline bint _finite(float f) noexcept nogil:
    return (_bits(f) & 0x7F800000u) != 0x7F800000u


cdef inline uint16_t _half(float f) noexcept nogil:
    """fp16 bits, round to nearest even; finite values saturate at +-65504, NaN is 0x7E00."""
    cdef uint32_t u = _bits(f), sign = (u >> 16) & 0x8000u, a = u & 0x7FFFFFFFu, odd
    cdef float m
    if a > 0x7F800000u:
        return 0x7E00
    if a == 0x7F800000u:
        return <uint16_t> (sign | 0x7C00u)
    if _float(a) >= C_FP16_MAX:
        return <uint16_t> (sign | 0x7BFFu)
    if a < (113u << 23):  # an fp16 subnormal or zero: let the FPU round
        m = _float(a) + 0.5
        return <uint16_t> (sign | (_bits(m) - 0x3F000000u))
    odd = (a >> 13) & 1u
    a += (<uint32_t> (15 - 127) << 23) + 0xFFFu + odd
    return <uint16_t> (sign | (a >> 13))


cdef inline float _single(uint16_t h) noexcept nogil:
    cdef uint32_t sign = (<uint32_t> h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu
    cdef float f
    if e == 0x1F:
        return _float(sign | 0x7F800000u | (m << 13))
    if e == 0:
        f = <float> m * <float> 5.9604644775390625e-08  # m * 2**-24, exact
        return -f if sign else f
    return _float(sign | ((e + 112u) << 23) | (m << 13))


cdef void _encode_fp16(const float* x, size_t n, unsigned char* out) noexcept nogil:
    cdef size_t i
    cdef uint16_t h
    for i in range(n):
        h = _half(x[i])
        out[2 * i] = h & 0xFF
        out[2 * i + 1] = h >> 8


cdef void _decode_fp16(const unsigned char* raw, size_t n, float* y) noexcept nogil:
    cdef size_t i
    for i in range(n):
        y[i] = _single(<uint16_t> (raw[2 * i] | (raw[2 * i + 1] << 8)))


cdef void _encode_int8(const float* x, size_t n, unsigned char* out) noexcept nogil:
    cdef size_t blocks = (n + C_BLOCK - 1) // C_BLOCK, b, i, start, end
    cdef int8_t* q = <int8_t*> (out + 2 * blocks)
    cdef float amax, v, d, r
    cdef uint16_t h
    for b in range(blocks):
        start = b * C_BLOCK
        end = start + C_BLOCK if start + C_BLOCK < n else n
        amax = 0
        for i in range(start, end):
            v = x[i] if x[i] >= 0 else -x[i]
            if _finite(x[i]) and v > amax:
                amax = v
        h = _half(amax / <float> C_INT8_MAX)
        out[2 * b] = h & 0xFF
        out[2 * b + 1] = h >> 8
        d = _single(h)
        for i in range(start, end):
            v = x[i]
            if v != v:
                q[i] = C_NAN
            elif not _finite(v):
                q[i] = C_POS_INF if v > 0 else C_NEG_INF
            elif d > 0:
                r = v / d
                if r > C_INT8_MAX:
                    r = C_INT8_MAX
                elif r < -C_INT8_MAX:
                    r = -C_INT8_MAX
                q[i] = <int8_t> rintf(r)
            else:
                q[i] = 0


cdef void _decode_int8(const unsigned char* raw, size_t n, float* y) noexcept nogil:
    cdef size_t blocks = (n + C_BLOCK - 1) // C_BLOCK, b, i, start, end
    cdef const int8_t* q = <const int8_t*> (raw + 2 * blocks)
    cdef float d
    for b in range(blocks):
        start = b * C_BLOCK
        end = start + C_BLOCK if start + C_BLOCK < n else n
        d = _single(<uint16_t> (raw[2 * b] | (raw[2 * b + 1] << 8)))
        for i in range(start, end):
            if q[i] == C_POS_INF:
                y[i] = _float(0x7F800000u)
            elif q[i] == C_NEG_INF:
                y[i] = _float(0xFF800000u)
            elif q[i] == C_NAN:
                y[i] = _float(0x7FC00000u)
            else:
                y[i] = <float> q[i] * d


cdef size_t _values(const unsigned char[::1] view) except? 0:
    if view.shape[0] % 4:
        raise FrameError(f"a float32 buffer of {view.shape[0]} bytes is not whole values")
    return view.shape[0] // 4


def encode(codec, src, dst):
    cdef const unsigned char[::1] x = byte_view(src, False)
    cdef unsigned char[::1] out = byte_view(dst, True)
    cdef size_t n = _values(x)
    check_encoded(codec, n, out.shape[0])
    if n == 0:
        return
    cdef int c = codec
    cdef const float* xp = <const float*> &x[0]
    cdef unsigned char* op = &out[0]
    with nogil:
        if c == C_FP16:
            _encode_fp16(xp, n, op)
        else:
            _encode_int8(xp, n, op)


def decode(codec, src, dst):
    cdef const unsigned char[::1] raw = byte_view(src, False)
    cdef unsigned char[::1] y = byte_view(dst, True)
    cdef size_t n = _values(y)
    check_encoded(codec, n, raw.shape[0])
    if n == 0:
        return
    cdef int c = codec
    cdef const unsigned char* rp = &raw[0]
    cdef float* yp = <float*> &y[0]
    with nogil:
        if c == C_FP16:
            _decode_fp16(rp, n, yp)
        else:
            _decode_int8(rp, n, yp)
