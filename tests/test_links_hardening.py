"""Hardening of the data plane's link set-up and receivers (``mdiedge.runtime.links``): silent
connections to a data port neither wedge nor slow a ring set-up, a stale link from an earlier
set-up is refused, and whatever a peer sends, a receiver ends in ``FrameError`` and reports its
link down. Real sockets on loopback; in-process nodes."""
from __future__ import annotations

import queue
import random
import socket
import struct
import threading
import time
import zlib
from pathlib import Path
from types import ModuleType
from typing import Any, Iterator, List, Tuple

import numpy as np
import pytest
import torch

from conftest import make_hf_llama, write_tiny_tokenizer
from mdiedge.runtime.framing import FRAMING
from mdiedge.base.errors import FrameError
from mdiedge.base.nodes import NodeSpec
from mdiedge.model.sampling import SamplingParams
from mdiedge.engine.ring import RingEngine
from mdiedge.roles.worker import WorkerNode
from mdiedge.runtime import framing, links, messages
from mdiedge.runtime.auth import Authenticator
from mdiedge.runtime.links import LinkDown, LinkPair, Receiver, accept_authenticated, bind, \
    connect_authenticated, tcp_listen

GREEDY = SamplingParams(temperature=0)
IMPLS = FRAMING.implementations()
FIXED = struct.Struct("<4sBBBBHBBI4IIQ")


@pytest.fixture(params=IMPLS, ids=[m.__name__ for m in IMPLS])
def impl(request: pytest.FixtureRequest) -> ModuleType:
    return request.param


@pytest.fixture()
def ring(tmp_path: Path) -> Iterator[Tuple[RingEngine, WorkerNode]]:
    model = make_hf_llama(tmp_path / "m", seed=3, num_hidden_layers=4)
    write_tiny_tokenizer(model)
    node = WorkerNode(name="w1", cache_dir=tmp_path / "cache").start()
    engine = RingEngine([NodeSpec("w1", "127.0.0.1", node.control.port)], model, timeout_s=30)
    yield engine, node
    engine.close()
    node.close()


def silent(port: int, n: int) -> List[socket.socket]:
    """``n`` connections to ``port`` that never send a byte."""
    return [socket.create_connection(("127.0.0.1", port)) for _ in range(n)]


def timed_setup(engine: RingEngine) -> float:
    """Seconds for a request that needs a new ring set-up."""
    engine.starter.close_ring()
    start = time.monotonic()
    assert engine.generate("hello ring", 2, 1, GREEDY)
    return time.monotonic() - start


# ------------------------------------------------------------------- set-up against strays

def test_a_silent_connection_to_the_starter_does_not_wedge_set_up(ring: Any) -> None:
    engine, _ = ring
    engine.generate("hello ring", 2, 1, GREEDY)
    strays = silent(engine.starter.listener.getsockname()[1], 1)
    try:
        assert timed_setup(engine) < 3.0
        assert timed_setup(engine) < 3.0  # and every later one
    finally:
        for s in strays:
            s.close()


def test_silent_connections_to_a_worker_do_not_block_set_up(ring: Any) -> None:
    engine, node = ring
    strays = silent(node.data_port, 3)
    try:
        assert timed_setup(engine) < 3.0
    finally:
        for s in strays:
            s.close()


def test_the_first_peer_to_pass_wins_and_the_others_are_closed() -> None:
    auth = Authenticator(b"secret")
    with tcp_listen("127.0.0.1", 0) as listener:
        port = listener.getsockname()[1]
        strays = silent(port, 3)
        got: List[socket.socket] = []
        acceptor = threading.Thread(target=lambda: got.append(
            accept_authenticated(listener, auth, 5.0, "test", handshake_timeout=5.0)))
        acceptor.start()
        start = time.monotonic()
        good = connect_authenticated("127.0.0.1", port, auth, "test")
        acceptor.join(5)
        assert got and time.monotonic() - start < 1.0
        for s in strays:  # each stray was sent the challenge, then closed
            s.settimeout(2)
            data = b""
            while True:
                chunk = s.recv(4096)
                if not chunk:
                    break
                data += chunk
            assert data.startswith(b"MDIEHS3\0")
            s.close()
        good.close()
        got[0].close()


