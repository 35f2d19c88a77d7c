"""The ring seen from the starter: the workers beyond its stage, as the pipeline's remote tail,
ended with a SHUTDOWN every worker forwards.

Detection is bounded: a closed link is noticed at once; while no message comes back, every worker's
control plane is asked every third of ``stall_s`` (in parallel, each within a third), one not
answering is asked once more, so a dead or frozen worker is named within ``stall_s`` as
``NodeLost``, while a slow one that answers is waited for up to ``timeout_s``. A frame lost while
every node answers is told from a slow node by a probe behind the overdue message (``progress``),
within about a second."""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, List, Optional, Tuple

from ..base import defaults
from ..base.errors import NodeLost, RingError
from ..base.defaults import RING_SHUTDOWN_WAIT_S
from ..base.nodes import NodeSpec
from . import messages
from .control import ControlClient
from .links import LinkDown, LinkPair
from .messages import Message
from .pipeline import RemoteStages
from .progress import Progress
from .protocol import NodeStatus

log = logging.getLogger("mdiedge.ring")



def probe_all(clients: List[ControlClient], timeout: float) -> List[NodeStatus]:
    """In parallel (a thread each), so the answer comes within ``timeout`` however many are frozen.
    """
    results: List[Optional[NodeStatus]] = [None] * len(clients)

    def ask(i: int) -> None:
        results[i] = clients[i].status(timeout=timeout)

    threads = [threading.Thread(target=ask, args=(i,), name=f"probe-{c.node.name}", daemon=True)
               for i, c in enumerate(clients)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout + 1.0
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return [r if r is not None else NodeStatus.down(
        "worker", c.node.name, c.node.address, f"no answer within {timeout:.0f} s")
        for r, c in zip(results, clients)]


class RingStages(RemoteStages):
    """Out to the first worker over ``links``, in from the last."""

    def __init__(self, links: LinkPair, clients: List[ControlClient], timeout_s: float,
                 stall_s: float = defaults.STALL_S) -> None:
        self.links, self.clients, self.timeout_s, self.stall_s = links, clients, timeout_s, stall_s
        self.nodes = len(clients)
        self.broken: Optional[str] = None
        self.progress = Progress()

    def send(self, message: Message) -> None:
        error = self.broken or self.links.send_error
        if error is not None:
            raise self.diagnose(error)
        self.links.send(message)
        self.progress.on_send(message)

    def receive(self, timeout: Optional[float] = None) -> Message:
        """A probe goes out behind an overdue message (``Progress``): one back first means a lost
        frame; the stall rule and ``timeout`` apply."""
        limit = self.timeout_s if timeout is None else timeout
        now = time.monotonic()
        deadline, third = now + limit, self.stall_s / 3
        check_at = now + third
        while True:
            due = self.progress.due()
            until = min(deadline, check_at, due if due is not None else deadline)
            try:
                item = self.links.receive(max(0.0, until - time.monotonic()))
            except queue.Empty:
                now = time.monotonic()
                if due is not None and now >= due and self.links.send_error is None:
                    self.links.send(self.progress.probe())  # behind the overdue message
                if now >= deadline:
                    raise self.diagnose(f"no message returned within {limit:.0f} s") from None
                if now >= check_at:
                    self._stall_check(third)
                    check_at = time.monotonic() + third
                continue
            if isinstance(item, LinkDown):
                raise self.diagnose(item.reason)
            lost_frame = self.progress.on_back(item)
            if lost_frame is None:
                return item
            if lost_frame:
                log.warning("%s", lost_frame)
                raise self.diagnose(lost_frame)

    def _stall_check(self, third: float) -> None:
        """``NodeLost`` naming the workers not answering within ``third`` s, twice."""
        lost = self.lost(third)
        if lost:  # asked again: a busy control port gets a second chance
            lost = self.lost(third, [node for node, _ in lost])
        if lost:
            raise self._lost(lost, f"no message back for {third:.3g} s")

    def lost(self, timeout: float, among: Optional[List[NodeSpec]] = None
             ) -> List[Tuple[NodeSpec, str]]:
        """Workers (``among`` these) not answering within ``timeout``, each with why."""
        clients = [c for c in self.clients if among is None or c.node in among]
        return [(client.node, f"down ({status.error})") for client, status in
                zip(clients, probe_all(clients, timeout)) if status.state == "down"]

    def diagnose(self, reason: str) -> RingError:
        """Asking every worker at once within ``DIAGNOSE_TIMEOUT_S``: ``NodeLost`` naming those that
        do not answer, or naming none (a worker restarted or ended the ring after an error: the same
        workers can set it up again)."""
        self.broken = self.broken or reason
        lost = self.lost(min(defaults.DIAGNOSE_TIMEOUT_S, self.stall_s))
        if lost:
            return self._lost(lost, reason)
        return NodeLost(f"the ring broke (every worker answers): {reason}", ())

    def _lost(self, lost: List[Tuple[NodeSpec, str]], reason: str) -> NodeLost:
        self.broken = self.broken or reason
        text = "; ".join(f"worker {n.name!r} at {n.address} is {why}" for n, why in lost)
        return NodeLost(f"{text}; ring link: {reason}", tuple(n.name for n, _ in lost))

    def ping(self, payload: Any, count: int) -> List[float]:
        """Round trips (s) of ``count`` PINGs carrying ``payload`` around the ring: framing, queues
        and sockets, no compute. Nothing else may be in flight."""
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
        """SHUTDOWN goes around, then the links close; a broken ring just closes."""
        if self.broken is None and self.links.send_error is None:
            self.links.send(Message(messages.SHUTDOWN))
            deadline = time.monotonic() + RING_SHUTDOWN_WAIT_S
            while time.monotonic() < deadline:
                try:
                    item = self.links.receive(max(0.01, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if isinstance(item, LinkDown) or item.kind == messages.SHUTDOWN:
                    break
        self.broken = self.broken or "closed"
        self.links.close()
