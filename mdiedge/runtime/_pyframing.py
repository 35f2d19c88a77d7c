"""Data-plane framing, pure Python (twin of ``ext/_cframing.pyx``, same API and errors).

A frame is a 48-byte fixed header, a sample table and the raw bytes of one C-contiguous
tensor. All fields are little-endian:

====== ======= ====================================================================
offset type    field
====== ======= ====================================================================
0      4s      magic ``b"MDIE"``
4      u8      version (1)
5      u8      msg_type: ACTIVATION, RELEASE, PING, PONG, SHUTDOWN
6      u8      flags: bit 0 PREFILL, the other bits reserved (0)
7      u8      dtype code, a key of ``ITEMSIZE``
8      u16     n_samples B (at most MAX_SAMPLES)
10     u16     ndim (at most 4; 0 means the frame carries no tensor)
12     u32     n_tokens (tokens per sample in this message)
16     u32 x 4 shape (dims beyond ndim are 0)
32     u32     seq (the sender's message counter)
36     u64     payload_len: prod(shape) * itemsize, or 0 when ndim is 0
44     u32     crc32 (zlib) of bytes 0..44 followed by the sample table
====== ======= ====================================================================

The sample table holds B pairs (u32 sample id, u32 position); the payload follows it.
Every problem is a ``FrameError`` whose one-line message names the field and its value;
nothing is allocated from a length that has not been checked. After a FrameError on a
receiving socket the stream position is unknown, so the caller must close the link.
"""
from __future__ import annotations

import operator
import struct
import zlib
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..base.errors import FrameError

MAGIC = b"MDIE"
VERSION = 1
HEADER_SIZE = 48
MAX_SAMPLES = 1024
MAX_NDIM = 4

ACTIVATION, RELEASE, PING, PONG, SHUTDOWN = 1, 2, 3, 4, 5
MSG_TYPES = (ACTIVATION, RELEASE, PING, PONG, SHUTDOWN)
FLAG_PREFILL = 0x01

# dtype code -> bytes per element: float32, float16, bfloat16, int64, int32, uint8
ITEMSIZE: Dict[int, int] = {0: 4, 1: 2, 2: 2, 3: 8, 4: 4, 5: 1}

U32_MAX = 2 ** 32 - 1

_FIXED = struct.Struct("<4sBBBBHHI4IIQ")  # everything before the crc: 44 bytes
_CRC = struct.Struct("<I")
_ENTRY = struct.Struct("<II")
_CRC_OFFSET = 44


class FrameHeader:
    """A validated header; ``shape`` has ``ndim`` dims (empty when the frame has no tensor)."""

    __slots__ = ("msg_type", "flags", "dtype", "sample_ids", "positions", "n_tokens", "shape",
                 "seq", "payload_len")

    def __init__(self, msg_type: int, flags: int, dtype: int, sample_ids: Tuple[int, ...],
                 positions: Tuple[int, ...], n_tokens: int, shape: Tuple[int, ...], seq: int,
                 payload_len: int) -> None:
        self.msg_type = msg_type
        self.flags = flags
        self.dtype = dtype
        self.sample_ids = sample_ids
        self.positions = positions
        self.n_tokens = n_tokens
        self.shape = shape
        self.seq = seq
        self.payload_len = payload_len

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.__slots__)
        return f"FrameHeader({fields})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, FrameHeader):
            return NotImplemented
        return all(getattr(self, n) == getattr(other, n) for n in self.__slots__)


def _uint(field: str, value: Any, limit: int) -> int:
    """``value`` as an int in 0..limit, else a FrameError naming ``field``."""
    try:
        number = operator.index(value)
    except TypeError:
        raise FrameError(f"{field} {value!r} is not an integer") from None
    if not 0 <= number <= limit:
        raise FrameError(f"{field} {value!r} outside 0..{limit}")
    return number


def _payload_len(ndim: int, dims: Sequence[int], itemsize: int) -> int:
    if ndim == 0:
        return 0
    total = itemsize
    for d in dims[:ndim]:
        total *= d
    return total


def pack_header(msg_type: int, flags: int, dtype: int, sample_ids: Sequence[int],
                positions: Sequence[int], n_tokens: int, shape: Sequence[int], seq: int) -> bytes:
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
    pos = [_uint("position", p, U32_MAX) for p in positions]
    if len(ids) != len(pos):
        raise FrameError(f"{len(ids)} sample ids but {len(pos)} positions")
    if len(ids) > MAX_SAMPLES:
        raise FrameError(f"n_samples {len(ids)} exceeds MAX_SAMPLES {MAX_SAMPLES}")
    dims = [_uint("shape dim", d, U32_MAX) for d in shape]
    if len(dims) > MAX_NDIM:
        raise FrameError(f"ndim {len(dims)} exceeds {MAX_NDIM}")
    n_tokens = _uint("n_tokens", n_tokens, U32_MAX)
    seq = _uint("seq", seq, U32_MAX)
    ndim = len(dims)
    payload_len = _payload_len(ndim, dims, ITEMSIZE[dtype])
    if payload_len >= 2 ** 64:
        raise FrameError(f"payload_len {payload_len} of shape {tuple(dims)} "
                         f"does not fit in 64 bits")
    dims += [0] * (MAX_NDIM - ndim)
    fixed = _FIXED.pack(MAGIC, VERSION, msg_type, flags, dtype, len(ids), ndim, n_tokens,
                        *dims, seq, payload_len)
    table = bytearray(_ENTRY.size * len(ids))
    for i, entry in enumerate(zip(ids, pos)):
        _ENTRY.pack_into(table, i * _ENTRY.size, *entry)
    crc = zlib.crc32(table, zlib.crc32(fixed))
    return fixed + _CRC.pack(crc) + bytes(table)