def test_a_stale_link_from_an_earlier_set_up_is_refused() -> None:
    auth = Authenticator(None)
    with tcp_listen("127.0.0.1", 0) as listener:
        port = listener.getsockname()[1]
        errors: List[Exception] = []

        def stale() -> None:
            try:
                connect_authenticated("127.0.0.1", port, bind(auth, "ring-1"), "stale").close()
            except Exception as e:  # noqa: BLE001
                errors.append(e)

        old = threading.Thread(target=stale)
        old.start()
        with pytest.raises(OSError, match="no authenticated previous node within 1 s"):
            accept_authenticated(listener, bind(auth, "ring-2"), 1.0, "test")
        old.join(5)
        assert errors and "handshake" in str(errors[0])
        new = threading.Thread(target=lambda: connect_authenticated(
            "127.0.0.1", port, bind(auth, "ring-2"), "new").close())
        new.start()
        accept_authenticated(listener, bind(auth, "ring-2"), 5.0, "test").close()
        new.join(5)


def test_accepting_stops_when_cancelled() -> None:
    with tcp_listen("127.0.0.1", 0) as listener:
        start = time.monotonic()
        with pytest.raises(OSError, match="cancelled"):
            accept_authenticated(listener, Authenticator(None), 30.0, "test",
                                 cancelled=lambda: time.monotonic() - start > 0.3)
        assert time.monotonic() - start < 2.0


# ------------------------------------------------------------------- receivers against any bytes

def zero_element_frame(dims: Tuple[int, ...] = (0, 2 ** 32 - 1, 2 ** 32 - 1)) -> bytes:
    """A frame of shape ``dims`` with no elements (payload 0) and a valid crc."""
    shape = list(dims) + [0] * (4 - len(dims))
    fixed = FIXED.pack(b"MDIE", framing.VERSION, framing.ACTIVATION, 0, 0, 0, len(dims), 0, 0,
                       *shape, 0, 0)
    return fixed + struct.pack("<I", zlib.crc32(fixed))


def link_down(inbox: "queue.SimpleQueue[Any]", timeout: float = 5.0) -> LinkDown:
    deadline = time.monotonic() + timeout
    while True:
        item = inbox.get(timeout=max(0.01, deadline - time.monotonic()))
        if isinstance(item, LinkDown):
            return item


def test_a_zero_element_frame_with_huge_dims_is_a_frame_error(impl: ModuleType) -> None:
    a, b = socket.socketpair()
    with a, b:
        a.sendall(zero_element_frame())
        with pytest.raises(FrameError, match=r"^shape \(0, 4294967295, 4294967295\) of dtype "
                                             r"code 0 exceeds max_payload 1048576"):
            framing.recv_frame(b, 1 << 20, impl=impl)
    a, b = socket.socketpair()  # a zero dim with small others is still a valid empty tensor
    with a, b:
        a.sendall(zero_element_frame((0, 16, 16)))
        _, tensor = framing.recv_frame(b, 1 << 20, impl=impl)
        assert tensor is not None and tuple(tensor.shape) == (0, 16, 16)


