# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""Data-plane framing, compiled: the twin of ``mdiedge/runtime/_pyframing.py``, with the same
API and errors. It owns the C packing and parsing of a header and the socket loops; the wire
format (documented in ``mdiedge/runtime/_framingconstants.py``), its constants and its checks are
imported from there. The checks run here as typed predicates on the usual input (exact ints,
lists and tuples); whatever they do not accept goes to _framingconstants' own checks, which convert it
or name the field in error, so that verdicts and messages have one source.

The socket loops call POSIX ``recv``, ``writev`` and ``poll`` on the socket's file descriptor
with the GIL released, so that the compute thread of a node runs while its receiver and sender
threads wait on the network. A socket timeout (``sock.gettimeout()``) bounds every wait for
progress, as it does for the socket's own methods; it raises ``socket.timeout``. A peer that
closes mid-read gives a FrameError, any other failure an OSError carrying the errno.
"""
import math
import os
import socket
import zlib

from cpython.buffer cimport PyBUF_READ
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.exc cimport PyErr_CheckSignals
from cpython.long cimport PyLong_AsLongLongAndOverflow
from cpython.memoryview cimport PyMemoryView_FromMemory
from libc.errno cimport EINTR, errno
from libc.stdint cimport uint8_t, uint32_t, uint64_t, UINT64_MAX
from libc.stdlib cimport free, malloc
from libc.string cimport memcmp, memcpy, memmove
from posix.uio cimport iovec, writev

from mdiedge.runtime._framingconstants import (  # the constants are part of this module's API
    ACTIVATION, CODEC_SHIFT, CRC_OFFSET, ELIGIBLE_BIT, ENTRY_SIZE, FLAG_CODEC, FLAG_PREFILL,
    FLAG_SEALED, FLAGS_KNOWN, FLOAT32, HEADER_SIZE, ITEMSIZE, MAGIC, MAX_BUSY_POLL_US,
    MAX_EXIT_DEPTH, MAX_NDIM, MAX_POSITION, MAX_SAMPLES, MIN_READ_BUFFER, MSG_TYPES, PING,
    READ_BUFFER, RELEASE, SHUTDOWN, TAG_SIZE, VERSION, FrameHeader, byte_view, check_busy_poll,
    check_capacity, check_crc, check_eligible, check_fields, check_fixed_size, check_pack_args,
    check_table_size, closed_early, codec_of)
from mdiedge.base import codecs as _codecs


cdef extern from *:
    """
    #include <errno.h>
    /* EAGAIN and EWOULDBLOCK may be one value: a C switch on both would not compile */
    static int mdiedge_would_block(int e) { return e == EAGAIN || e == EWOULDBLOCK; }
    """
    int _would_block "mdiedge_would_block"(int e) noexcept nogil

cdef extern from "<sys/socket.h>" nogil:
    ssize_t recv(int fd, void* buf, size_t n, int flags)
    enum: MSG_DONTWAIT

cdef extern from "<sched.h>" nogil:
    int sched_yield()

cdef extern from "<time.h>" nogil:
    struct timespec:
        long tv_sec
        long tv_nsec
    int clock_gettime(int clk, timespec* ts)
    enum: CLOCK_MONOTONIC

cdef extern from "<poll.h>" nogil:
    struct pollfd:
        int fd
        short events
        short revents
    ctypedef unsigned long nfds_t
    int poll(pollfd* fds, nfds_t nfds, int timeout)
    enum: POLLIN
    enum: POLLOUT


cdef enum:  # the byte layout the code below packs and parses
    C_HEADER_SIZE = 48
    C_CRC_OFFSET = 44
    C_ENTRY_SIZE = 8
    C_MAX_NDIM = 4
    C_CODEC_SHIFT = 1
    C_FLAG_CODEC = 0x06
    C_MAX_EXIT_DEPTH = 255  # a u8 field
    C_FLOAT32 = 0
    C_FP16 = 1
    C_INT8 = 2
    C_BLOCK = 32

if (C_HEADER_SIZE, C_CRC_OFFSET, C_ENTRY_SIZE, C_MAX_NDIM, len(MAGIC), C_CODEC_SHIFT,
        C_FLAG_CODEC, C_FLOAT32, C_FP16, C_INT8, C_BLOCK, C_MAX_EXIT_DEPTH) != \
        (HEADER_SIZE, CRC_OFFSET, ENTRY_SIZE, MAX_NDIM, 4, CODEC_SHIFT, FLAG_CODEC, FLOAT32,
         _codecs.FP16, _codecs.INT8, _codecs.BLOCK, MAX_EXIT_DEPTH) or \
        MAX_POSITION + 1 != ELIGIBLE_BIT:
    raise ImportError("ext/_cframing.pyx packs another layout than mdiedge.runtime._framingconstants")

# _framingconstants' limits as typed tables, filled from it at import
cdef unsigned char[4] C_MAGIC
cdef uint8_t C_VERSION = VERSION
cdef uint32_t C_MAX_SAMPLES = MAX_SAMPLES
cdef uint32_t C_FLAGS_KNOWN = FLAGS_KNOWN
cdef uint32_t C_ACTIVATION = ACTIVATION
cdef uint32_t C_FLAG_PREFILL = FLAG_PREFILL
cdef uint32_t C_ELIGIBLE_BIT = ELIGIBLE_BIT  # of a position word
cdef uint32_t C_MAX_POSITION = MAX_POSITION  # the bits below it
cdef uint8_t[256] C_MSG_TYPE_OK  # 1 for a known msg_type
cdef uint64_t[256] C_ITEMSIZE  # bytes per element by dtype code, 0 for an unknown code


cdef void _fill_tables() except *:
    cdef int code
    memcpy(C_MAGIC, <const char*> MAGIC, 4)
    for code in range(256):
        C_MSG_TYPE_OK[code] = code in MSG_TYPES
        C_ITEMSIZE[code] = ITEMSIZE.get(code, 0)


_fill_tables()

cdef object _crc32 = zlib.crc32

# outcomes of the nogil socket loops
cdef enum:
    IO_DONE = 0
    IO_EOF = 1
    IO_TIMEOUT = 2
    IO_ERRNO = 3
    IO_EINTR = 4


# ---------------------------------------------------------------- little-endian fields, crc32

cdef inline uint32_t _get16(const unsigned char* p) noexcept nogil:
    return p[0] | (<uint32_t> p[1] << 8)


cdef inline uint32_t _get32(const unsigned char* p) noexcept nogil:
    return p[0] | (<uint32_t> p[1] << 8) | (<uint32_t> p[2] << 16) | (<uint32_t> p[3] << 24)


cdef inline uint64_t _get64(const unsigned char* p) noexcept nogil:
    return _get32(p) | (<uint64_t> _get32(p + 4) << 32)


cdef inline void _put16(unsigned char* p, uint32_t v) noexcept nogil:
    p[0] = v & 0xFF
    p[1] = (v >> 8) & 0xFF


cdef inline void _put32(unsigned char* p, uint32_t v) noexcept nogil:
    p[0] = v & 0xFF
    p[1] = (v >> 8) & 0xFF
    p[2] = (v >> 16) & 0xFF
    p[3] = (v >> 24) & 0xFF


cdef inline void _put64(unsigned char* p, uint64_t v) noexcept nogil:
    _put32(p, <uint32_t> (v & 0xFFFFFFFFu))
    _put32(p + 4, <uint32_t> (v >> 32))


cdef uint32_t _frame_crc(const unsigned char* fixed, const unsigned char* table,
                         size_t table_len) except? 0xFFFFFFFF:
    """zlib's CRC-32 of the bytes before the crc field, then of the sample table."""
    head = PyMemoryView_FromMemory(<char*> fixed, C_CRC_OFFSET, PyBUF_READ)
    rest = PyMemoryView_FromMemory(<char*> table, table_len, PyBUF_READ)
    return _crc32(rest, _crc32(head))


