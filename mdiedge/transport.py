"""Persistent neighbour links of the data plane and the threads that serve them.

A node receives frames on one thread, computes on another and sends on a third, joined by
FIFO queues (as in MDI-LLM, Macario et al. 2024). ``queue.Queue`` carries the wake-ups, so
none can be lost (the paper's code clears an event after popping and can miss one).
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
from .errors import FrameError

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

    def __init__(self, sock: socket.socket, inbox: "queue.Queue[Received]", max_payload: int,
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
    """Sends what ``outbox`` holds: (msg_type, flags, sample ids, positions, tensor or None, seq).
    ``None`` stops it. A send error is remembered in ``error`` and ends the thread."""

    def __init__(self, sock: socket.socket, outbox: "queue.Queue[Optional[tuple]]", name: str) -> None:
        super().__init__(name=name, daemon=True)
        self.sock, self.outbox = sock, outbox
        self.error: Optional[str] = None

    def run(self) -> None:
        while True:
            item = self.outbox.get()
            if item is None:
                return
            msg_type, flags, sample_ids, positions, tensor, seq = item
            try:
                send(self.sock, msg_type, flags, sample_ids, positions, tensor, seq)
            except OSError as e:
                self.error = f"send failed: {e}"
                log.info("%s: %s", self.name, self.error)
                return


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
