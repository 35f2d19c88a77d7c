"""The ring seen from the starter: the workers beyond its own stage, as the pipeline's remote
tail. It sends and receives the starter's messages over its link pair, names the node that
broke the ring when a link fails or a message does not come back, and ends the ring with a
SHUTDOWN that every worker forwards before it stops its compute loop.
"""
from __future__ import annotations

import logging
import queue
import time
from typing import List, Optional

import torch

from ..base.errors import RingError
from ..runtime import messages
from ..runtime.control import ControlClient
from ..runtime.links import LinkDown, LinkPair
from ..runtime.messages import Message
from ..runtime.pipeline import Tail

log = logging.getLogger("mdiedge.ring")

SHUTDOWN_WAIT_S = 2.0


class RingTail(Tail):
    """The workers, in ring order, reached over ``links`` (out to the first, in from the last)."""

    def __init__(self, links: LinkPair, clients: List[ControlClient], timeout_s: float) -> None:
        self.links, self.clients, self.timeout_s = links, clients, timeout_s
        self.nodes = len(clients)
        self.broken: Optional[str] = None

    def send(self, message: Message) -> None:
        error = self.broken or self.links.send_error
        if error is not None:
            raise self.diagnose(error)
        self.links.send(message)

    def receive(self, timeout: Optional[float] = None) -> Message:
        limit = self.timeout_s if timeout is None else timeout
        try:
            item = self.links.receive(limit)
        except queue.Empty:
            raise self.diagnose(f"no message returned within {limit:.0f} s") from None
        if isinstance(item, LinkDown):
            raise self.diagnose(item.reason)
        return item

    def diagnose(self, reason: str) -> RingError:
        """Name the node that broke the ring: the first worker whose control plane is gone."""
        self.broken = self.broken or reason
        for client in self.clients:
            status = client.status(timeout=2)
            if status.state == "down":
                node = client.node
                return RingError(f"worker {node.name!r} at {node.address} is down "
                                 f"({status.error}); ring link: {reason}")
        return RingError(f"the ring broke: {reason}")

    def ping(self, payload: torch.Tensor, count: int) -> List[float]:
        """Round-trip times (s) of ``count`` PING messages carrying ``payload`` around the
        ring: framing, queues and sockets with no compute. Nothing else may be in flight."""
        times = []
        for seq in range(1, count + 1):
            t0 = time.perf_counter()
            self.send(Message(messages.PING, [0], [0], payload, seq=seq))
            reply = self.receive()
            times.append(time.perf_counter() - t0)
            if reply.kind != messages.PING or reply.seq != seq:
                raise RingError(f"unexpected reply to ping {seq}: {messages.KIND_NAMES.get(reply.kind)}")
        return times

    def close(self) -> None:
        """End the ring: SHUTDOWN goes around (each worker stops its loop cleanly), then the
        links close. A broken ring just closes."""
        if self.broken is None and self.links.send_error is None:
            self.links.send(Message(messages.SHUTDOWN))
            deadline = time.monotonic() + SHUTDOWN_WAIT_S
            while time.monotonic() < deadline:
                try:
                    item = self.links.receive(max(0.01, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if isinstance(item, LinkDown) or item.kind == messages.SHUTDOWN:
                    break
        self.broken = self.broken or "closed"
        self.links.close()