cdef int _timeout_ms(object sock) except? -2:
    """-1: blocking; 0: non-blocking; else the poll() timeout of the socket in ms."""
    timeout = sock.gettimeout()
    if timeout is None:
        return -1
    if timeout <= 0:
        return 0
    return max(1, min(int(math.ceil(timeout * 1000.0)), 2 ** 31 - 1))


cdef int _raise_io(int status, int err, size_t done, size_t size) except -1:
    if status == IO_EOF:
        raise closed_early(done, size)
    if status == IO_TIMEOUT:
        raise socket.timeout("timed out")
    raise OSError(err, os.strerror(err))


# ---------------------------------------------------------------- header

cdef struct Fixed:  # the fields of a header to pack, but its sample table
    uint32_t msg_type, flags, dtype, ndim, exit_depth, n_tokens, seq
    uint32_t[C_MAX_NDIM] dims
    uint64_t size


cdef bint _u32(object value, uint32_t* out) except -1:
    """The value of an exact int in 0..2**32-1; False for anything else."""
    cdef int overflow = 0
    cdef long long number
    if type(value) is not int:
        return False
    number = PyLong_AsLongLongAndOverflow(value, &overflow)
    if overflow or number < 0 or number > 0xFFFFFFFF:
        return False
    out[0] = <uint32_t> number
    return True


