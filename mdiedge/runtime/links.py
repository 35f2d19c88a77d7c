"""The data plane's persistent neighbour links, the same for the starter and the workers.

A node receives, computes and sends on three threads joined by ``queue.SimpleQueue`` (no lost
wake-up, unlike MDI-LLM's event cleared after popping). A small message that finds the send queue
empty is written by the computing thread itself (``Sender``): on a 2-core board a wake-up costs tens
of µs, much of a one-token hop.

Set-up is hardened against strays: each handshake has its own thread and deadline while accepting
goes on, and ``bind`` ties the handshake key to one ring set-up, so a silent connection cannot
starve it and a stale link is refused. Links are sealed (``seal``) unless both ends run
``--no-encrypt``; codecs and sealing are agreed in the handshake, and a mismatch or a bad frame ends
the set-up or the link with one line."""
from __future__ import annotations

import hashlib
import hmac
import logging
import queue
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Union

from . import framing, messages
from .auth import Authenticator
from .messages import Message
from .seal import LinkKeys
from ..base.backoff import AcceptBackoff
from ..base.defaults import HANDSHAKE_TIMEOUT_S, LINK_IDLE_POLL_S, LINK_POLL_S
from ..base.codecs import NO_COMPRESSION, Compression
from ..base.errors import AuthError, FrameError, IntegrityError, LinkMismatch, ListenError
from ..base.ratelog import Throttled

log = logging.getLogger("mdiedge.links")
_refused = Throttled(log, logging.WARNING, "refused data-link handshakes")  # strays, floods

MAX_HANDSHAKES = 64  # handshakes under way on one listener; a flood closes the oldest


@dataclass
class LinkDown:
    """Queued by a receiver when its link ends."""

    reason: str


Received = Union[Message, LinkDown]


@dataclass
class Link:
    """A handshaken socket, with its keys when sealed (else None)."""

    sock: socket.socket
    keys: Optional[LinkKeys] = None

    def close(self) -> None:
        close_quietly(self.sock)


