"""The data-plane wire format: its constants and every check, with their error messages, that
both framing implementations (``ext/_cframing.pyx`` and ``mdiedge/runtime/_pyframing.py``)
import from here, so that neither carries a copy.

A frame is a 48-byte fixed header, a sample table and the raw bytes of one C-contiguous
tensor. All fields are little-endian:

====== ======= ====================================================================
offset type    field
====== ======= ====================================================================
0      4s      magic ``b"MDIE"``
4      u8      version (3: ndim a u8, exit_depth, the eligible bit of positions)
5      u8      msg_type: ACTIVATION 1, RELEASE 2, PING 3, SHUTDOWN 5 (4 is reserved)
6      u8      flags: bit 0 PREFILL, bits 1-2 the payload's codec (0 none, 1 fp16, 2 int8;
               ``mdiedge.base.codecs``; not 0 only with dtype float32), bit 3 SEALED, bit 4
               REWIND (a decode step may start before its KV fill: speculative decoding
               drops the rows past what the model kept), the others reserved (0)
7      u8      dtype code, a key of ``ITEMSIZE`` (``mdiedge.base.dtypes``)
8      u16     n_samples B (at most MAX_SAMPLES)
10     u8      ndim (at most MAX_NDIM; 0 means the frame carries no tensor)
11     u8      exit_depth: 0, or the number of blocks (1..255) that ran before the whole
               message exited early; not 0 only in an ACTIVATION frame without PREFILL
12     u32     n_tokens (tokens per sample in this message)
16     u32 x 4 shape (dims beyond ndim are 0)
32     u32     seq (the sender's message counter)
36     u64     payload_len: prod(shape) * itemsize for codec none, the codec's encoded size of
               prod(shape) float32 values otherwise; 0 when ndim is 0
44     u32     CRC-32 (zlib's, IEEE 802.3) of bytes 0..44 followed by the sample table
====== ======= ====================================================================

A SEALED frame (every frame of a link sealed in its handshake, ``mdiedge.runtime.seal``)
carries its payload encrypted, and after it (right after the sample table when there is no
payload) a TAG_SIZE-byte AEAD tag over the header and table (in the clear, as associated data)
and the payload, under the link's key for that direction and the frame's counter; a frame
whose tag does not verify (altered, replayed, reordered, or one was dropped) is an
``IntegrityError``. payload_len counts the payload alone, not the tag. The header's fields
are bounds-checked, as in any frame, before anything is allocated, and authenticated with
the payload once it is in.

The sample table holds B pairs (u32 sample id, u32 position word); the payload follows it.
A position word holds the row's position in bits 0-30 (at most MAX_POSITION) and, in bit 31
(ELIGIBLE_BIT), whether the row is eligible to exit early in this step: set only in an
ACTIVATION frame without PREFILL. ``FrameHeader.positions`` are the positions alone,
``FrameHeader.eligible`` the bits as bools (one per sample).
Every problem is a ``FrameError`` whose one-line message names the field and its value;
nothing is allocated from a length that has not been checked: every dim is bounded by
max_payload (the decoded tensor's extent, whatever the codec), even in a tensor with no
elements (a zero dim does not make ``(0, 2**32-1, 2**32-1)`` allocatable). After a
FrameError on a receiving socket the stream position is unknown, so the caller must close
the link.
"""
from __future__ import annotations

import operator
from typing import Any, List, Sequence, Tuple

from ..base.codecs import NAMES as CODEC_NAMES, encoded_size
from ..base.defaults import MAX_BUSY_POLL_US
from ..base.dtypes import ITEMSIZE
from ..base.errors import FrameError

MAGIC = b"MDIE"
VERSION = 4
HEADER_SIZE = 48
CRC_OFFSET = 44  # the crc covers the bytes before it, then the sample table
ENTRY_SIZE = 8  # one sample-table entry: u32 sample id, u32 position word
MAX_SAMPLES = 1024
MAX_NDIM = 4
MAX_EXIT_DEPTH = 255
ELIGIBLE_BIT = 0x80000000  # of a position word; the bits below it are the position
MAX_POSITION = ELIGIBLE_BIT - 1
MIN_READ_BUFFER = HEADER_SIZE + ENTRY_SIZE * MAX_SAMPLES  # the largest header and table
READ_BUFFER = 64 << 10  # a FrameReader's default receive buffer (bytes)