def test_the_receiver_reports_a_zero_element_frame_as_link_down(
        impl: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(framing, "_impl", impl)
    a, b = socket.socketpair()
    with a, b:
        inbox: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        receiver = Receiver(b, inbox, 1 << 20, "test/recv")
        receiver.start()
        a.sendall(zero_element_frame())
        assert "exceeds max_payload" in link_down(inbox).reason
        receiver.join(5)
        assert not receiver.is_alive()


def test_the_receiver_reports_any_exception_as_link_down(
        monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    def broken(sock: Any, max_payload: int, codecs: Any, opener: Any) -> Any:
        raise RuntimeError("Trying to create tensor with negative dimension -1\nmore")

    monkeypatch.setattr(links.messages, "receive", broken)
    a, b = socket.socketpair()
    with a, b:
        inbox: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        Receiver(b, inbox, 1 << 20, "test/recv").start()
        assert link_down(inbox).reason == \
            "RuntimeError: Trying to create tensor with negative dimension -1"
    assert "Traceback" not in caplog.text


@pytest.mark.parametrize("inline", [False, True])
def test_a_link_pair_receives_in_order_then_ends(inline: bool) -> None:
    """With its receiver thread or inline on the caller's thread (a worker's): the messages
    in order, a SHUTDOWN, then LinkDown("shutdown") without reading further; a peer that
    goes away is LinkDown too."""
    a, b = socket.socketpair()
    c, d = socket.socketpair()
    pair = LinkPair(b, c, 1 << 20, "test", inline_receive=inline)
    try:
        hidden = torch.arange(8, dtype=torch.float32).reshape(1, 1, 8)
        for seq in range(3):
            framing.send_tensor(a, framing.PING, [seq], [0], hidden, seq=seq)
        framing.send_control(a, framing.SHUTDOWN)
        got = [pair.receive(5.0 if not inline else None) for _ in range(5)]
        assert [m.kind for m in got[:4]] == [messages.PING] * 3 + [messages.SHUTDOWN]
        assert [m.sample_ids for m in got[:3]] == [[0], [1], [2]]
        assert np.array_equal(got[0].hidden, hidden.numpy())
        assert isinstance(got[4], LinkDown) and got[4].reason == "shutdown"
        assert pair.stats()["in"]["frames"] == 4
        if inline:
            with pytest.raises(ValueError, match="takes no receive timeout"):
                pair.receive(1.0)
            assert not pair.receiver.is_alive()  # never started
    finally:
        pair.close(timeout=1)
        for sock in (a, d):
            sock.close()


def test_an_inline_receive_reports_a_peer_gone_as_link_down() -> None:
    a, b = socket.socketpair()
    c, d = socket.socketpair()
    pair = LinkPair(b, c, 1 << 20, "test", inline_receive=True)
    try:
        a.close()
        down = pair.receive()
        assert isinstance(down, LinkDown) and down.reason
        assert pair.receive() is not down and pair.receive().reason == down.reason  # stays down
    finally:
        pair.close(timeout=1)
        d.close()


def valid_stream(rng: random.Random, impl: ModuleType) -> bytes:
    """One to three valid frames."""
    out = b""
    for _ in range(rng.randint(1, 3)):
        n = rng.randint(0, 3)
        ids = [rng.randrange(2 ** 32) for _ in range(n)]
        pos = [rng.randrange(framing.MAX_POSITION + 1) for _ in range(n)]
        ndim = rng.randint(0, 4)
        dims = tuple(rng.randint(0, 4) for _ in range(ndim))
        dtype = rng.choice(sorted(framing.ITEMSIZE))
        header = impl.pack_header(rng.choice([1, 2, 3, 5]), rng.randint(0, 1), dtype, ids, pos,
                                  rng.randrange(2 ** 32), dims, rng.randrange(2 ** 32))
        size = struct.unpack_from("<Q", header, 36)[0]
        out += header + bytes(rng.randrange(256) for _ in range(size))
    return out


def mutate(rng: random.Random, data: bytes) -> bytes:
    """Flipped or random bytes, a cut, an insertion, or a header field set to an extreme value
    with the crc fixed up (so that the field checks, not the crc, must catch it)."""
    data = bytearray(data)
    kind = rng.randrange(5)
    if kind == 0:
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    elif kind == 1:
        data = data[:rng.randrange(len(data))]
    elif kind == 2:
        at = rng.randrange(len(data) + 1)
        data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
    elif kind == 3:
        consistent_dims(rng, data)
    else:
        offset, fmt = rng.choice([(8, "<H"), (10, "<H"), (16, "<I"), (20, "<I"), (24, "<I"),
                                  (28, "<I"), (36, "<Q"), (7, "<B"), (5, "<B")])
        top = 2 ** (8 * struct.calcsize(fmt)) - 1
        struct.pack_into(fmt, data, offset, rng.choice([0, 1, 2, 5, top, top - 1, top // 2]))
        n = struct.unpack_from("<H", data, 8)[0]
        struct.pack_into("<I", data, 44, zlib.crc32(bytes(data[48:48 + 8 * n]),
                                                    zlib.crc32(bytes(data[:44]))))
    return bytes(data)


def consistent_dims(rng: random.Random, data: bytearray) -> None:
    """New dims in the first header, its payload_len and crc matching: header checks pass
    unless a bound is exceeded (zero dims with huge others included)."""
    ndim = rng.randint(1, 4)
    dims = [rng.choice([0, 0, 1, 3, 2 ** 16, 2 ** 32 - 1]) for _ in range(ndim)]
    size = framing.ITEMSIZE.get(data[7], 1)
    for d in dims:
        size *= d
    struct.pack_into("<B", data, 10, ndim)
    struct.pack_into("<4I", data, 16, *(dims + [0] * (4 - ndim)))
    struct.pack_into("<Q", data, 36, size % 2 ** 64)
    n = struct.unpack_from("<H", data, 8)[0]
    struct.pack_into("<I", data, 44, zlib.crc32(bytes(data[48:48 + 8 * n]),
                                                zlib.crc32(bytes(data[:44]))))


def feed(data: bytes) -> socket.socket:
    """The reading end of a socket pair whose other end sends ``data``, then closes."""
    a, b = socket.socketpair()

    def write() -> None:
        try:
            a.sendall(data)
        except OSError:
            pass
        a.close()

    threading.Thread(target=write, daemon=True).start()
    b.settimeout(10)
    return b


def test_fuzzed_frames_give_frame_errors_only(impl: ModuleType) -> None:
    rng = random.Random(20261123)
    deadline = time.monotonic() + 6
    rounds = 0
    while time.monotonic() < deadline and rounds < 1500:
        rounds += 1
        sock = feed(mutate(rng, valid_stream(rng, impl)))
        with sock:
            with pytest.raises(FrameError):  # the stream always ends, at the latest, closed
                for _ in range(10):
                    framing.recv_frame(sock, rng.choice([1 << 10, 1 << 20]), impl=impl)
    assert rounds >= 200


def test_fuzzed_frames_bring_a_receivers_link_down(
        impl: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(framing, "_impl", impl)
    rng = random.Random(7)
    for _ in range(150):
        sock = feed(mutate(rng, valid_stream(rng, impl)))
        with sock:
            inbox: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
            receiver = Receiver(sock, inbox, 1 << 10, "fuzz/recv")
            receiver.start()
            down = link_down(inbox)
            receiver.join(5)
            assert not receiver.is_alive() and down.reason


def test_a_flood_of_handshakes_keeps_at_most_the_cap_open(monkeypatch: Any) -> None:
    """The oldest handshake gives way at once, not when its thread gets round to it: the
    cap holds however fast connections come (the threads are held back here)."""
    from mdiedge.runtime.links import MAX_HANDSHAKES, _Handshakes

    go = threading.Event()
    run = _Handshakes._run
    monkeypatch.setattr(_Handshakes, "_run", lambda self, sock: (go.wait(10), run(self, sock)))
    handshakes = _Handshakes(Authenticator(b"secret"), "test", timeout=5.0)
    pairs = [socket.socketpair() for _ in range(MAX_HANDSHAKES + 20)]
    try:
        for ours, _ in pairs:
            handshakes.start(ours)
            assert len(handshakes.open) <= MAX_HANDSHAKES
    finally:
        handshakes.done = True
        go.set()
        for _, theirs in pairs:
            theirs.close()
    deadline = time.monotonic() + 10
    while handshakes.open and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not handshakes.open


@pytest.mark.parametrize("side, reset, level", [
    ("inbound", True, "INFO"), ("inbound", False, "WARNING"),
    ("outbound", True, "INFO"), ("outbound", False, "WARNING")])
def test_a_link_set_up_ended_by_a_reset_is_no_warning(side: str, reset: bool, level: str,
                                                      monkeypatch: Any, caplog: Any) -> None:
    """A worker's failed set-up is a warning, unless the starter reset the ring meanwhile (a
    Ctrl-C while a local ring links up: nothing of it reaches the terminal)."""
    from mdiedge.base import defaults
    from mdiedge.roles.worker import _link_pair
    from mdiedge.runtime.protocol import ConnectRequest

    monkeypatch.setattr(defaults, "LINK_ACCEPT_TIMEOUT_S", 0.5)
    monkeypatch.setattr(defaults, "LINK_RETRY_S", 0.5)
    auth = Authenticator(b"secret")
    with tcp_listen("127.0.0.1", 0) as listener, tcp_listen("127.0.0.1", 0) as closed:
        dead_port = closed.getsockname()[1]
        closed.close()  # the next node: gone
        request = ConnectRequest("127.0.0.1", dead_port, ring="r1")
        previous: List[Any] = []
        if side == "outbound":  # the previous node links up, so the next node is what fails
            threading.Thread(target=lambda: previous.append(connect_authenticated(
                "127.0.0.1", listener.getsockname()[1], bind(auth, "r1"), "prev")),
                daemon=True).start()
        started = time.monotonic()
        moved_on = (lambda: reset and time.monotonic() - started > 0.2)
        with caplog.at_level("INFO", logger="mdiedge"):
            assert _link_pair(listener, bind(auth, "r1"), request, "w1", 1 << 16, moved_on, 0,
                              True) is None
        for link in previous:
            link.close()
    said = [(r.levelname, r.getMessage()) for r in caplog.records
            if "no previous node connected" in r.getMessage()
            or "cannot reach its next node" in r.getMessage()]
    want = "no previous node connected" if side == "inbound" else "cannot reach its next node"
    assert len(said) == 1 and said[0][0] == level and want in said[0][1], said
