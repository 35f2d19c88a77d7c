"""mdiedge.tools.relay: a delaying TCP relay in front of an echo server passes bytes intact (random
payloads, large ones), adds its delay each way and not much more, passes a close on, serves
many connections at once, and routes by target (``Relays``)."""
from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any, Iterator, Tuple

import pytest

from mdiedge.tools.relay import DelayRelay, Relays

DELAY = 0.05


@pytest.fixture
def echo() -> Iterator[Tuple[str, int]]:
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.1)
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn:
            while True:
                data = conn.recv(1 << 16)
                if not data:
                    return
                conn.sendall(data)

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except socket.timeout:
                continue
            conn.settimeout(None)
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield listener.getsockname()[:2]
    stop.set()
    thread.join(2)
    listener.close()


def _exchange(address: Tuple[str, int], payload: bytes) -> bytes:
    """Send ``payload`` (from a thread: the echo fills both directions), half-close, read all."""
    with socket.create_connection(address, timeout=30) as sock:
        sender = threading.Thread(target=lambda: (sock.sendall(payload),
                                                  sock.shutdown(socket.SHUT_WR)), daemon=True)
        sender.start()
        got = bytearray()
        while True:
            data = sock.recv(1 << 16)
            if not data:
                break
            got += data
        sender.join(30)
        return bytes(got)


@pytest.mark.parametrize("size", [1, 1000, 65537, 3 << 20])
def test_random_payloads_arrive_intact(echo: Tuple[str, int], size: int) -> None:
    payload = os.urandom(size)
    with DelayRelay(echo, DELAY, max_buffer=1 << 20) as relay:
        assert _exchange(relay.address, payload) == payload


def test_the_round_trip_is_twice_the_delay(echo: Tuple[str, int]) -> None:
    with DelayRelay(echo, DELAY) as relay, \
            socket.create_connection(relay.address, timeout=5) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        times = []
        for i in range(3):
            start = time.perf_counter()
            sock.sendall(b"ping%d" % i)
            assert sock.recv(100) == b"ping%d" % i
            times.append(time.perf_counter() - start)
    assert min(times) >= 2 * DELAY
    assert sorted(times)[1] < 2 * DELAY + 0.1, times


def test_a_zero_delay_relay_is_a_plain_relay(echo: Tuple[str, int]) -> None:
    with DelayRelay(echo, 0.0) as relay:
        assert _exchange(relay.address, b"x" * 100000) == b"x" * 100000


def test_closing_the_client_closes_the_server_side() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    with listener, DelayRelay(listener.getsockname()[:2], DELAY) as relay:
        client = socket.create_connection(relay.address, timeout=5)
        listener.settimeout(5)
        server, _ = listener.accept()
        server.settimeout(5)
        client.sendall(b"last words")
        client.close()
        got = b""
        while True:
            data = server.recv(100)
            if not data:
                break
            got += data
        assert got == b"last words"  # then the end of the stream
        server.close()


def test_closing_the_server_closes_the_client_side() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    with listener, DelayRelay(listener.getsockname()[:2], DELAY) as relay:
        client = socket.create_connection(relay.address, timeout=5)
        listener.settimeout(5)
        server, _ = listener.accept()
        server.sendall(b"bye")
        server.close()
        assert client.recv(100) == b"bye"
        assert client.recv(100) == b""
        client.close()


def test_closing_the_relay_ends_its_connections(echo: Tuple[str, int]) -> None:
    relay = DelayRelay(echo, DELAY)
    client = socket.create_connection(relay.address, timeout=5)
    client.sendall(b"hi")
    assert client.recv(10) == b"hi"
    relay.close()
    assert client.recv(10) == b""
    client.close()
    with pytest.raises(OSError):
        socket.create_connection(relay.address, timeout=1)


def test_many_connections_at_once(echo: Tuple[str, int]) -> None:
    payloads = [os.urandom(20000 + i) for i in range(24)]
    results = [b""] * len(payloads)
    with DelayRelay(echo, DELAY) as relay:
        def one(i: int) -> None:
            results[i] = _exchange(relay.address, payloads[i])

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(payloads))]
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        took = time.perf_counter() - start
    assert results == payloads
    assert took < 2.0  # concurrent, not one after another (24 x 2 x 50 ms)


def test_relays_start_one_relay_per_target(echo: Tuple[str, int]) -> None:
    with Relays(DELAY) as relays:
        first = relays(*echo)
        assert relays(*echo) == first and first != echo
        assert _exchange(first, b"routed") == b"routed"


def test_a_local_ring_runs_through_relays_on_every_link(ring_model: Any) -> None:
    from mdiedge.model.sampling import SamplingParams
    from mdiedge.engine.local import LocalEngine
    from mdiedge.roles.local_ring import LocalRing
    from mdiedge.engine.ring import RingEngine

    greedy, prompt, delay = SamplingParams(temperature=0), "hello ring the quick fox", 0.02
    local = LocalRing(2, threads=1)
    with local as specs, Relays(delay) as relays:
        engine = RingEngine(specs, ring_model, timeout_s=30, secret=local.secret, route=relays)
        try:
            out = engine.generate(prompt, 6, 1, greedy)
            links = engine.starter.link_stats()
        finally:
            engine.close()
        assert len(relays.relays) == 3  # starter -> w1 -> w2 -> starter: each link relayed
    want = LocalEngine(ring_model).generate(prompt, 6, 1, greedy)
    assert out.samples[0]["token_ids"] == want.samples[0]["token_ids"]
    assert [(l["from"], l["to"]) for l in links] == \
        [("starter", "w1"), ("w1", "w2"), ("w2", "starter")]
    assert out.timing.decode_s >= 5 * 3 * delay  # 5 decode tokens, each 3 delayed hops


def test_a_reset_on_one_side_ends_the_other() -> None:
    import struct

    listener = socket.create_server(("127.0.0.1", 0))
    with listener, DelayRelay(listener.getsockname()[:2], DELAY) as relay:
        client = socket.create_connection(relay.address, timeout=5)
        listener.settimeout(5)
        server, _ = listener.accept()
        server.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        server.close()  # an RST, not a FIN
        try:
            assert client.recv(100) == b""
        except ConnectionResetError:
            pass
        client.close()
        deadline = time.monotonic() + 2
        while relay.connections and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not relay.connections  # its threads ended, nothing left behind
