"""Persistent neighbour links of the data plane and the threads that serve them.

A node receives frames on one thread, computes on another and sends on a third, joined by
FIFO queues (as in MDI-LLM, Macario et al. 2024). ``queue.SimpleQueue`` carries the
wake-ups, so none can be lost (the paper's code clears an event after popping and can miss
one). A small frame that finds the send queue empty is written by the computing thread itself
(see ``Sender``): on a 2-core board each thread wake-up costs tens of µs, a large part of a
one-token hop.
"""
from __future__ import annotations

import logging
import queue
import socket
import threading
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Tuple, Union

import torch

from . import framing
from ..base.errors import FrameError

log = logging.getLogger("mdiedge.transport")

DEFAULT_MAX_PAYLOAD = 64 << 20  # bytes of one frame's tensor; larger frames close the link


@dataclass
class LinkDown:
    """Queued by a receiver when its link ends: a closed socket or a malformed frame."""

    reason: str


Received = Union[Tuple[Any, Optional[torch.Tensor]], LinkDown]


def configure(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    return sock


def tcp_listen(host: str, port: int) -> socket.socket:
    """A listening socket; port 0 picks a free one. SO_REUSEADDR lets a quick rerun bind."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(4)
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


class Receiver(threading.Thread):
    """Reads frames from ``sock`` into ``inbox`` until the link ends, then queues LinkDown."""

    def __init__(self, sock: socket.socket, inbox: "queue.SimpleQueue[Received]", max_payload: int,
                 name: str) -> None:
        super().__init__(name=name, daemon=True)
        self.sock, self.inbox, self.max_payload = sock, inbox, max_payload

    def run(self) -> None:
        reason = "closed by peer"
        try:
            while True:
                header, tensor = framing.recv_frame(self.sock, self.max_payload)
                self.inbox.put((header, tensor))
                if header.msg_type == framing.SHUTDOWN:
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
    """Sends frames in the order given to ``put``: (msg_type, flags, sample ids, positions,
    tensor or None, seq). ``close`` stops it. A send error is remembered in ``error``; later
    frames are dropped.

    A frame of at most ``inline_max_bytes`` put while nothing is waiting to be sent goes out
    at once on the caller's thread: a one-token frame fits the socket buffer, so this does not
    block, and it saves the thread wake-up (tens of µs) that dominates a hop's overhead. Any
    other frame queues for this thread, so a large or backed-up send never stalls compute.
    Order holds because a frame is sent inline only when every earlier one is on the wire."""

    def __init__(self, sock: socket.socket, name: str, inline_max_bytes: int = 64 << 10) -> None:
        super().__init__(name=name, daemon=True)
        self.sock = sock
        self.inline_max_bytes = inline_max_bytes
        self.error: Optional[str] = None
        self._queue: "queue.SimpleQueue[Optional[tuple]]" = queue.SimpleQueue()
        self._pending = 0  # frames queued and not yet fully sent
        self._count_lock = threading.Lock()
        self._wire_lock = threading.Lock()  # held while a frame is written to the socket

    def put(self, item: tuple) -> None:
        tensor = item[4]
        small = tensor is None or tensor.numel() * tensor.element_size() <= self.inline_max_bytes
        with self._count_lock:
            inline = small and self._pending == 0 and self._wire_lock.acquire(blocking=False)
            if not inline:
                self._pending += 1
                self._queue.put(item)
        if inline:
            try:
                self._send(item)
            finally:
                self._wire_lock.release()

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued, then stop the thread (waiting at most ``timeout`` s)."""
        self._queue.put(None)
        if self.is_alive():
            self.join(timeout=timeout)

    def run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            with self._wire_lock:
                self._send(item)
            with self._count_lock:
                self._pending -= 1

    def _send(self, item: tuple) -> None:
        if self.error is not None:
            return
        msg_type, flags, sample_ids, positions, tensor, seq = item
        try:
            send(self.sock, msg_type, flags, sample_ids, positions, tensor, seq)
        except OSError as e:
            self.error = f"send failed: {e}"
            log.info("%s: %s", self.name, self.error)


def send(sock: socket.socket, msg_type: int, flags: int, sample_ids: Sequence[int],
         positions: Sequence[int], tensor: Optional[torch.Tensor], seq: int) -> None:
    if tensor is None:
        framing.send_control(sock, msg_type, sample_ids, positions, seq=seq)
    else:
        framing.send_tensor(sock, msg_type, sample_ids, positions, tensor, flags=flags, seq=seq)


def close_quietly(sock: Optional[socket.socket]) -> None:
    if sock is None:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