cdef inline bint _exit_ok(uint32_t msg_type, uint32_t flags) noexcept nogil:
    """_framingconstants' ``exit_allowed``: early exit only in ACTIVATION frames without PREFILL."""
    return msg_type == C_ACTIVATION and not flags & C_FLAG_PREFILL


cdef inline bint _codec_ok(uint32_t flags, uint32_t dtype) noexcept nogil:
    """A known codec, and none unless the payload is float32."""
    cdef uint32_t codec = (flags & C_FLAG_CODEC) >> C_CODEC_SHIFT
    return codec == 0 or ((codec == C_FP16 or codec == C_INT8) and dtype == C_FLOAT32)


cdef inline uint64_t _coded(uint64_t items, uint64_t itemsize, uint32_t flags) noexcept nogil:
    """Bytes of ``items`` elements with the codec of ``flags`` (``items * itemsize`` must
    not overflow: it bounds every codec's size)."""
    cdef uint32_t codec = (flags & C_FLAG_CODEC) >> C_CODEC_SHIFT
    if codec == C_FP16:
        return 2 * items
    if codec == C_INT8:
        return items + 2 * ((items + C_BLOCK - 1) // C_BLOCK)
    return items * itemsize


cdef bint _size_ok(Fixed* f) noexcept nogil:
    """``f.size`` from the dims, the dtype and the codec; False when it needs more than 64
    bits."""
    cdef uint32_t i
    cdef uint64_t items = 1, itemsize = C_ITEMSIZE[f.dtype]
    f.size = 0
    for i in range(f.ndim):
        if f.dims[i] == 0:
            return True
    for i in range(f.ndim):
        if items > UINT64_MAX // itemsize // f.dims[i]:
            return False
        items *= f.dims[i]
    if f.ndim:
        f.size = _coded(items, itemsize, f.flags)
    return True


cdef bint _fixed_ok(Fixed* f, msg_type, flags, dtype, n_tokens, shape, seq,
                    exit_depth) except -1:
    """_framingconstants' ``check_pack_args`` (but the sample table) as a typed predicate, which
    fills ``f``; False leaves the verdict to _framingconstants."""
    cdef Py_ssize_t i
    if not (_u32(msg_type, &f.msg_type) and _u32(flags, &f.flags) and _u32(dtype, &f.dtype)
            and _u32(n_tokens, &f.n_tokens) and _u32(seq, &f.seq)
            and _u32(exit_depth, &f.exit_depth)):
        return False
    if f.msg_type > 255 or not C_MSG_TYPE_OK[f.msg_type] or f.flags & ~C_FLAGS_KNOWN:
        return False
    if f.exit_depth > C_MAX_EXIT_DEPTH or (f.exit_depth and not _exit_ok(f.msg_type, f.flags)):
        return False
    if f.dtype > 255 or C_ITEMSIZE[f.dtype] == 0 or not _codec_ok(f.flags, f.dtype):
        return False
    if not isinstance(shape, (tuple, list)) or len(shape) > C_MAX_NDIM:
        return False
    f.ndim = len(shape)
    for i in range(C_MAX_NDIM):
        f.dims[i] = 0
    for i in range(f.ndim):
        if not _u32(shape[i], &f.dims[i]):
            return False
    return _size_ok(f)


cdef bint _table_ok(const Fixed* f, object ids, object positions, object eligible) except -1:
    """_framingconstants' checks of the sample table as a typed predicate (exact bools as eligible
    flags); False leaves the verdict to _framingconstants."""
    cdef uint32_t value
    cdef Py_ssize_t i, n
    cdef bint flagged, exit_ok = _exit_ok(f.msg_type, f.flags)
    if not (isinstance(ids, (tuple, list)) and isinstance(positions, (tuple, list))
            and isinstance(eligible, (tuple, list))):
        return False
    n = len(ids)
    if len(positions) != n or n > C_MAX_SAMPLES or (len(eligible) and len(eligible) != n):
        return False
    flagged = len(eligible) != 0
    for i in range(n):
        if not (_u32(ids[i], &value) and _u32(positions[i], &value)) or value > C_MAX_POSITION:
            return False
        if flagged and eligible[i] is not False and (eligible[i] is not True or not exit_ok):
            return False
    return True


cdef object _pack(const Fixed* f, object ids, object words, object eligible):
    """The frame of ``f`` and its table: ``words`` are the position words, to which the
    eligible bit of each True in ``eligible`` (empty: none) is added."""
    cdef Py_ssize_t n = len(ids), i
    cdef bint flagged = len(eligible) != 0
    cdef uint32_t word
    out = PyBytes_FromStringAndSize(NULL, C_HEADER_SIZE + C_ENTRY_SIZE * n)
    cdef unsigned char* buf = <unsigned char*> PyBytes_AS_STRING(out)
    memcpy(buf, C_MAGIC, 4)
    buf[4] = C_VERSION
    buf[5] = <uint8_t> f.msg_type
    buf[6] = <uint8_t> f.flags
    buf[7] = <uint8_t> f.dtype
    _put16(buf + 8, <uint32_t> n)
    buf[10] = <uint8_t> f.ndim
    buf[11] = <uint8_t> f.exit_depth
    _put32(buf + 12, f.n_tokens)
    for i in range(C_MAX_NDIM):
        _put32(buf + 16 + 4 * i, f.dims[i])
    _put32(buf + 32, f.seq)
    _put64(buf + 36, f.size)
    for i in range(n):
        _put32(buf + C_HEADER_SIZE + C_ENTRY_SIZE * i, <uint32_t> ids[i])
        word = <uint32_t> words[i]
        if flagged and eligible[i] is True:
            word |= C_ELIGIBLE_BIT
        _put32(buf + C_HEADER_SIZE + C_ENTRY_SIZE * i + 4, word)
    _put32(buf + C_CRC_OFFSET, _frame_crc(buf, buf + C_HEADER_SIZE, C_ENTRY_SIZE * n))
    return out


def pack_header(msg_type, flags, dtype, sample_ids, positions, n_tokens, shape, seq,
                exit_depth=0, eligible=()):
    """The fixed header and sample table of a frame (its crc computed), ready to send;
    ``eligible``: one flag per sample, or empty when no row is eligible to exit."""
    cdef Fixed f
    cdef Py_ssize_t i
    if _fixed_ok(&f, msg_type, flags, dtype, n_tokens, shape, seq, exit_depth) and \
            _table_ok(&f, sample_ids, positions, eligible):
        return _pack(&f, sample_ids, positions, eligible)
    # anything else (numpy ints, iterators, a bad value): _framingconstants checks and converts
    (f.msg_type, f.flags, f.dtype, sample_ids, words, f.n_tokens, dims, f.seq, f.exit_depth,
     f.size) = check_pack_args(msg_type, flags, dtype, sample_ids, positions, n_tokens, shape,
                               seq, exit_depth, eligible)
    f.ndim = len(dims)
    for i in range(C_MAX_NDIM):
        f.dims[i] = dims[i] if i < f.ndim else 0
    return _pack(&f, sample_ids, words, ())


cdef bint _fields_ok(const unsigned char* p, const uint32_t* d, uint64_t limit) noexcept nogil:
    """_framingconstants' ``check_fields`` as a typed predicate (``limit``: max_payload, clamped)."""
    cdef uint32_t ndim = p[10], i
    cdef uint64_t size = _get64(p + 36), extent = C_ITEMSIZE[p[7]]
    cdef bint empty = False
    if memcmp(p, C_MAGIC, 4) != 0 or p[4] != C_VERSION or not C_MSG_TYPE_OK[p[5]]:
        return False
    if p[6] & ~C_FLAGS_KNOWN or extent == 0 or _get16(p + 8) > C_MAX_SAMPLES:
        return False
    if not _codec_ok(p[6], p[7]):
        return False
    if ndim > C_MAX_NDIM or (p[11] and not _exit_ok(p[5], p[6])):
        return False
    for i in range(ndim, C_MAX_NDIM):
        if d[i]:
            return False
    if ndim == 0:
        return size == 0
    for i in range(ndim):  # the nonzero dims' product, bounded by max_payload even when
        if d[i] == 0:      # a zero dim empties the tensor
            empty = True
        elif extent > limit // d[i]:
            return False  # beyond max_payload (or 64 bits): _framingconstants names the field
        else:
            extent *= d[i]
    return size == (0 if empty else _coded(extent // C_ITEMSIZE[p[7]], C_ITEMSIZE[p[7]], p[6]))


cdef object _parse_fixed(const unsigned char* p, object max_payload):
    cdef uint32_t[C_MAX_NDIM] d
    cdef uint32_t ndim = p[10], i
    cdef uint64_t size = _get64(p + 36)
    cdef uint64_t limit = <uint64_t> min(max(max_payload, 0), UINT64_MAX)
    for i in range(C_MAX_NDIM):
        d[i] = _get32(p + 16 + 4 * i)
    if not _fields_ok(p, d, limit):
        check_fields((<const char*> p)[:4], p[4], p[5], p[6], p[7], _get16(p + 8), ndim, p[11],
                     (d[0], d[1], d[2], d[3]), size, max_payload)
        raise AssertionError("_cframing rejected a header that _framingconstants accepts")
    return FrameHeader(p[5], p[6], p[7], (), (), _get32(p + 12),
                       tuple([d[i] for i in range(ndim)]), _get32(p + 32), size, p[11], ())


cdef bytes _wire(const unsigned char* fixed, const unsigned char* table, size_t table_len):
    """The header's bytes as received: fixed header, then sample table."""
    cdef bytes wire = PyBytes_FromStringAndSize(NULL, C_HEADER_SIZE + table_len)
    cdef char* p = PyBytes_AS_STRING(wire)
    memcpy(p, fixed, C_HEADER_SIZE)
    if table_len:
        memcpy(p + C_HEADER_SIZE, table, table_len)
    return wire


cdef object _fill_table(object header, const unsigned char* fixed, const unsigned char* table,
                        size_t table_len):
    cdef size_t n_samples = _get16(fixed + 8), i
    cdef bint flagged = False
    if table_len != C_ENTRY_SIZE * n_samples:
        check_table_size(table_len, n_samples)
    cdef uint32_t sent = _get32(fixed + C_CRC_OFFSET)
    cdef uint32_t computed = _frame_crc(fixed, table, table_len)
    if sent != computed:
        check_crc(sent, computed)
    for i in range(n_samples):
        if _get32(table + C_ENTRY_SIZE * i + 4) & C_ELIGIBLE_BIT:
            flagged = True
            break
    if flagged:
        eligible = tuple([_get32(table + C_ENTRY_SIZE * i + 4) & C_ELIGIBLE_BIT != 0
                          for i in range(n_samples)])
        if not _exit_ok(fixed[5], fixed[6]):
            check_eligible(fixed[5], fixed[6], eligible)
    else:
        eligible = (False,) * n_samples
    header.wire = _wire(fixed, table, table_len)
    header.sample_ids = tuple([_get32(table + C_ENTRY_SIZE * i) for i in range(n_samples)])
    header.positions = tuple([_get32(table + C_ENTRY_SIZE * i + 4) & C_MAX_POSITION
                              for i in range(n_samples)])
    header.eligible = eligible


def parse_header(fixed, max_payload):
    """Validate a 48-byte fixed header (all but its crc, which ``parse_table`` checks).

    The returned header has empty ``sample_ids``/``positions``/``eligible``; the table that
    follows is ``8 * n_samples`` bytes, with n_samples checked against MAX_SAMPLES."""
    cdef const unsigned char[::1] view = byte_view(fixed, False)
    if view.shape[0] != C_HEADER_SIZE:
        check_fixed_size(view.shape[0])
    return _parse_fixed(&view[0], max_payload)


def parse_table(header, fixed, table):
    """Check the crc over ``fixed`` + ``table`` and the eligible bits, and fill the header's
    sample ids, positions and eligible flags, and its ``wire`` (``fixed`` + ``table``)."""
    cdef const unsigned char[::1] f = byte_view(fixed, False)
    cdef const unsigned char[::1] t = byte_view(table, False)
    if f.shape[0] != C_HEADER_SIZE:
        check_fixed_size(f.shape[0])
    cdef unsigned char empty = 0
    cdef const unsigned char* table_p = &empty
    if t.shape[0]:
        table_p = &t[0]
    _fill_table(header, &f[0], table_p, t.shape[0])


# ---------------------------------------------------------------- socket loops (GIL released)

cdef inline long long _now_ns() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec * 1000000000LL + ts.tv_nsec


cdef int _recv_some(int fd, unsigned char* buf, size_t need, size_t size, size_t* done,
                    int timeout_ms, long long spin_ns, int* err) noexcept nogil:
    """Receive into ``buf`` from ``done`` on until at least ``need`` and at most ``size``
    bytes are there; first polling for up to ``spin_ns`` (at most the timeout; none on a
    non-blocking socket): non-blocking receives, yielding the core between them; then
    sleeping in the kernel."""
    cdef ssize_t n
    cdef int e, ready
    cdef int flags = 0  # MSG_DONTWAIT while polling
    cdef long long deadline = 0
    cdef pollfd pfd
    if spin_ns > 0 and timeout_ms != 0:
        if timeout_ms > 0 and spin_ns > timeout_ms * 1000000LL:
            spin_ns = timeout_ms * 1000000LL
        flags, deadline = MSG_DONTWAIT, _now_ns() + spin_ns
    while done[0] < need:
        n = recv(fd, buf + done[0], size - done[0], flags)
        if n > 0:
            done[0] += <size_t> n
            continue
        if n == 0:
            return IO_EOF
        e = errno
        if e == EINTR:
            return IO_EINTR
        if flags and _would_block(e):
            if _now_ns() < deadline:
                sched_yield()
            else:
                flags = 0  # the poll is over: the next receive sleeps
            continue
        if _would_block(e) and timeout_ms > 0:
            pfd.fd, pfd.events, pfd.revents = fd, POLLIN, 0
            ready = poll(&pfd, 1, timeout_ms)
            if ready > 0:
                continue
            if ready == 0:
                return IO_TIMEOUT
            e = errno
            if e == EINTR:
                return IO_EINTR
        err[0] = e
        return IO_ERRNO
    return IO_DONE


cdef int _send_loop(int fd, const unsigned char* head, size_t head_len,
                    const unsigned char* body, size_t body_len, size_t* done, int timeout_ms,
                    int* err) noexcept nogil:
    cdef size_t total = head_len + body_len
    cdef ssize_t n
    cdef int e, ready, count
    cdef iovec[2] iov
    cdef pollfd pfd
    while done[0] < total:
        if done[0] < head_len:
            iov[0].iov_base = <void*> (head + done[0])
            iov[0].iov_len = head_len - done[0]
            iov[1].iov_base = <void*> body
            iov[1].iov_len = body_len
            count = 2 if body_len else 1
        else:
            iov[0].iov_base = <void*> (body + (done[0] - head_len))
            iov[0].iov_len = total - done[0]
            count = 1
        n = writev(fd, iov, count)
        if n >= 0:
            done[0] += <size_t> n
            continue
        e = errno
        if e == EINTR:
            return IO_EINTR
        if _would_block(e) and timeout_ms > 0:
            pfd.fd, pfd.events, pfd.revents = fd, POLLOUT, 0
            ready = poll(&pfd, 1, timeout_ms)
            if ready > 0:
                continue
            if ready == 0:
                return IO_TIMEOUT
            e = errno
            if e == EINTR:
                return IO_EINTR
        err[0] = e
        return IO_ERRNO
    return IO_DONE


cdef int _recv_exact(object sock, unsigned char* buf, size_t size, size_t done=0,
                     long long spin_ns=0) except -1:
    """``buf[done:size]`` from the socket."""
    return _recv_range(sock, buf, &done, size, size, 0, spin_ns)


cdef int _recv_range(object sock, unsigned char* buf, size_t* done, size_t need, size_t size,
                     size_t base, long long spin_ns) except -1:
    """Receive into ``buf`` from ``done`` on until at least ``need`` and at most ``size``
    bytes are there (polling for up to ``spin_ns`` before it sleeps); a peer that closes
    first is named by the bytes after ``base``."""
    cdef int fd = sock.fileno()
    cdef int timeout_ms = _timeout_ms(sock)
    cdef int status, err = 0
    while True:
        with nogil:
            status = _recv_some(fd, buf, need, size, done, timeout_ms, spin_ns, &err)
        if status == IO_DONE:
            return 0
        if status == IO_EINTR:
            PyErr_CheckSignals()  # a signal handler's exception propagates; else retry
            continue
        _raise_io(status, err, done[0] - base, need - base)


def recv_exact_into(sock, buffer):
    """Receive exactly ``len(buffer)`` bytes into the writable ``buffer``.

    A peer that closes first gives a FrameError; the socket's timeout gives
    ``socket.timeout``; other failures an OSError."""
    cdef unsigned char[::1] view = byte_view(buffer, True)
    if view.shape[0]:
        _recv_exact(sock, &view[0], view.shape[0])


def send_all(sock, header_bytes, payload):
    """Send ``header_bytes`` then ``payload`` (any C-contiguous buffer, or None) as one
    gather write, with no concatenation copy, until every byte is out."""
    cdef const unsigned char[::1] head = byte_view(header_bytes, False)
    cdef const unsigned char[::1] body = byte_view(b"" if payload is None else payload, False)
    cdef size_t head_len = head.shape[0], body_len = body.shape[0], done = 0
    cdef const unsigned char* head_p = &head[0] if head_len else NULL
    cdef const unsigned char* body_p = &body[0] if body_len else NULL
    cdef int fd = sock.fileno()
    cdef int timeout_ms = _timeout_ms(sock)
    cdef int status, err = 0
    if head_len == 0:  # the payload alone, still as one loop
        head_p, head_len, body_p, body_len = body_p, body_len, NULL, 0
    while True:
        with nogil:
            status = _send_loop(fd, head_p, head_len, body_p, body_len, &done, timeout_ms, &err)
        if status == IO_DONE:
            return
        if status == IO_EINTR:
            PyErr_CheckSignals()
            continue
        _raise_io(status, err, done, head_len + body_len)


def recv_frame_header(sock, max_payload):
    """Read and validate one frame's fixed header and sample table (not its payload), and
    nothing past them: one receive for each."""
    cdef unsigned char[C_HEADER_SIZE] fixed
    _recv_exact(sock, fixed, C_HEADER_SIZE)
    header = _parse_fixed(fixed, max_payload)  # n_samples checked against MAX_SAMPLES
    cdef size_t table_len = C_ENTRY_SIZE * _get16(fixed + 8)
    cdef unsigned char* table = <unsigned char*> malloc(table_len or 1)
    if table == NULL:
        raise MemoryError()
    try:
        if table_len:
            _recv_exact(sock, table, table_len)
        _fill_table(header, fixed, table, table_len)
    finally:
        free(table)
    return header


cdef class FrameReader:
    """Frames from one socket through a receive buffer of ``capacity`` bytes: one ``recv``
    takes whatever has arrived, so a small frame's header, table and payload (and frames
    queued behind it) come in one system call; payload bytes beyond those buffered are
    received straight into their destination. ``capacity`` 0: each step reads exactly the
    bytes it needs, nothing past the frame (the socket may change hands between frames).
    ``busy_poll_us`` > 0: a receive that finds nothing polls the socket for up to that long
    (yielding the core between polls) before it sleeps in the kernel, so that a frame
    arriving soon costs no wake-up. Errors as ``recv_exact_into``; after one, the stream
    position is unknown."""

    cdef readonly object sock
    cdef readonly int busy_poll_us
    cdef bint greedy
    cdef unsigned char* buf
    cdef size_t cap, start, end
    cdef long long spin_ns

    def __cinit__(self, sock, capacity=READ_BUFFER, busy_poll_us=0):
        self.greedy = check_capacity(capacity) > 0
        self.busy_poll_us = check_busy_poll(busy_poll_us)
        self.spin_ns = self.busy_poll_us * 1000LL
        self.cap = max(capacity, MIN_READ_BUFFER)
        self.buf = <unsigned char*> malloc(self.cap)
        if self.buf == NULL:
            raise MemoryError()
        self.sock, self.start, self.end = sock, 0, 0

    def __dealloc__(self):
        free(self.buf)

    @property
    def buffered(self):
        """Bytes received but not yet consumed."""
        return self.end - self.start

    cdef unsigned char* _fill(self, size_t need, size_t base) except NULL:
        """The first ``need`` unconsumed bytes (need <= cap), receiving until they are there;
        a peer that closes first is named by the bytes after ``base``."""
        cdef size_t have = self.end - self.start
        if have < need:
            if self.cap - self.start < need:  # move the rest to the front
                memmove(self.buf, self.buf + self.start, have)
                self.start, self.end = 0, have
            _recv_range(self.sock, self.buf + self.start, &have, need,
                        self.cap - self.start if self.greedy else need, base, self.spin_ns)
            self.end = self.start + have
        return self.buf + self.start

    def recv_header(self, max_payload):
        """Read and validate one frame's fixed header and sample table (not its payload)."""
        cdef unsigned char* p = self._fill(C_HEADER_SIZE, 0)
        header = _parse_fixed(p, max_payload)  # n_samples checked against MAX_SAMPLES
        cdef size_t table_len = C_ENTRY_SIZE * _get16(p + 8)
        p = self._fill(C_HEADER_SIZE + table_len, C_HEADER_SIZE)
        _fill_table(header, p, p + C_HEADER_SIZE, table_len)
        self._consume(C_HEADER_SIZE + table_len)
        return header

    def recv_into(self, buffer):
        """Fill the writable ``buffer``: buffered bytes first, the rest from the socket."""
        cdef unsigned char[::1] view = byte_view(buffer, True)
        cdef size_t size = view.shape[0]
        cdef size_t take = min(size, self.end - self.start)
        if size == 0:
            return
        memcpy(&view[0], self.buf + self.start, take)
        self._consume(take)
        if take < size:
            _recv_exact(self.sock, &view[0], size, take, self.spin_ns)

    cdef void _consume(self, size_t size) noexcept:
        self.start += size
        if self.start == self.end:
            self.start = self.end = 0
