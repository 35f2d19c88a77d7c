"""The data plane's persistent neighbour links, the same for the starter and the workers:
listening, the authenticated connect and accept, and the threads that serve a link pair.

A node receives messages on one thread, computes on another and sends on a third, joined by
FIFO queues (as in MDI-LLM, Macario et al. 2024). ``queue.SimpleQueue`` carries the
wake-ups, so none can be lost (the paper's code clears an event after popping and can miss
one). A small message that finds the send queue empty is written by the computing thread
itself (see ``Sender``): on a 2-core board each thread wake-up costs tens of µs, a large part
of a one-token hop.
"""
from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from dataclasses import dataclass
from typing import Optional, Union

from . import messages
from .auth import AuthError, Authenticator
from .messages import Message
from ..base.errors import FrameError

log = logging.getLogger("mdiedge.links")

HANDSHAKE_TIMEOUT_S = 10.0


@dataclass
class LinkDown:
    """Queued by a receiver when its link ends: a closed socket or a malformed frame."""

    reason: str


Received = Union[Message, LinkDown]


def configure(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    return sock


def tcp_listen(host: str, port: int) -> socket.socket:
    """A listening socket; port 0 picks a free one. SO_REUSEADDR lets a quick rerun bind."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(16)
    return sock


def tcp_connect(host: str, port: int, timeout: float = 10.0) -> socket.socket:
    sock = socket.create_connection((host, port), timeout=timeout)
    sock.settimeout(None)
    return configure(sock)


def accept(listener: socket.socket, timeout: float) -> socket.socket:
    listener.settimeout(timeout)
    try:
        sock, _ = listener.accept()
    finally:
        listener.settimeout(None)
    sock.settimeout(None)
    return configure(sock)


def connect_authenticated(host: str, port: int, auth: Authenticator, peer: str,
                          timeout: float = HANDSHAKE_TIMEOUT_S) -> socket.socket:
    """A link to ``host:port`` that passed the ring-secret handshake (OSError or AuthError)."""
    sock = tcp_connect(host, port)
    try:
        auth.connect_link(sock, peer, timeout=timeout)
    except BaseException:
        close_quietly(sock)
        raise
    return sock


def accept_authenticated(listener: socket.socket, auth: Authenticator, timeout: float,
                         name: str) -> socket.socket:
    """The first connection on ``listener`` within ``timeout`` s that passes the handshake;
    strays and failed handshakes are closed and the wait goes on. OSError when none came."""
    deadline = time.monotonic() + timeout
    last = "none connected"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise OSError(f"no authenticated previous node within {timeout:.0f} s ({last})")
        try:
            sock = accept(listener, left)
        except socket.timeout:
            continue
        peer = "%s:%s" % sock.getpeername()[:2]
        try:
            auth.accept_link(sock, peer, timeout=min(HANDSHAKE_TIMEOUT_S, max(0.1, left)))
            return sock
        except (AuthError, OSError) as e:
            last = str(e)
            log.warning("%s: %s", name, e)
            close_quietly(sock)


class Receiver(threading.Thread):
    """Reads messages from ``sock`` into ``inbox`` until the link ends, then queues LinkDown."""

    def __init__(self, sock: socket.socket, inbox: "queue.SimpleQueue[Received]", max_payload: int,
                 name: str) -> None:
        super().__init__(name=name, daemon=True)
        self.sock, self.inbox, self.max_payload = sock, inbox, max_payload

    def run(self) -> None:
        reason = "closed by peer"
        try:
            while True:
                message = messages.receive(self.sock, self.max_payload)
                self.inbox.put(message)
                if message.kind == messages.SHUTDOWN:
                    reason = "shutdown"
                    break
        except FrameError as e:
            reason = str(e)
        except OSError as e:
            reason = f"socket error: {e}"
        if reason != "shutdown":
            log.info("%s: link down: %s", self.name, reason)
        self.inbox.put(LinkDown(reason))


class Sender(threading.Thread):
    """Sends messages in the order given to ``put``. ``close`` stops it. A send error is
    remembered in ``error``; later messages are dropped.

    A message of at most ``inline_max_bytes`` put while nothing is waiting to be sent goes out
    at once on the caller's thread: a one-token frame fits the socket buffer, so this does not
    block, and it saves the thread wake-up (tens of µs) that dominates a hop's overhead. Any
    other message queues for this thread, so a large or backed-up send never stalls compute.
    Order holds because a message is sent inline only when every earlier one is on the wire."""

    def __init__(self, sock: socket.socket, name: str, inline_max_bytes: int = 64 << 10) -> None:
        super().__init__(name=name, daemon=True)
        self.sock = sock
        self.inline_max_bytes = inline_max_bytes
        self.error: Optional[str] = None
        self._queue: "queue.SimpleQueue[Optional[Message]]" = queue.SimpleQueue()
        self._pending = 0  # messages queued and not yet fully sent
        self._count_lock = threading.Lock()
        self._wire_lock = threading.Lock()  # held while a message is written to the socket

    def put(self, message: Message) -> None:
        small = messages.nbytes(message) <= self.inline_max_bytes
        with self._count_lock:
            inline = small and self._pending == 0 and self._wire_lock.acquire(blocking=False)
            if not inline:
                self._pending += 1
                self._queue.put(message)
        if inline:
            try:
                self._send(message)
            finally:
                self._wire_lock.release()

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued, then stop the thread (waiting at most ``timeout`` s)."""
        self._queue.put(None)
        if self.is_alive():
            self.join(timeout=timeout)

    def run(self) -> None:
        while True:
            message = self._queue.get()
            if message is None:
                return
            with self._wire_lock:
                self._send(message)
            with self._count_lock:
                self._pending -= 1

    def _send(self, message: Message) -> None:
        if self.error is not None:
            return
        try:
            messages.send(self.sock, message)
        except OSError as e:
            self.error = f"send failed: {e}"
            log.info("%s: %s", self.name, self.error)


class LinkPair:
    """A node's place in the ring: the inbound link (a receiver thread filling ``inbox``) and
    the outbound one (a sender). Starter and workers both hold one."""

    def __init__(self, inbound: socket.socket, outbound: socket.socket, max_payload: int,
                 name: str) -> None:
        self.inbound, self.outbound = inbound, outbound
        self.inbox: "queue.SimpleQueue[Received]" = queue.SimpleQueue()
        self.receiver = Receiver(inbound, self.inbox, max_payload, f"{name}/recv")
        self.sender = Sender(outbound, f"{name}/send")
        self.receiver.start()
        self.sender.start()

    def send(self, message: Message) -> None:
        self.sender.put(message)

    def receive(self, timeout: Optional[float] = None) -> Received:
        """The next message or LinkDown; ``queue.Empty`` after ``timeout`` s."""
        return self.inbox.get(timeout=timeout)

    @property
    def send_error(self) -> Optional[str]:
        return self.sender.error

    def close(self, timeout: float = 2.0) -> None:
        self.sender.close(timeout=timeout)
        close_quietly(self.outbound)
        close_quietly(self.inbound)


def close_quietly(sock: Optional[socket.socket]) -> None:
    if sock is None:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
