"""Data-plane framing, pure Python: the twin of ``ext/_cframing.pyx``, same API and errors: header
packing with ``struct`` and the socket loops; the wire format, constants and checks come from
``_framingconstants``."""
from __future__ import annotations

import os
import select
import struct
import time
import zlib
from typing import Any, List, Optional, Sequence

from ._framingconstants import (
    ACTIVATION, CODEC_SHIFT, CRC_OFFSET, ELIGIBLE_BIT, ENTRY_SIZE, FLAG_CODEC, FLAG_PREFILL,
    FLAG_SEALED, FLAGS_KNOWN, FLOAT32, HEADER_SIZE, ITEMSIZE, MAGIC, MAX_BUSY_POLL_US,
    MAX_EXIT_DEPTH, MAX_NDIM, MAX_POSITION, MAX_SAMPLES, MIN_READ_BUFFER, MSG_TYPES, PING,
    READ_BUFFER, RELEASE, SHUTDOWN, TAG_SIZE, VERSION, FrameHeader, byte_view, check_busy_poll,
    check_capacity, check_crc, check_eligible, check_fields, check_fixed_size, check_pack_args,
    check_table_size, closed_early, codec_of)

# the API both twins share
__all__ = ["ACTIVATION", "CODEC_SHIFT", "CRC_OFFSET", "ELIGIBLE_BIT", "ENTRY_SIZE", "FLAG_CODEC",
           "FLAG_PREFILL", "FLAG_SEALED", "FLAGS_KNOWN", "FLOAT32", "HEADER_SIZE", "ITEMSIZE",
           "MAGIC", "MAX_BUSY_POLL_US", "MAX_EXIT_DEPTH", "MAX_NDIM", "MAX_POSITION",
           "MAX_SAMPLES", "MIN_READ_BUFFER", "MSG_TYPES", "PING", "READ_BUFFER", "RELEASE",
           "SHUTDOWN", "TAG_SIZE", "VERSION", "FrameHeader", "byte_view", "check_busy_poll",
           "check_capacity", "check_crc", "check_eligible", "check_fields", "check_fixed_size",
           "check_pack_args", "check_table_size", "closed_early", "codec_of", "FrameReader",
           "pack_header", "parse_header", "parse_table", "recv_exact_into", "recv_frame_header",
           "send_all"]

_FIXED = struct.Struct("<4sBBBBHBBI4IIQ")  # everything before the crc
_CRC = struct.Struct("<I")
_ENTRY = struct.Struct("<II")
_N_SAMPLES = struct.Struct("<H")
if (_FIXED.size, _ENTRY.size) != (CRC_OFFSET, ENTRY_SIZE):
    raise ImportError("_pyframing packs another layout than mdiedge.runtime._framingconstants")


def pack_header(msg_type: int, flags: int, dtype: int, sample_ids: Sequence[int],
                positions: Sequence[int], n_tokens: int, shape: Sequence[int], seq: int,
                exit_depth: int = 0, eligible: Sequence[bool] = ()) -> bytes:
    """Fixed header and sample table, crc computed; ``eligible``: a flag per sample, or empty."""
    msg_type, flags, dtype, ids, words, n_tokens, dims, seq, exit_depth, size = check_pack_args(
        msg_type, flags, dtype, sample_ids, positions, n_tokens, shape, seq, exit_depth, eligible)
    ndim = len(dims)
    fixed = _FIXED.pack(MAGIC, VERSION, msg_type, flags, dtype, len(ids), ndim, exit_depth,
                        n_tokens, *dims, *[0] * (MAX_NDIM - ndim), seq, size)
    table = bytearray(ENTRY_SIZE * len(ids))
    for i, entry in enumerate(zip(ids, words)):
        _ENTRY.pack_into(table, i * ENTRY_SIZE, *entry)
    crc = zlib.crc32(table, zlib.crc32(fixed))
    return fixed + _CRC.pack(crc) + bytes(table)


def parse_header(fixed: Any, max_payload: int) -> FrameHeader:
    """The 48-byte fixed header (its crc is ``parse_table``'s); ``sample_ids``, ``positions``,
    ``eligible`` empty; the table after it is ``8 * n_samples`` bytes."""
    fixed = byte_view(fixed, writable=False)
    check_fixed_size(len(fixed))
    (magic, version, msg_type, flags, dtype, n_samples, ndim, exit_depth, n_tokens,
     d0, d1, d2, d3, seq, size) = _FIXED.unpack_from(fixed)
    dims = (d0, d1, d2, d3)
    check_fields(magic, version, msg_type, flags, dtype, n_samples, ndim, exit_depth, dims, size,
                 max_payload)
    return FrameHeader(msg_type, flags, dtype, (), (), n_tokens, dims[:ndim], seq, size,
                       exit_depth, ())