def parse_header(fixed: Any, max_payload: int) -> FrameHeader:
    """Validate a 48-byte fixed header (all but its crc, which ``parse_table`` checks).

    The returned header has empty ``sample_ids``/``positions``; the table that follows is
    ``8 * n_samples`` bytes, with n_samples checked against MAX_SAMPLES."""
    fixed = _byte_view(fixed, writable=False)
    if len(fixed) != HEADER_SIZE:
        raise FrameError(f"fixed header is {len(fixed)} bytes, expected {HEADER_SIZE}")
    (magic, version, msg_type, flags, dtype, n_samples, ndim, n_tokens,
     d0, d1, d2, d3, seq, payload_len) = _FIXED.unpack_from(fixed)
    if magic != MAGIC:
        raise FrameError(f"bad magic {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise FrameError(f"unsupported version {version}, expected {VERSION}")
    if msg_type not in MSG_TYPES:
        raise FrameError(f"unknown msg_type {msg_type}")
    if flags & ~FLAG_PREFILL:
        raise FrameError(f"reserved bits set in flags {flags:#04x}")
    if dtype not in ITEMSIZE:
        raise FrameError(f"unknown dtype code {dtype}")
    if n_samples > MAX_SAMPLES:
        raise FrameError(f"n_samples {n_samples} exceeds MAX_SAMPLES {MAX_SAMPLES}")
    if ndim > MAX_NDIM:
        raise FrameError(f"ndim {ndim} exceeds {MAX_NDIM}")
    dims = (d0, d1, d2, d3)
    for d in dims[ndim:]:
        if d:
            raise FrameError(f"shape {dims} has nonzero dim {d} beyond ndim {ndim}")
    expected = _payload_len(ndim, dims, ITEMSIZE[dtype])
    if payload_len != expected:
        raise FrameError(f"payload_len {payload_len} does not match shape {dims[:ndim]} "
                         f"of dtype code {dtype} ({expected} bytes)")
    if payload_len > max_payload:
        raise FrameError(f"payload_len {payload_len} exceeds max_payload {max_payload}")
    return FrameHeader(msg_type, flags, dtype, (), (), n_tokens, dims[:ndim], seq, payload_len)


def parse_table(header: FrameHeader, fixed: Any, table: Any) -> None:
    """Check the crc over ``fixed`` + ``table`` and fill the header's sample ids/positions."""
    fixed = _byte_view(fixed, writable=False)
    table = _byte_view(table, writable=False)
    n_samples = _n_samples(fixed)
    if len(table) != _ENTRY.size * n_samples:
        raise FrameError(f"sample table is {len(table)} bytes, expected {_ENTRY.size * n_samples}")
    sent = _CRC.unpack_from(fixed, _CRC_OFFSET)[0]
    computed = zlib.crc32(table, zlib.crc32(fixed[:_CRC_OFFSET]))
    if sent != computed:
        raise FrameError(f"crc32 {sent:#010x} does not match header and table ({computed:#010x})")
    ids: List[int] = []
    pos: List[int] = []
    for sample_id, position in _ENTRY.iter_unpack(table):
        ids.append(sample_id)
        pos.append(position)
    header.sample_ids, header.positions = tuple(ids), tuple(pos)


def _n_samples(fixed: memoryview) -> int:
    if len(fixed) != HEADER_SIZE:
        raise FrameError(f"fixed header is {len(fixed)} bytes, expected {HEADER_SIZE}")
    return int(struct.unpack_from("<H", fixed, 8)[0])


def _byte_view(buffer: Any, writable: bool) -> memoryview:
    """A flat unsigned-byte view of a C-contiguous buffer."""
    view = memoryview(buffer)
    if not view.c_contiguous:
        raise FrameError(f"buffer of shape {view.shape} is not C-contiguous")
    if writable and view.readonly:
        raise FrameError("cannot receive into a read-only buffer")
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    return view


def recv_exact_into(sock: Any, buffer: Any) -> None:
    """Receive exactly ``len(buffer)`` bytes into the writable ``buffer``.

    A peer that closes first gives a FrameError; the socket's timeout gives
    ``socket.timeout``; other failures an OSError."""
    view = _byte_view(buffer, writable=True)
    size, got = len(view), 0
    while got < size:
        n = sock.recv_into(view[got:], size - got)
        if n == 0:
            raise FrameError(f"connection closed after {got} of {size} bytes")
        got += n


def send_all(sock: Any, header_bytes: Any, payload: Optional[Any]) -> None:
    """Send ``header_bytes`` then ``payload`` (any C-contiguous buffer, or None) as one
    gather write, with no concatenation copy, until every byte is out."""
    views = [_byte_view(header_bytes, writable=False)]
    if payload is not None:
        views.append(_byte_view(payload, writable=False))
    views = [v for v in views if len(v)]
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= len(views[0]):
            sent -= len(views[0])
            views.pop(0)
        if views and sent:
            views[0] = views[0][sent:]


def recv_frame_header(sock: Any, max_payload: int) -> FrameHeader:
    """Read and validate one frame's fixed header and sample table (not its payload)."""
    fixed = bytearray(HEADER_SIZE)
    recv_exact_into(sock, fixed)
    header = parse_header(fixed, max_payload)
    table = bytearray(_ENTRY.size * _n_samples(memoryview(fixed)))
    recv_exact_into(sock, table)
    parse_table(header, fixed, table)
    return header