ACTIVATION, RELEASE, PING, SHUTDOWN = 1, 2, 3, 5  # 4 was a PONG that no node ever sent
MSG_TYPES = (ACTIVATION, RELEASE, PING, SHUTDOWN)
MSG_NAMES = {ACTIVATION: "ACTIVATION", RELEASE: "RELEASE", PING: "PING", SHUTDOWN: "SHUTDOWN"}
FLAG_PREFILL = 0x01
CODEC_SHIFT, FLAG_CODEC = 1, 0x06  # the codec field of flags
FLAG_SEALED = 0x08  # the payload is encrypted and a TAG_SIZE-byte tag follows it
FLAG_REWIND = 0x10  # rows may start at or before their KV fill (``runtime.slots``)
FLAG_ALL_ROWS = 0x20  # a prefill whose every row goes back to the head (prompt logprobs)
FLAGS_KNOWN = FLAG_PREFILL | FLAG_CODEC | FLAG_SEALED | FLAG_REWIND | FLAG_ALL_ROWS
TAG_SIZE = 16
FLOAT32 = 0  # the only dtype code a codec other than none applies to

U32_MAX = 2 ** 32 - 1
U64_LIMIT = 2 ** 64


class FrameHeader:
    """A validated header; ``shape`` has ``ndim`` dims (empty when the frame has no tensor);
    ``eligible`` has one bool per sample (all False when no row is eligible to exit);
    ``wire``: a received header's bytes, fixed header and sample table as they came (what a
    sealed frame's tag authenticates), else b"" (not a field: equality ignores it)."""

    FIELDS = ("msg_type", "flags", "dtype", "sample_ids", "positions", "n_tokens", "shape",
              "seq", "payload_len", "exit_depth", "eligible")
    __slots__ = FIELDS + ("wire",)

    def __init__(self, msg_type: int, flags: int, dtype: int, sample_ids: Tuple[int, ...],
                 positions: Tuple[int, ...], n_tokens: int, shape: Tuple[int, ...], seq: int,
                 payload_len: int, exit_depth: int = 0, eligible: Tuple[bool, ...] = ()) -> None:
        self.msg_type = msg_type
        self.flags = flags
        self.dtype = dtype
        self.sample_ids = sample_ids
        self.positions = positions
        self.n_tokens = n_tokens
        self.shape = shape
        self.seq = seq
        self.payload_len = payload_len
        self.exit_depth = exit_depth
        self.eligible = eligible
        self.wire = b""

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.FIELDS)
        return f"FrameHeader({fields})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, FrameHeader):
            return NotImplemented
        return all(getattr(self, n) == getattr(other, n) for n in self.FIELDS)


# ---------------------------------------------------------------- sending: the arguments

def _uint(field: str, value: Any, limit: int) -> int:
    try:
        number = operator.index(value)
    except TypeError:
        raise FrameError(f"{field} {value!r} is not an integer") from None
    if not 0 <= number <= limit:
        raise FrameError(f"{field} {value!r} outside 0..{limit}")
    return number


def payload_len(dims: Sequence[int], itemsize: int, codec: int = 0) -> int:
    """Bytes of a tensor of shape ``dims`` (0 for no dims: a frame without a tensor), encoded
    with ``codec`` (then its elements are float32)."""
    if not dims:
        return 0
    total = 1
    for d in dims:
        total *= d
    return total * itemsize if codec == 0 else encoded_size(codec, total)


def codec_of(flags: int) -> int:
    return (flags & FLAG_CODEC) >> CODEC_SHIFT


def check_codec(flags: int, dtype: int) -> int:
    """The codec of valid ``flags`` for a payload of ``dtype``, else a FrameError."""
    codec = codec_of(flags)
    if codec not in CODEC_NAMES:
        raise FrameError(f"unknown codec {codec} in flags {flags:#04x}")
    if codec and dtype != FLOAT32:
        raise FrameError(f"codec {CODEC_NAMES[codec]} with dtype code {dtype}: codecs apply "
                         f"to float32 ({FLOAT32}) only")
    return codec


def exit_allowed(msg_type: int, flags: int) -> bool:
    """Whether a frame may carry early exit (exit_depth, eligible bits): ACTIVATION without
    PREFILL."""
    return msg_type == ACTIVATION and not flags & FLAG_PREFILL


def _not_decode(msg_type: int) -> str:
    kind = "prefill ACTIVATION" if msg_type == ACTIVATION else MSG_NAMES[msg_type]
    return f"on a {kind} frame: early exit applies to ACTIVATION frames without PREFILL only"