def parse_table(header: FrameHeader, fixed: Any, table: Any) -> None:
    """Check the crc and eligible bits, fill sample ids, positions, eligible flags and ``wire``."""
    fixed = byte_view(fixed, writable=False)
    table = byte_view(table, writable=False)
    check_fixed_size(len(fixed))
    check_table_size(len(table), _N_SAMPLES.unpack_from(fixed, 8)[0])
    check_crc(_CRC.unpack_from(fixed, CRC_OFFSET)[0],
              zlib.crc32(table, zlib.crc32(fixed[:CRC_OFFSET])))
    ids: List[int] = []
    pos: List[int] = []
    bits: List[bool] = []
    for sample_id, word in _ENTRY.iter_unpack(table):
        ids.append(sample_id)
        pos.append(word & MAX_POSITION)
        bits.append(bool(word & ELIGIBLE_BIT))
    check_eligible(header.msg_type, header.flags, bits)
    header.sample_ids, header.positions, header.eligible = tuple(ids), tuple(pos), tuple(bits)
    header.wire = bytes(fixed) + bytes(table)


def recv_exact_into(sock: Any, buffer: Any) -> None:
    """A peer closing first is a FrameError; the timeout ``socket.timeout``; else OSError."""
    view = byte_view(buffer, writable=True)
    size, got = len(view), 0
    while got < size:
        n = sock.recv_into(view[got:], size - got)
        if n == 0:
            raise closed_early(got, size)
        got += n


def send_all(sock: Any, header_bytes: Any, payload: Optional[Any]) -> None:
    """One gather write, no concatenation copy, until every byte is out."""
    views = [byte_view(header_bytes, writable=False)]
    if payload is not None:
        views.append(byte_view(payload, writable=False))
    views = [v for v in views if len(v)]
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= len(views[0]):
            sent -= len(views[0])
            views.pop(0)
        if views and sent:
            views[0] = views[0][sent:]


def recv_frame_header(sock: Any, max_payload: int) -> FrameHeader:
    """Fixed header and sample table, one receive each, nothing past them."""
    fixed = bytearray(HEADER_SIZE)
    recv_exact_into(sock, fixed)
    header = parse_header(fixed, max_payload)
    table = bytearray(ENTRY_SIZE * _N_SAMPLES.unpack_from(fixed, 8)[0])
    recv_exact_into(sock, table)
    parse_table(header, fixed, table)
    return header


class FrameReader:
    """Frames through a ``capacity``-byte buffer: one ``recv`` takes whatever has arrived, so a
    small frame (and those queued behind) comes in one system call; payload beyond the buffer goes
    straight to its destination. ``capacity`` 0: nothing read past the frame (the socket may change
    hands). ``busy_poll_us`` > 0: an empty receive polls that long (yielding the core) before
    sleeping in the kernel. After an error the stream position is unknown."""

    def __init__(self, sock: Any, capacity: int = READ_BUFFER, busy_poll_us: int = 0) -> None:
        self.sock, self.greedy = sock, check_capacity(capacity) > 0
        self.busy_poll_us = check_busy_poll(busy_poll_us)
        self._poller = None
        if self.busy_poll_us:
            self._poller = select.poll()
            self._poller.register(sock, select.POLLIN)
        self._view = memoryview(bytearray(max(capacity, MIN_READ_BUFFER)))
        self._start = self._end = 0

    @property
    def buffered(self) -> int:
        return self._end - self._start

    def _fill(self, need: int, base: int) -> memoryview:
        """The first ``need`` unconsumed bytes; a peer closing first is named by the bytes after
        ``base``."""
        if self._end - self._start < need:
            if len(self._view) - self._start < need:  # move the rest to the front
                have = self._end - self._start
                self._view[:have] = bytes(self._view[self._start:self._end])
                self._start, self._end = 0, have
            limit = len(self._view) if self.greedy else self._start + need
            self._await()
            while self._end - self._start < need:
                n = self.sock.recv_into(self._view[self._end:limit])
                if n == 0:
                    raise closed_early(self._end - self._start - base, need - base)
                self._end += n
        return self._view[self._start:self._start + need]

    def recv_header(self, max_payload: int) -> FrameHeader:
        header = parse_header(self._fill(HEADER_SIZE, 0), max_payload)
        size = HEADER_SIZE + ENTRY_SIZE * _N_SAMPLES.unpack_from(self._view, self._start + 8)[0]
        frame = self._fill(size, HEADER_SIZE)
        parse_table(header, frame[:HEADER_SIZE], frame[HEADER_SIZE:])
        self._consume(size)
        return header

    def recv_into(self, buffer: Any) -> None:
        """Buffered bytes first, the rest from the socket."""
        view = byte_view(buffer, writable=True)
        size = len(view)
        take = min(size, self._end - self._start)
        view[:take] = self._view[self._start:self._start + take]
        self._consume(take)
        got = take
        if got < size:
            self._await()
        while got < size:
            n = self.sock.recv_into(view[got:], size - got)
            if n == 0:
                raise closed_early(got, size)
            got += n

    def _await(self) -> None:
        """Poll up to ``busy_poll_us`` (at most the timeout; not on a non-blocking socket)."""
        timeout = self.sock.gettimeout() if self._poller is not None else 0
        if timeout == 0:
            return
        spin = self.busy_poll_us / 1e6
        deadline = time.perf_counter() + (spin if timeout is None else min(spin, timeout))
        while not self._poller.poll(0) and time.perf_counter() < deadline:
            os.sched_yield()

    def _consume(self, size: int) -> None:
        self._start += size
        if self._start == self._end:
            self._start = self._end = 0
