# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""Data-plane framing, compiled (twin of ``mdiedge/_pyframing.py``, same API and errors).

The wire format is documented in the twin. Here the header is packed and parsed in C, the
crc32 is computed in C (the zlib polynomial), and the socket loops call POSIX ``recv``,
``writev`` and ``poll`` on the socket's file descriptor with the GIL released, so that the
compute thread of a node runs while its receiver and sender threads wait on the network.

A socket timeout (``sock.gettimeout()``) bounds every wait for progress, as it does for the
socket's own methods; it raises ``socket.timeout``. A peer that closes mid-read gives a
FrameError, any other failure an OSError carrying the errno.
"""
import math
import operator
import os
import socket

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.exc cimport PyErr_CheckSignals
from libc.errno cimport EINTR, errno
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t, UINT64_MAX
from libc.string cimport memcpy
from posix.uio cimport iovec, writev

from mdiedge.runtime._pyframing import FrameHeader  # one plain class for both implementations
from mdiedge.base.errors import FrameError


cdef extern from *:
    """
    #include <errno.h>
    /* EAGAIN and EWOULDBLOCK may be one value: a C switch on both would not compile */
    static int mdiedge_would_block(int e) { return e == EAGAIN || e == EWOULDBLOCK; }
    """
    int _would_block "mdiedge_would_block"(int e) noexcept nogil

cdef extern from "<sys/socket.h>" nogil:
    ssize_t recv(int fd, void* buf, size_t n, int flags)

cdef extern from "<poll.h>" nogil:
    struct pollfd:
        int fd
        short events
        short revents
    ctypedef unsigned long nfds_t
    int poll(pollfd* fds, nfds_t nfds, int timeout)
    enum: POLLIN
    enum: POLLOUT


MAGIC = b"MDIE"
VERSION = 1
HEADER_SIZE = 48
MAX_SAMPLES = 1024
MAX_NDIM = 4

ACTIVATION, RELEASE, PING, PONG, SHUTDOWN = 1, 2, 3, 4, 5
MSG_TYPES = (ACTIVATION, RELEASE, PING, PONG, SHUTDOWN)
FLAG_PREFILL = 0x01

# dtype code -> bytes per element: float32, float16, bfloat16, int64, int32, uint8
ITEMSIZE = {0: 4, 1: 2, 2: 2, 3: 8, 4: 4, 5: 1}

U32_MAX = 2 ** 32 - 1

cdef enum:
    C_HEADER_SIZE = 48
    C_MAX_SAMPLES = 1024
    C_MAX_NDIM = 4
    CRC_OFFSET = 44
    ENTRY_SIZE = 8  # one sample-table entry: u32 sample id, u32 position
    TABLE_MAX = ENTRY_SIZE * C_MAX_SAMPLES

cdef int[6] C_ITEMSIZE = [4, 2, 2, 8, 4, 1]

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


cdef uint32_t[256] CRC_TABLE


cdef void _init_crc_table() noexcept:
    cdef uint32_t c
    cdef int n, k
    for n in range(256):
        c = n
        for k in range(8):
            c = (0xEDB88320u ^ (c >> 1)) if c & 1 else (c >> 1)
        CRC_TABLE[n] = c


_init_crc_table()


cdef uint32_t _crc32(uint32_t crc, const unsigned char* p, size_t n) noexcept nogil:
    """zlib.crc32(data, crc)."""
    cdef size_t i
    crc = crc ^ 0xFFFFFFFFu
    for i in range(n):
        crc = CRC_TABLE[(crc ^ p[i]) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFFu


# ---------------------------------------------------------------- helpers shared with the twin

def _uint(field, value, limit):
    """``value`` as an int in 0..limit, else a FrameError naming ``field``."""
    try:
        number = operator.index(value)
    except TypeError:
        raise FrameError(f"{field} {value!r} is not an integer") from None
    if not 0 <= number <= limit:
        raise FrameError(f"{field} {value!r} outside 0..{limit}")
    return number


def _payload_len(ndim, dims, itemsize):
    if ndim == 0:
        return 0
    total = itemsize
    for d in dims[:ndim]:
        total *= d
    return total


cdef object _byte_view(object buffer, bint writable):
    """A flat unsigned-byte memoryview of a C-contiguous buffer."""
    view = memoryview(buffer)
    if not view.c_contiguous:
        raise FrameError(f"buffer of shape {view.shape} is not C-contiguous")
    if writable and view.readonly:
        raise FrameError("cannot receive into a read-only buffer")
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    return view


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
        raise FrameError(f"connection closed after {done} of {size} bytes")
    if status == IO_TIMEOUT:
        raise socket.timeout("timed out")
    raise OSError(err, os.strerror(err))


# ---------------------------------------------------------------- header

def pack_header(msg_type, flags, dtype, sample_ids, positions, n_tokens, shape, seq):
    """The fixed header and sample table of a frame (its crc computed), ready to send."""
    msg_type = _uint("msg_type", msg_type, 255)
    if msg_type not in MSG_TYPES:
        raise FrameError(f"unknown msg_type {msg_type}")
    flags = _uint("flags", flags, 255)
    if flags & ~FLAG_PREFILL:
        raise FrameError(f"reserved bits set in flags {flags:#04x}")
    dtype = _uint("dtype", dtype, 255)
    if dtype not in ITEMSIZE:
        raise FrameError(f"unknown dtype code {dtype}")
    ids = [_uint("sample id", s, U32_MAX) for s in sample_ids]
    pos = [_uint("position", position, U32_MAX) for position in positions]
    if len(ids) != len(pos):
        raise FrameError(f"{len(ids)} sample ids but {len(pos)} positions")
    if len(ids) > MAX_SAMPLES:
        raise FrameError(f"n_samples {len(ids)} exceeds MAX_SAMPLES {MAX_SAMPLES}")
    dims = [_uint("shape dim", d, U32_MAX) for d in shape]
    if len(dims) > MAX_NDIM:
        raise FrameError(f"ndim {len(dims)} exceeds {MAX_NDIM}")
    n_tokens = _uint("n_tokens", n_tokens, U32_MAX)
    seq = _uint("seq", seq, U32_MAX)
    cdef Py_ssize_t ndim = len(dims), n = len(ids), i
    payload_len = _payload_len(ndim, dims, ITEMSIZE[dtype])
    if payload_len >= 2 ** 64:
        raise FrameError(f"payload_len {payload_len} of shape {tuple(dims)} "
                         f"does not fit in 64 bits")

    out = PyBytes_FromStringAndSize(NULL, C_HEADER_SIZE + ENTRY_SIZE * n)
    cdef unsigned char* buf = <unsigned char*> PyBytes_AS_STRING(out)
    memcpy(buf, b"MDIE", 4)
    buf[4] = VERSION
    buf[5] = <uint8_t> msg_type
    buf[6] = <uint8_t> flags
    buf[7] = <uint8_t> dtype
    _put16(buf + 8, <uint32_t> n)
    _put16(buf + 10, <uint32_t> ndim)
    _put32(buf + 12, <uint32_t> n_tokens)
    for i in range(C_MAX_NDIM):
        _put32(buf + 16 + 4 * i, <uint32_t> dims[i] if i < ndim else 0)
    _put32(buf + 32, <uint32_t> seq)
    _put64(buf + 36, <uint64_t> payload_len)
    for i in range(n):
        _put32(buf + C_HEADER_SIZE + ENTRY_SIZE * i, <uint32_t> ids[i])
        _put32(buf + C_HEADER_SIZE + ENTRY_SIZE * i + 4, <uint32_t> pos[i])
    cdef uint32_t crc = _crc32(0, buf, CRC_OFFSET)
    crc = _crc32(crc, buf + C_HEADER_SIZE, ENTRY_SIZE * n)
    _put32(buf + CRC_OFFSET, crc)
    return out


cdef object _parse_fixed(const unsigned char* p, object max_payload):
    cdef uint32_t msg_type = p[5], flags = p[6], dtype = p[7]
    cdef uint32_t n_samples = _get16(p + 8)
    cdef int ndim = _get16(p + 10), i
    cdef uint64_t payload_len = _get64(p + 36), expected
    cdef uint32_t[4] d
    cdef bint overflow = False
    if p[0] != b'M' or p[1] != b'D' or p[2] != b'I' or p[3] != b'E':
        raise FrameError(f"bad magic {(<const char*> p)[:4]!r}, expected {MAGIC!r}")
    if p[4] != VERSION:
        raise FrameError(f"unsupported version {p[4]}, expected {VERSION}")
    if msg_type < ACTIVATION or msg_type > SHUTDOWN:
        raise FrameError(f"unknown msg_type {msg_type}")
    if flags & ~(<uint32_t> FLAG_PREFILL):
        raise FrameError(f"reserved bits set in flags {flags:#04x}")
    if dtype >= 6:
        raise FrameError(f"unknown dtype code {dtype}")
    if n_samples > C_MAX_SAMPLES:
        raise FrameError(f"n_samples {n_samples} exceeds MAX_SAMPLES {MAX_SAMPLES}")
    if ndim > C_MAX_NDIM:
        raise FrameError(f"ndim {ndim} exceeds {MAX_NDIM}")
    for i in range(C_MAX_NDIM):
        d[i] = _get32(p + 16 + 4 * i)
    for i in range(ndim, C_MAX_NDIM):
        if d[i]:
            raise FrameError(f"shape {(d[0], d[1], d[2], d[3])} has nonzero dim {d[i]} "
                             f"beyond ndim {ndim}")
    expected = C_ITEMSIZE[dtype] if ndim else 0
    for i in range(ndim):
        if d[i] == 0:
            expected, overflow = 0, False
            break
        if expected > UINT64_MAX // d[i]:
            overflow = True
        expected *= d[i]
    dims = tuple([d[i] for i in range(ndim)])
    if overflow or payload_len != expected:
        exact = _payload_len(ndim, dims, C_ITEMSIZE[dtype])  # a Python int: no overflow
        raise FrameError(f"payload_len {payload_len} does not match shape {dims} "
                         f"of dtype code {dtype} ({exact} bytes)")
    if payload_len > max_payload:
        raise FrameError(f"payload_len {payload_len} exceeds max_payload {max_payload}")
    return FrameHeader(msg_type, flags, dtype, (), (), _get32(p + 12), dims, _get32(p + 32),
                       payload_len)


cdef object _fill_table(object header, const unsigned char* fixed, const unsigned char* table,
                        size_t table_len):
    cdef size_t n_samples = _get16(fixed + 8), i
    if table_len != ENTRY_SIZE * n_samples:
        raise FrameError(f"sample table is {table_len} bytes, expected {ENTRY_SIZE * n_samples}")
    cdef uint32_t sent = _get32(fixed + CRC_OFFSET)
    cdef uint32_t computed = _crc32(_crc32(0, fixed, CRC_OFFSET), table, table_len)
    if sent != computed:
        raise FrameError(f"crc32 {sent:#010x} does not match header and table ({computed:#010x})")
    header.sample_ids = tuple([_get32(table + ENTRY_SIZE * i) for i in range(n_samples)])
    header.positions = tuple([_get32(table + ENTRY_SIZE * i + 4) for i in range(n_samples)])


def parse_header(fixed, max_payload):
    """Validate a 48-byte fixed header (all but its crc, which ``parse_table`` checks).

    The returned header has empty ``sample_ids``/``positions``; the table that follows is
    ``8 * n_samples`` bytes, with n_samples checked against MAX_SAMPLES."""
    cdef const unsigned char[::1] view = _byte_view(fixed, False)
    if view.shape[0] != C_HEADER_SIZE:
        raise FrameError(f"fixed header is {view.shape[0]} bytes, expected {HEADER_SIZE}")
    return _parse_fixed(&view[0], max_payload)


def parse_table(header, fixed, table):
    """Check the crc over ``fixed`` + ``table`` and fill the header's sample ids/positions."""
    cdef const unsigned char[::1] f = _byte_view(fixed, False)
    cdef const unsigned char[::1] t = _byte_view(table, False)
    if f.shape[0] != C_HEADER_SIZE:
        raise FrameError(f"fixed header is {f.shape[0]} bytes, expected {HEADER_SIZE}")
    cdef unsigned char empty = 0
    cdef const unsigned char* table_p = &empty
    if t.shape[0]:
        table_p = &t[0]
    _fill_table(header, &f[0], table_p, t.shape[0])