def check_exit_depth(msg_type: int, flags: int, exit_depth: int) -> None:
    if exit_depth and not exit_allowed(msg_type, flags):
        raise FrameError(f"exit_depth {exit_depth} {_not_decode(msg_type)}")


def check_eligible(msg_type: int, flags: int, eligible: Sequence[bool]) -> None:
    """No eligible bit set unless the frame may carry early exit."""
    if not exit_allowed(msg_type, flags) and any(eligible):
        row = next(i for i, bit in enumerate(eligible) if bit)
        raise FrameError(f"eligible[{row}] {eligible[row]!r} {_not_decode(msg_type)}")


def _flag(value: Any) -> bool:
    """An eligible flag as a bool: a bool (numpy's too) or the integer 0 or 1."""
    if value is True or value is False:
        return value
    if getattr(getattr(value, "dtype", None), "kind", None) == "b":
        return bool(value)
    return bool(_uint("eligible flag", value, 1))


def _check_table(msg_type: int, flags: int, sample_ids: Sequence[Any], positions: Sequence[Any],
                 eligible: Sequence[Any]) -> Tuple[List[int], List[int]]:
    """The sample ids and position words (eligible bit included) of a table to pack."""
    ids = [_uint("sample id", s, U32_MAX) for s in sample_ids]
    pos = [_uint("position", p, MAX_POSITION) for p in positions]
    if len(ids) != len(pos):
        raise FrameError(f"{len(ids)} sample ids but {len(pos)} positions")
    if len(ids) > MAX_SAMPLES:
        raise FrameError(f"n_samples {len(ids)} exceeds MAX_SAMPLES {MAX_SAMPLES}")
    bits = [_flag(e) for e in eligible]
    if not bits:
        return ids, pos
    if len(bits) != len(ids):
        raise FrameError(f"{len(ids)} sample ids but {len(bits)} eligible flags")
    check_eligible(msg_type, flags, bits)
    return ids, [p | ELIGIBLE_BIT if bit else p for p, bit in zip(pos, bits)]


def check_pack_args(msg_type: Any, flags: Any, dtype: Any, sample_ids: Sequence[Any],
                    positions: Sequence[Any], n_tokens: Any, shape: Sequence[Any], seq: Any,
                    exit_depth: Any = 0, eligible: Sequence[Any] = ()
                    ) -> Tuple[int, int, int, List[int], List[int], int, List[int], int, int, int]:
    """The arguments of ``pack_header`` checked and as ints, with the payload length:
    ``(msg_type, flags, dtype, ids, words, n_tokens, dims, seq, exit_depth, payload_len)``,
    ``words`` being the position words of the sample table (eligible bits included)."""
    msg_type = _uint("msg_type", msg_type, 255)
    if msg_type not in MSG_TYPES:
        raise FrameError(f"unknown msg_type {msg_type}")
    flags = _uint("flags", flags, 255)
    if flags & ~FLAGS_KNOWN:
        raise FrameError(f"reserved bits set in flags {flags:#04x}")
    dtype = _uint("dtype", dtype, 255)
    if dtype not in ITEMSIZE:
        raise FrameError(f"unknown dtype code {dtype}")
    codec = check_codec(flags, dtype)
    ids, words = _check_table(msg_type, flags, sample_ids, positions, eligible)
    dims = [_uint("shape dim", d, U32_MAX) for d in shape]
    if len(dims) > MAX_NDIM:
        raise FrameError(f"ndim {len(dims)} exceeds {MAX_NDIM}")
    exit_depth = _uint("exit_depth", exit_depth, MAX_EXIT_DEPTH)
    check_exit_depth(msg_type, flags, exit_depth)
    n_tokens = _uint("n_tokens", n_tokens, U32_MAX)
    seq = _uint("seq", seq, U32_MAX)
    extent = payload_len(dims, ITEMSIZE[dtype])  # the tensor's bytes, whatever the codec
    if extent >= U64_LIMIT:
        raise FrameError(f"payload_len of shape {tuple(dims)} ({extent} bytes as a tensor) "
                         f"does not fit in 64 bits")
    size = payload_len(dims, ITEMSIZE[dtype], codec)
    return msg_type, flags, dtype, ids, words, n_tokens, dims, seq, exit_depth, size


# ---------------------------------------------------------------- receiving: the fields

