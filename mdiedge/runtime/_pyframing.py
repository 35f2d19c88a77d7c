"""Data-plane framing, pure Python: the twin of ``ext/_cframing.pyx``, with the same API and
errors. It owns the packing and unpacking of a header with ``struct`` and the socket loops; the
wire format (documented in ``mdiedge/runtime/_framingconstants.py``), its constants and its checks
are imported from there."""
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
    """The fixed header and sample table of a frame (its crc computed), ready to send;
    ``eligible``: one flag per sample, or empty when no row is eligible to exit."""
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
    """Validate a 48-byte fixed header (all but its crc, which ``parse_table`` checks).

    The returned header has empty ``sample_ids``/``positions``/``eligible``; the table that
    follows is ``8 * n_samples`` bytes, with n_samples checked against MAX_SAMPLES."""
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
    """Check the crc over ``fixed`` + ``table`` and the eligible bits, and fill the header's
    sample ids, positions and eligible flags, and its ``wire`` (``fixed`` + ``table``)."""
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
    """Receive exactly ``len(buffer)`` bytes into the writable ``buffer``.

    A peer that closes first gives a FrameError; the socket's timeout gives
    ``socket.timeout``; other failures an OSError."""
    view = byte_view(buffer, writable=True)
    size, got = len(view), 0
    while got < size:
        n = sock.recv_into(view[got:], size - got)
        if n == 0:
            raise closed_early(got, size)
        got += n


def send_all(sock: Any, header_bytes: Any, payload: Optional[Any]) -> None:
    """Send ``header_bytes`` then ``payload`` (any C-contiguous buffer, or None) as one
    gather write, with no concatenation copy, until every byte is out."""
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
    """Read and validate one frame's fixed header and sample table (not its payload), and
    nothing past them: one receive for each."""
    fixed = bytearray(HEADER_SIZE)
    recv_exact_into(sock, fixed)
    header = parse_header(fixed, max_payload)
    table = bytearray(ENTRY_SIZE * _N_SAMPLES.unpack_from(fixed, 8)[0])
    recv_exact_into(sock, table)
    parse_table(header, fixed, table)
    return header


class FrameReader:
    """Frames from one socket through a receive buffer of ``capacity`` bytes: one ``recv`` takes
    whatever has arrived, so a small frame's header, table and payload (and frames queued behind it)
    come in one system call; payload bytes beyond those buffered are received straight into their
    destination. ``capacity`` 0: each step reads exactly the bytes it needs, nothing past the frame
    (the socket may change hands between frames). ``busy_poll_us`` > 0: a receive that finds nothing
    polls the socket for up to that long (yielding the core between polls) before it sleeps in the
    kernel, so that a frame arriving soon costs no wake-up. Errors as ``recv_exact_into``; after
    one, the stream position is unknown."""

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
        """The first ``need`` unconsumed bytes, receiving until they are there; a peer that
        closes first is named by the bytes after ``base`` (those of the current part)."""
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
        """Read and validate one frame's fixed header and sample table (not its payload)."""
        header = parse_header(self._fill(HEADER_SIZE, 0), max_payload)
        size = HEADER_SIZE + ENTRY_SIZE * _N_SAMPLES.unpack_from(self._view, self._start + 8)[0]
        frame = self._fill(size, HEADER_SIZE)
        parse_table(header, frame[:HEADER_SIZE], frame[HEADER_SIZE:])
        self._consume(size)
        return header

    def recv_into(self, buffer: Any) -> None:
        """Fill the writable ``buffer``: buffered bytes first, the rest from the socket."""
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
        """Poll for up to ``busy_poll_us`` (at most the socket's timeout; not at all on a
        non-blocking socket) until the socket has something to read."""
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