# ---------------------------------------------------------------- socket loops (GIL released)

cdef int _recv_loop(int fd, unsigned char* buf, size_t size, size_t* done, int timeout_ms,
                    int* err) noexcept nogil:
    cdef ssize_t n
    cdef int e, ready
    cdef pollfd pfd
    while done[0] < size:
        n = recv(fd, buf + done[0], size - done[0], 0)
        if n > 0:
            done[0] += <size_t> n
            continue
        if n == 0:
            return IO_EOF
        e = errno
        if e == EINTR:
            return IO_EINTR
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


cdef int _recv_exact(object sock, unsigned char* buf, size_t size) except -1:
    cdef int fd = sock.fileno()
    cdef int timeout_ms = _timeout_ms(sock)
    cdef size_t done = 0
    cdef int status, err = 0
    while True:
        with nogil:
            status = _recv_loop(fd, buf, size, &done, timeout_ms, &err)
        if status == IO_DONE:
            return 0
        if status == IO_EINTR:
            PyErr_CheckSignals()  # a signal handler's exception propagates; else retry
            continue
        _raise_io(status, err, done, size)


def recv_exact_into(sock, buffer):
    """Receive exactly ``len(buffer)`` bytes into the writable ``buffer``.

    A peer that closes first gives a FrameError; the socket's timeout gives
    ``socket.timeout``; other failures an OSError."""
    cdef unsigned char[::1] view = _byte_view(buffer, True)
    if view.shape[0]:
        _recv_exact(sock, &view[0], view.shape[0])


def send_all(sock, header_bytes, payload):
    """Send ``header_bytes`` then ``payload`` (any C-contiguous buffer, or None) as one
    gather write, with no concatenation copy, until every byte is out."""
    cdef const unsigned char[::1] head = _byte_view(header_bytes, False)
    cdef const unsigned char[::1] body = _byte_view(b"" if payload is None else payload, False)
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
    """Read and validate one frame's fixed header and sample table (not its payload)."""
    cdef unsigned char[C_HEADER_SIZE] fixed
    cdef unsigned char[TABLE_MAX] table
    _recv_exact(sock, fixed, C_HEADER_SIZE)
    header = _parse_fixed(fixed, max_payload)
    cdef size_t table_len = ENTRY_SIZE * _get16(fixed + 8)  # at most 8 * MAX_SAMPLES, checked
    if table_len:
        _recv_exact(sock, table, table_len)
    _fill_table(header, fixed, table, table_len)
    return header