def check_fields(magic: bytes, version: int, msg_type: int, flags: int, dtype: int,
                 n_samples: int, ndim: int, exit_depth: int, dims: Tuple[int, int, int, int],
                 size: int, max_payload: int) -> None:
    """The fields of a received fixed header (all but its crc), or a FrameError naming the
    first one that is wrong, in offset order."""
    if magic != MAGIC:
        raise FrameError(f"bad magic {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise FrameError(f"unsupported version {version}, expected {VERSION}")
    if msg_type not in MSG_TYPES:
        raise FrameError(f"unknown msg_type {msg_type}")
    if flags & ~FLAGS_KNOWN:
        raise FrameError(f"reserved bits set in flags {flags:#04x}")
    if dtype not in ITEMSIZE:
        raise FrameError(f"unknown dtype code {dtype}")
    codec = check_codec(flags, dtype)
    if n_samples > MAX_SAMPLES:
        raise FrameError(f"n_samples {n_samples} exceeds MAX_SAMPLES {MAX_SAMPLES}")
    if ndim > MAX_NDIM:
        raise FrameError(f"ndim {ndim} exceeds {MAX_NDIM}")
    check_exit_depth(msg_type, flags, exit_depth)
    for d in dims[ndim:]:
        if d:
            raise FrameError(f"shape {tuple(dims)} has nonzero dim {d} beyond ndim {ndim}")
    shape = tuple(dims[:ndim])
    expected = payload_len(shape, ITEMSIZE[dtype], codec)
    if size != expected:
        raise FrameError(f"payload_len {size} does not match shape {shape} "
                         f"of dtype code {dtype} ({expected} bytes with codec "
                         f"{CODEC_NAMES[codec]})")
    if size > max_payload:
        raise FrameError(f"payload_len {size} exceeds max_payload {max_payload}")
    extent = payload_len([d or 1 for d in shape], ITEMSIZE[dtype])
    limit = min(max_payload, U64_LIMIT - 1)  # a coded payload may be small, its tensor not
    if extent > limit:  # a zero dim empties the tensor, but not the others' product
        raise FrameError(f"shape {shape} of dtype code {dtype} exceeds max_payload "
                         f"{limit}: its nonzero dims span {extent} bytes")


def check_fixed_size(size: int) -> None:
    if size != HEADER_SIZE:
        raise FrameError(f"fixed header is {size} bytes, expected {HEADER_SIZE}")


def check_table_size(size: int, n_samples: int) -> None:
    if size != ENTRY_SIZE * n_samples:
        raise FrameError(f"sample table is {size} bytes, expected {ENTRY_SIZE * n_samples}")


def check_crc(sent: int, computed: int) -> None:
    if sent != computed:
        raise FrameError(f"crc32 {sent:#010x} does not match header and table ({computed:#010x})")


def check_capacity(capacity: Any) -> int:
    """A FrameReader's buffer size: 0 (read exactly what each step needs) or at least
    MIN_READ_BUFFER bytes."""
    if isinstance(capacity, bool) or not isinstance(capacity, int) or not (
            capacity == 0 or MIN_READ_BUFFER <= capacity <= 1 << 30):
        raise FrameError(f"read buffer capacity {capacity!r} must be 0 or an integer "
                         f"{MIN_READ_BUFFER}..{1 << 30}")
    return capacity


def check_busy_poll(busy_poll_us: Any) -> int:
    """A FrameReader's busy poll: µs it polls for a frame before it sleeps in the kernel,
    0..MAX_BUSY_POLL_US (0: it sleeps at once)."""
    if isinstance(busy_poll_us, bool) or not isinstance(busy_poll_us, int) or not (
            0 <= busy_poll_us <= MAX_BUSY_POLL_US):
        raise FrameError(f"busy poll {busy_poll_us!r} must be an integer 0..{MAX_BUSY_POLL_US} µs")
    return busy_poll_us


def closed_early(done: int, size: int) -> FrameError:
    return FrameError(f"connection closed after {done} of {size} bytes")


# ---------------------------------------------------------------- buffers

def byte_view(buffer: Any, writable: bool) -> memoryview:
    """A flat unsigned-byte view of a C-contiguous buffer."""
    view = memoryview(buffer)
    if not view.c_contiguous:
        raise FrameError(f"buffer of shape {view.shape} is not C-contiguous")
    if writable and view.readonly:
        raise FrameError("cannot receive into a read-only buffer")
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    return view
