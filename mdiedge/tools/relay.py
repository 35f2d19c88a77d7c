"""A delaying TCP relay: one-way latency on a link where the kernel has no netem.

``DelayRelay(("127.0.0.1", 7701), delay_s=0.02)`` listens on a free port of its own; every
connection to it is relayed to the target, each chunk of bytes held for ``delay_s`` after it was
read before it is written on, in both directions, in order and byte for byte. Each direction buffers
at most ``max_buffer`` bytes: past that it stops reading, so the sender's TCP window fills
(backpressure). An end of stream is passed on (after the delay) as a half-close, so closing one side
closes the other; a reset or error closes both.

``Relays(delay_s)`` is a ``route``: ``relays(host, port)`` is the address of a relay in front of
``(host, port)``, started on first use, so that a ring's links can be routed through relays
(``open_engine(EngineSpec(..., route=relays))``). ``close()`` ends every relay and connection."""
from __future__ import annotations

import collections
import socket
import threading
import time
from typing import Deque, Dict, List, Optional, Tuple

Address = Tuple[str, int]
CHUNK = 1 << 16
MAX_BUFFER = 4 << 20  # bytes held per direction of a connection


class _Pipe:
    """One direction of a relayed connection: a reader thread, a bounded queue of
    (due time, bytes), and a writer thread that writes each chunk when it is due."""

    def __init__(self, src: socket.socket, dst: socket.socket, delay_s: float,
                 max_buffer: int, on_error: "threading.Event", name: str) -> None:
        self.src, self.dst, self.delay_s, self.max_buffer = src, dst, delay_s, max_buffer
        self.failed = on_error
        self.queue: Deque[Tuple[float, bytes]] = collections.deque()
        self.buffered = 0
        self.cond = threading.Condition()
        self.threads = [threading.Thread(target=self._read, name=f"{name}-read", daemon=True),
                        threading.Thread(target=self._write, name=f"{name}-write", daemon=True)]

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def _put(self, data: bytes) -> bool:
        with self.cond:
            while self.buffered >= self.max_buffer and not self.failed.is_set():
                self.cond.wait(0.1)
            if self.failed.is_set():
                return False
            self.queue.append((time.monotonic() + self.delay_s, data))
            self.buffered += len(data)
            self.cond.notify_all()
            return True

    def _read(self) -> None:
        try:
            while True:
                data = self.src.recv(CHUNK)
                if not self._put(data) or not data:  # b"": the end of the stream, passed on
                    return
        except OSError:
            self._fail()

    def _take(self) -> Optional[Tuple[float, bytes]]:
        with self.cond:
            while not self.queue and not self.failed.is_set():
                self.cond.wait(0.1)
            if self.failed.is_set():
                return None
            due, data = self.queue.popleft()
            self.buffered -= len(data)
            self.cond.notify_all()
            return due, data

    def _write(self) -> None:
        try:
            while True:
                item = self._take()
                if item is None:
                    return
                due, data = item
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                if not data:
                    self.dst.shutdown(socket.SHUT_WR)
                    return
                self.dst.sendall(data)
        except OSError:
            self._fail()

    def _fail(self) -> None:
        """A reset or error: end both directions now (a reader blocked on the other side's
        socket wakes, so no thread waits on a half-dead connection)."""
        self.failed.set()
        with self.cond:
            self.cond.notify_all()
        _shutdown(self.src)
        _shutdown(self.dst)

    def join(self, timeout: Optional[float] = None) -> None:
        for thread in self.threads:
            thread.join(timeout)


class DelayRelay:
    """Relays every connection to ``target`` with ``delay_s`` one-way delay (module doc)."""

    def __init__(self, target: Address, delay_s: float, host: str = "127.0.0.1", port: int = 0,
                 max_buffer: int = MAX_BUFFER) -> None:
        if delay_s < 0:
            raise ValueError(f"delay {delay_s} s is negative")
        self.target, self.delay_s, self.max_buffer = target, delay_s, max_buffer
        self.listener = socket.create_server((host, port))
        self.listener.settimeout(0.1)
        self.closed = threading.Event()
        self.lock = threading.Lock()
        self.connections: List[Tuple[socket.socket, socket.socket, threading.Event]] = []
        self.acceptor = threading.Thread(target=self._accept, name="relay-accept", daemon=True)
        self.acceptor.start()

    @property
    def address(self) -> Address:
        host, port = self.listener.getsockname()[:2]
        return host, port

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                client, _ = self.listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            threading.Thread(target=self._relay, args=(client,), name="relay-open",
                             daemon=True).start()

    def _relay(self, client: socket.socket) -> None:
        client.settimeout(None)
        try:
            upstream = socket.create_connection(self.target, timeout=10)
            upstream.settimeout(None)
        except OSError:
            client.close()
            return
        for sock in (client, upstream):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        failed = threading.Event()
        with self.lock:
            if self.closed.is_set():
                client.close()
                upstream.close()
                return
            self.connections.append((client, upstream, failed))
        pipes = [_Pipe(client, upstream, self.delay_s, self.max_buffer, failed, "relay-up"),
                 _Pipe(upstream, client, self.delay_s, self.max_buffer, failed, "relay-down")]
        for pipe in pipes:
            pipe.start()
        for pipe in pipes:
            pipe.join()
        if failed.is_set():  # a reset on one side: reset the other (no half-open leftovers)
            for sock in (client, upstream):
                _shutdown(sock)
        client.close()
        upstream.close()
        with self.lock:
            self.connections = [c for c in self.connections if c[0] is not client]

    def close(self) -> None:
        self.closed.set()
        self.listener.close()
        with self.lock:
            connections = list(self.connections)
        for client, upstream, failed in connections:
            failed.set()
            _shutdown(client)
            _shutdown(upstream)
        self.acceptor.join(1)

    def __enter__(self) -> "DelayRelay":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class Relays:
    """A route through delaying relays: ``relays(host, port)`` -> a relay's address."""

    def __init__(self, delay_s: float, host: str = "127.0.0.1") -> None:
        self.delay_s, self.host = delay_s, host
        self.relays: Dict[Address, DelayRelay] = {}
        self.lock = threading.Lock()

    def __call__(self, host: str, port: int) -> Address:
        with self.lock:
            relay = self.relays.get((host, port))
            if relay is None:
                relay = self.relays[(host, port)] = DelayRelay((host, port), self.delay_s,
                                                               self.host)
            return relay.address

    def close(self) -> None:
        with self.lock:
            relays, self.relays = list(self.relays.values()), {}
        for relay in relays:
            relay.close()

    def __enter__(self) -> "Relays":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