def configure(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    return sock


def tcp_listen(host: str, port: int, what: str = "data port") -> socket.socket:
    """Port 0: a free one; SO_REUSEADDR for a quick rerun. ListenError naming ``host:port`` and
    ``what``."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(16)
    except OSError as e:
        sock.close()
        raise ListenError(host, port, what, e) from None
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
    try:
        sock.settimeout(None)
        return configure(sock)
    except OSError:
        sock.close()
        raise


def bind(auth: Authenticator, ring: str) -> Authenticator:
    """``auth`` with its handshake key bound to the starter's fresh ``ring`` tag, so a link from an
    earlier set-up fails the handshake."""
    if not ring:
        return auth
    bound = Authenticator(auth.secret)
    bound.key = hmac.new(auth.key, b"mdiedge-ring\0" + ring.encode(), hashlib.sha256).digest()
    return bound


def connect_authenticated(host: str, port: int, auth: Authenticator, peer: str,
                          timeout: float = HANDSHAKE_TIMEOUT_S, retry_s: float = 0.0,
                          cancelled: Optional[Callable[[], bool]] = None,
                          codecs: Compression = NO_COMPRESSION, seal: bool = True) -> Link:
    """Sealed unless ``seal`` is False. OSError and AuthError are retried for ``retry_s`` s unless
    ``cancelled()``; a LinkMismatch is not."""
    deadline = time.monotonic() + retry_s
    pause = 0.05
    while True:
        sock = None
        try:
            sock = tcp_connect(host, port, timeout=timeout)
            return Link(sock, auth.connect_link(sock, peer, timeout=timeout, codecs=codecs,
                                                seal=seal))
        except (AuthError, OSError) as e:
            close_quietly(sock)
            if time.monotonic() + pause >= deadline or (cancelled is not None and cancelled()):
                raise
            log.info("link to %s failed (%s); retrying", peer, e)
        except BaseException:
            close_quietly(sock)
            raise
        time.sleep(pause)
        pause = min(2 * pause, 1.0)


class _Handshakes:
    """Handshakes on one listener, each on its own thread and deadline (a silent connection costs
    only its thread); the first that passes wins."""

    def __init__(self, auth: Authenticator, name: str, timeout: float,
                 codecs: Compression = NO_COMPRESSION, seal: bool = True) -> None:
        self.auth, self.name, self.timeout, self.codecs = auth, name, timeout, codecs
        self.seal = seal
        self.mismatch: Optional[LinkMismatch] = None  # an authenticated peer that disagrees
        self.lock = threading.Lock()
        self.open: Dict[socket.socket, None] = {}  # in accept order
        self.won: "queue.SimpleQueue[Link]" = queue.SimpleQueue()
        self.done = False
        self.last = "none connected"

    def start(self, sock: socket.socket) -> None:
        with self.lock:
            if len(self.open) >= MAX_HANDSHAKES:  # a flood: the oldest gives way, at once
                victim = next(iter(self.open))
                del self.open[victim]
                _shutdown(victim)
            self.open[sock] = None
        threading.Thread(target=self._run, args=(sock,), name=f"{self.name}/handshake",
                         daemon=True).start()

    @property
    def pending(self) -> bool:
        return bool(self.open) or not self.won.empty()

    def _run(self, sock: socket.socket) -> None:
        keys = None
        try:
            peer = "%s:%s" % sock.getpeername()[:2]
            keys = self.auth.accept_link(sock, peer, timeout=self.timeout, codecs=self.codecs,
                                         seal=self.seal)
            ok = True
        except LinkMismatch as e:  # the right peer, set up otherwise: no use waiting on
            self.last, self.mismatch, ok = str(e), e, False
            log.warning("%s: %s", self.name, e)
        except Exception as e:  # AuthError, OSError, or anything a stray's bytes provoke
            self.last, ok = str(e), False
            (log.debug if self.done else _refused)("%s: %s", self.name, e)
        with self.lock:
            evicted = self.open.pop(sock, True) is True  # a flood made it give way
            if ok and not self.done and not evicted:
                self.done = True
                self.won.put(Link(sock, keys))
            else:
                close_quietly(sock)

    def finish(self) -> None:
        with self.lock:
            self.done = True
            for sock in self.open:
                _shutdown(sock)
        while not self.won.empty():
            self.won.get().close()


def accept_authenticated(listener: socket.socket, auth: Authenticator, timeout: float,
                         name: str, handshake_timeout: float = HANDSHAKE_TIMEOUT_S,
                         cancelled: Optional[Callable[[], bool]] = None,
                         codecs: Compression = NO_COMPRESSION, seal: bool = True) -> Link:
    """The first connection within ``timeout`` s that passes the handshake (each
    ``handshake_timeout`` s, concurrent with accepting). OSError when none did or once
    ``cancelled()``; LinkMismatch as soon as an authenticated peer names other codecs or sealing."""
    deadline = time.monotonic() + timeout
    handshakes = _Handshakes(auth, name, handshake_timeout, codecs, seal)
    backoff = AcceptBackoff(log, f"{name}: data port")
    try:
        while True:
            if not handshakes.won.empty():
                return handshakes.won.get()
            if handshakes.mismatch is not None:
                raise handshakes.mismatch
            left = deadline - time.monotonic()
            if left <= 0 or (cancelled is not None and cancelled()):
                why = "cancelled" if left > 0 else f"within {timeout:.0f} s"
                raise OSError(f"no authenticated previous node {why} ({handshakes.last})")
            try:
                wait = LINK_POLL_S if handshakes.pending else LINK_IDLE_POLL_S
                sock = accept(listener, min(left, wait))
            except socket.timeout:
                continue
            except OSError as e:  # a connection reset before accept(), out of descriptors
                if listener.fileno() == -1:
                    raise
                handshakes.last = f"accept failed: {e}"
                time.sleep(min(backoff.wait_s(e) or LINK_POLL_S, max(0.0, left)))
                continue
            backoff.ok()
            handshakes.start(sock)
    finally:
        handshakes.finish()


class Receiver(threading.Thread):
    """Reads messages into ``inbox`` until the link ends, then queues LinkDown; ``next`` reads on
    the caller's thread instead. A wait polls ``busy_poll_us`` before sleeping."""

    def __init__(self, sock: socket.socket, inbox: "queue.SimpleQueue[Received]", max_payload: int,
                 name: str, codecs: Compression = NO_COMPRESSION, busy_poll_us: int = 0,
                 keys: Optional[LinkKeys] = None) -> None:
        super().__init__(name=name, daemon=True)
        self.sock, self.inbox, self.max_payload = sock, inbox, max_payload
        self.opener = keys.opener() if keys is not None else None  # a sealed link's
        # after the handshake: nothing of it is buffered
        self.reader = framing.reader(sock, busy_poll_us=busy_poll_us)
        self.codecs = codecs
        self.frames = self.bytes = 0  # received on this link
        self.ended: Optional[str] = None  # why the link ended, once it has

    def run(self) -> None:
        while True:
            item = self.next()
            self.inbox.put(item)
            if isinstance(item, LinkDown):
                return
            if self.ended is not None:  # a SHUTDOWN: the link's ordinary end
                self.inbox.put(LinkDown(self.ended))
                return

    def next(self) -> Received:
        """The next message, or LinkDown once the link has ended."""
        if self.ended is not None:
            return LinkDown(self.ended)
        try:
            message, size = messages.receive(self.reader, self.max_payload, self.codecs,
                                             self.opener)
        except IntegrityError as e:  # a link tampered with: worth a warning
            reason, expected = f"integrity error: {e}", False
        except FrameError as e:
            reason, expected = str(e), True
        except OSError as e:
            reason, expected = f"socket error: {e}", True
        except Exception as e:  # a bug or a resource failure ends the link all the same
            reason, expected = f"{type(e).__name__}: {e}".splitlines()[0], False
        else:
            self.frames, self.bytes = self.frames + 1, self.bytes + size
            if message.kind == messages.SHUTDOWN:
                self.ended = "shutdown"
            return message
        self.ended = reason
        (log.info if expected else log.warning)("%s: link down: %s", self.name, reason)
        return LinkDown(reason)


class Sender(threading.Thread):
    """Sends in ``put`` order; a send error is kept in ``error`` and later messages dropped. A
    message of at most ``inline_max_bytes`` put while nothing is queued goes out on the caller's
    thread (it fits the socket buffer and saves a wake-up), so order holds."""

    def __init__(self, sock: socket.socket, name: str, inline_max_bytes: int = 64 << 10,
                 codecs: Compression = NO_COMPRESSION, keys: Optional[LinkKeys] = None) -> None:
        super().__init__(name=name, daemon=True)
        self.sock, self.codecs = sock, codecs
        self.sealer = keys.sealer() if keys is not None else None  # a sealed link's
        self.frames = self.bytes = 0  # sent on this link
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
        """Send what is queued, then stop (at most ``timeout`` s)."""
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
            size = messages.send(self.sock, message, self.codecs, self.sealer)
            self.frames, self.bytes = self.frames + 1, self.bytes + size
        except OSError as e:
            self.error = f"send failed: {e}"
            log.info("%s: %s", self.name, self.error)


class LinkPair:
    """A node's inbound link (a receiver filling ``inbox``) and outbound one (a sender).
    ``inline_receive``: ``receive`` reads on the caller's thread (a worker's compute loop), saving a
    hand-off per hop. ``inbound``/``outbound``: a ``Link`` or a bare socket."""

    def __init__(self, inbound: Union[Link, socket.socket], outbound: Union[Link, socket.socket],
                 max_payload: int, name: str, codecs_in: Compression = NO_COMPRESSION,
                 codecs_out: Compression = NO_COMPRESSION, inline_receive: bool = False,
                 busy_poll_us: int = 0) -> None:
        inbound, keys_in = (inbound.sock, inbound.keys) if isinstance(inbound, Link) \
            else (inbound, None)
        outbound, keys_out = (outbound.sock, outbound.keys) if isinstance(outbound, Link) \
            else (outbound, None)
        self.inbound, self.outbound = inbound, outbound
        self.inbox: "queue.SimpleQueue[Received]" = queue.SimpleQueue()
        self.receiver = Receiver(inbound, self.inbox, max_payload, f"{name}/recv", codecs_in,
                                 busy_poll_us, keys_in)
        self.sender = Sender(outbound, f"{name}/send", codecs=codecs_out, keys=keys_out)
        self.inline_receive = inline_receive
        if not inline_receive:
            self.receiver.start()
        self.sender.start()

    def send(self, message: Message) -> None:
        self.sender.put(message)

    def receive(self, timeout: Optional[float] = None) -> Received:
        """``queue.Empty`` after ``timeout`` s (inline: no timeout)."""
        if self.inline_receive:
            if timeout is not None:
                raise ValueError("an inline-receive link takes no receive timeout")
            return self.receiver.next()
        return self.inbox.get(timeout=timeout)

    @property
    def send_error(self) -> Optional[str]:
        return self.sender.error

    def stats(self) -> Dict[str, Dict[str, object]]:
        """Frames and bytes (headers and tags included) each way, with codecs and sealing."""
        r, s = self.receiver, self.sender
        return {"in": {"codec": str(r.codecs), "sealed": r.opener is not None,
                       "frames": r.frames, "bytes": r.bytes},
                "out": {"codec": str(s.codecs), "sealed": s.sealer is not None,
                        "frames": s.frames, "bytes": s.bytes}}

    def close(self, timeout: float = 2.0) -> None:
        self.sender.close(timeout=timeout)
        close_quietly(self.outbound)
        close_quietly(self.inbound)


def _shutdown(sock: socket.socket) -> None:
    """Wake the thread blocked on ``sock``; it stays open for that thread to close."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def close_links(*links: Optional[Link]) -> None:
    for link in links:
        if link is not None:
            link.close()


def close_quietly(sock: Optional[socket.socket]) -> None:
    if sock is None:
        return
    _shutdown(sock)
    sock.close()
