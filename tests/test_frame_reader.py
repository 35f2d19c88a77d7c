"""``FrameReader``: frames received through a buffer (one system call for a small frame and
whatever queued behind it), against the compiled module and its pure-Python twin. Whatever
the chunking of the byte stream and the buffer's size, the frames read are the frames sent,
a reader of capacity 0 reads nothing past a frame, and a peer that closes mid-frame is named
as the unbuffered receive names it."""
from __future__ import annotations

import socket
import threading
import time
from types import ModuleType
from typing import Any, Iterator, List, Tuple

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mdiedge.runtime.framing import FRAMING
from mdiedge.base.errors import FrameError
from mdiedge.runtime import _framingconstants, framing

pytestmark = pytest.mark.twins
IMPLS = FRAMING.implementations()
FAST = settings(max_examples=40, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])
CAPACITIES = [0, _framingconstants.MIN_READ_BUFFER, _framingconstants.READ_BUFFER]


@pytest.fixture(params=IMPLS, ids=[m.__name__ for m in IMPLS])
def impl(request: pytest.FixtureRequest) -> ModuleType:
    return request.param


@pytest.fixture
def pair() -> Iterator[Tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    a.settimeout(10.0)
    b.settimeout(10.0)
    yield a, b
    a.close()
    b.close()


def frame_bytes(impl: ModuleType, ids: List[int], tensor: Any, seq: int) -> bytes:
    """One frame as the sender writes it: header, table, payload."""
    positions = list(range(len(ids)))
    if tensor is None:
        return impl.pack_header(framing.RELEASE, 0, framing.CONTROL_DTYPE, ids, positions, 0,
                                (), seq)
    header = impl.pack_header(framing.ACTIVATION, 0, framing.dtype_code(tensor.dtype), ids,
                              positions, tensor.shape[1], tuple(tensor.shape), seq)
    return header + framing.tensor_bytes(tensor).tobytes()


def send_in_chunks(sock: socket.socket, data: bytes, cuts: List[int]) -> threading.Thread:
    """Write ``data`` in pieces cut at ``cuts``, pausing between them, from a thread."""
    def run() -> None:
        start = 0
        for cut in sorted(set(c % (len(data) + 1) for c in cuts)) + [len(data)]:
            if cut > start:
                sock.sendall(data[start:cut])
                time.sleep(0.0005)
                start = cut
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


frames_strategy = st.lists(st.tuples(
    st.lists(st.integers(0, 2 ** 32 - 1), min_size=1, max_size=4),  # sample ids
    st.one_of(st.none(), st.integers(1, 3), st.integers(1, 70000)),  # no tensor, or its width
), min_size=1, max_size=6)


@FAST
@given(frames=frames_strategy, cuts=st.lists(st.integers(0, 10 ** 6), max_size=12),
       capacity=st.sampled_from(CAPACITIES), busy_poll=st.sampled_from([0, 50, 20_000]))
def test_frames_arrive_whatever_the_chunking(impl: ModuleType, frames: Any, cuts: List[int],
                                             capacity: int, busy_poll: int) -> None:
    """Pieces come 0.5 ms apart: a busy poll of 50 µs ends first and sleeps, one of 20 ms
    takes them while polling."""
    a, b = socket.socketpair()  # one per example: a failed one leaves no bytes behind
    with a, b:
        check_stream(impl, a, b, frames, cuts, capacity, busy_poll)


def check_stream(impl: ModuleType, a: socket.socket, b: socket.socket, frames: Any,
                 cuts: List[int], capacity: int, busy_poll: int = 0) -> None:
    b.settimeout(10.0)
    sent, stream = [], b""
    for seq, (ids, width) in enumerate(frames):
        tensor = None if width is None else torch.randn(len(ids), 1, width)
        sent.append((ids, tensor, seq))
        stream += frame_bytes(impl, ids, tensor, seq)
    thread = send_in_chunks(a, stream, cuts)
    reader = framing.reader(b, impl, capacity, busy_poll)
    for ids, tensor, seq in sent:
        header, got = framing.recv_frame(reader, 1 << 24, impl=impl)
        assert (list(header.sample_ids), header.seq) == (ids, seq)
        assert (got is None) if tensor is None else np.array_equal(got, tensor.numpy())
    thread.join()
    assert reader.buffered == 0


@pytest.mark.parametrize("capacity", CAPACITIES)
def test_a_large_payload_passes_the_buffer(impl: ModuleType, pair: Any, capacity: int) -> None:
    a, b = pair
    x = torch.randn(1, 4, 100_000)  # 1.6 MB: most of it received straight into the tensor
    thread = send_in_chunks(a, frame_bytes(impl, [7], x, 1) + frame_bytes(impl, [8], None, 2),
                            [100, 70_000])
    reader = framing.reader(b, impl, capacity)
    assert np.array_equal(framing.recv_frame(reader, 1 << 30, impl=impl)[1], x.numpy())
    assert framing.recv_frame(reader, 1 << 30, impl=impl)[0].sample_ids == (8,)
    thread.join()


def test_one_receive_takes_queued_frames(impl: ModuleType, pair: Any) -> None:
    a, b = pair
    first = frame_bytes(impl, [1], torch.randn(1, 1, 8), 0)
    second = frame_bytes(impl, [2], torch.randn(1, 1, 8), 1)
    a.sendall(first + second)
    time.sleep(0.05)
    reader = framing.reader(b, impl)
    framing.recv_frame(reader, 1 << 20, impl=impl)
    assert reader.buffered == len(second)
    b.setblocking(False)  # nothing left on the socket: the second frame is in the buffer
    assert framing.recv_frame(reader, 1 << 20, impl=impl)[0].sample_ids == (2,)


def test_capacity_zero_reads_nothing_past_the_frame(impl: ModuleType, pair: Any) -> None:
    a, b = pair
    a.sendall(frame_bytes(impl, [3], torch.randn(1, 2, 5), 0) + b"next")
    time.sleep(0.05)
    reader = framing.reader(b, impl, 0)
    framing.recv_frame(reader, 1 << 20, impl=impl)
    assert reader.buffered == 0 and b.recv(16) == b"next"
    a.sendall(frame_bytes(impl, [4], None, 1) + b"more")  # a plain socket reads the same way
    time.sleep(0.05)
    framing.recv_frame(b, 1 << 20, impl=impl)
    assert b.recv(16) == b"more"


@pytest.mark.parametrize("capacity,busy_poll", [(c, 0) for c in CAPACITIES] + [(0, 1000),
                                                  (_framingconstants.READ_BUFFER, 1000)])
@pytest.mark.parametrize("keep,message", [
    (20, "connection closed after 20 of 48 bytes"),                  # in the fixed header
    (52, "connection closed after 4 of 16 bytes"),                   # in the sample table
    (64 + 100, "connection closed after 100 of 160 bytes"),          # in the payload
])
def test_a_peer_closing_mid_frame_is_named(impl: ModuleType, pair: Any, capacity: int,
                                           busy_poll: int, keep: int, message: str) -> None:
    a, b = pair
    a.sendall(frame_bytes(impl, [1, 2], torch.randn(2, 1, 20), 0)[:keep])
    a.close()
    with pytest.raises(FrameError, match=f"^{message}$"):
        framing.recv_frame(framing.reader(b, impl, capacity, busy_poll), 1 << 20, impl=impl)


def test_a_bad_frame_is_refused_before_its_table(impl: ModuleType, pair: Any) -> None:
    a, b = pair
    data = bytearray(frame_bytes(impl, [1], torch.randn(1, 1, 4), 0))
    data[4] = 99  # the version
    a.sendall(bytes(data))
    with pytest.raises(FrameError, match="version"):
        framing.recv_frame(framing.reader(b, impl), 1 << 20, impl=impl)


@pytest.mark.parametrize("capacity", [-1, 1, _framingconstants.MIN_READ_BUFFER - 1, 1 << 31, 2.5,
                                      True, "64k"])
def test_a_bad_capacity_is_named(impl: ModuleType, pair: Any, capacity: Any) -> None:
    with pytest.raises(FrameError, match=r"^read buffer capacity .* must be 0 or an integer"):
        impl.FrameReader(pair[1], capacity)


@pytest.mark.parametrize("busy_poll", [-1, _framingconstants.MAX_BUSY_POLL_US + 1, 2.5, True, "200"])
def test_a_bad_busy_poll_is_named(impl: ModuleType, pair: Any, busy_poll: Any) -> None:
    with pytest.raises(FrameError, match=r"^busy poll .* must be an integer 0\.\.100000 µs$"):
        impl.FrameReader(pair[1], _framingconstants.READ_BUFFER, busy_poll)


def test_a_busy_poll_keeps_the_socket_timeout(impl: ModuleType, pair: Any) -> None:
    """The poll counts toward the timeout: a 100 ms poll on a socket that times out after
    50 ms gives up within about 50 ms of polling and 50 ms of sleep."""
    a, b = pair
    b.settimeout(0.05)
    reader = framing.reader(b, impl, busy_poll_us=_framingconstants.MAX_BUSY_POLL_US)
    start = time.monotonic()
    with pytest.raises(socket.timeout):
        framing.recv_frame(reader, 1 << 20, impl=impl)
    assert time.monotonic() - start < 1.0
    a.sendall(frame_bytes(impl, [5], None, 3))  # nothing was consumed: the link still works
    b.settimeout(10.0)
    assert framing.recv_frame(reader, 1 << 20, impl=impl)[0].sample_ids == (5,)


def test_a_non_blocking_socket_is_not_polled(impl: ModuleType, pair: Any) -> None:
    a, b = pair
    b.setblocking(False)
    reader = framing.reader(b, impl, busy_poll_us=_framingconstants.MAX_BUSY_POLL_US)
    start = time.monotonic()
    with pytest.raises(BlockingIOError):
        framing.recv_frame(reader, 1 << 20, impl=impl)
    assert time.monotonic() - start < 0.05


@pytest.mark.parametrize("busy_poll", [0, 40_000])
def test_a_busy_poll_spends_the_core_and_sleep_does_not(impl: ModuleType, pair: Any,
                                                        busy_poll: int) -> None:
    """A frame 60 ms away: a 40 ms poll keeps this thread on the core for much of that (its
    CPU time counts it, though it yields to whatever else wants the core); no poll sleeps."""
    a, b = pair
    reader = framing.reader(b, impl, busy_poll_us=busy_poll)
    timer = threading.Timer(0.06, lambda: a.sendall(frame_bytes(impl, [6], None, 4)))
    timer.start()
    cpu = time.thread_time()
    assert framing.recv_frame(reader, 1 << 20, impl=impl)[0].sample_ids == (6,)
    cpu = time.thread_time() - cpu
    timer.join()
    assert (cpu > 0.008) if busy_poll else (cpu < 0.008), f"{cpu * 1e3:.1f} ms of CPU"
