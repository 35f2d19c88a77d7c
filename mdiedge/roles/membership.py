"""Which configured workers form the ring now: those that answer, a spare in the place of one
that is lost (``mdiedge.placement.partition.choose_members``), and a watch on the lost ones so
that one that answers again rejoins at the next request boundary (Petals keeps a generation
alive across a server's loss; here the ring also takes the server back)."""
from __future__ import annotations

import logging
import threading
from typing import Dict, List, Optional, Sequence

from ..base import defaults
from ..base.errors import RingError
from ..base.defaults import REJOIN_CHECK_S
from ..base.nodes import NodeSpec
from ..runtime.control import ControlClient
from ..placement.partition import choose_members
from ..runtime.protocol import NodeStatus
from ..runtime.ring import probe_all

log = logging.getLogger("mdiedge.starter")



class Membership:
    """The ring's workers among ``clients`` (every configured worker, spares included);
    ``sealed``: whether the ring seals its links (a worker that does otherwise is left out)."""

    def __init__(self, clients: Sequence[ControlClient], sealed: bool = True) -> None:
        self.clients = list(clients)
        self.sealed = sealed
        self.members: List[ControlClient] = []  # the current ring's workers, in ring order
        self.lost: Dict[str, str] = {}  # left out of the ring (name: why) until they answer
        self.rejoin = threading.Event()  # a lost worker answers again: set up anew when idle
        self.closed = threading.Event()
        self._watcher: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    @property
    def nodes(self) -> List[NodeSpec]:
        return [c.node for c in self.members]

    @property
    def degraded(self) -> bool:
        """A configured worker (not a spare) is lost: the ring serves without it."""
        return any(c.node.name in self.lost and not c.node.spare for c in self.clients)

    def planned(self) -> List[NodeSpec]:
        """The workers a ring set up now would have (no one asked)."""
        return choose_members([c.node for c in self.clients], self.lost)

    def refresh(self) -> None:
        """Ask every configured worker; the ring's workers are those that answer."""
        self.rejoin.clear()
        for client, status in zip(self.clients, probe_all(self.clients,
                                                          defaults.DIAGNOSE_TIMEOUT_S)):
            why = self.unfit(status)
            if why is not None:
                self.lost[client.node.name] = why
            else:
                self.lost.pop(client.node.name, None)
        for name, why in self.lost.items():
            log.warning("%s left out of the ring: %s", name, why)
        self._choose()

    def unfit(self, status: NodeStatus) -> Optional[str]:
        """Why a worker of ``status`` cannot be in the ring now (down, or a setting of the
        ring it does not share, which the links' handshake would refuse), or None."""
        if status.state == "down":
            return f"down ({status.error})"
        if status.sealed is not None and status.sealed != self.sealed:
            ring = "seals its links" if self.sealed else "runs --no-encrypt"
            it = "seals its links" if status.sealed else "runs --no-encrypt"
            return (f"sealing mismatch: it {it}, this ring {ring} (every node needs the same "
                    f"setting)")
        return None

    def lose(self, names: Sequence[str], why: str) -> None:
        """``names`` are lost (``why``): the ring's workers without them."""
        for name in names:
            self.lost[name] = why
        self._choose()

    def _choose(self) -> None:
        by_name = {c.node.name: c for c in self.clients}
        self.members = [by_name[n.name] for n in self.planned()]
        if not self.members:
            if not self.lost:  # nobody is lost: every configured worker is a spare
                raise RingError("no worker of the ring to set up: every configured worker is "
                                "a spare (spare = true); make at least one of them a member")
            down = all(why.startswith("down") for why in self.lost.values())
            raise RingError(f"no worker of the ring {'answers' if down else 'can join'}: " +
                            "; ".join(f"{name}: {why}" for name, why in self.lost.items()))
        if self.lost:
            self._watch()

    def _watch(self) -> None:
        """Ask the lost workers every few seconds, in the background, until the starter is
        closed; when one answers, ``rejoin`` is set (the next idle request boundary sets the
        ring up anew, with it)."""
        def watch() -> None:
            while not self.closed.wait(REJOIN_CHECK_S):
                lost = [c for c in self.clients if c.node.name in self.lost]
                if lost and not self.rejoin.is_set() and any(
                        self.unfit(s) is None for s in probe_all(lost,
                                                                 defaults.DIAGNOSE_TIMEOUT_S)):
                    log.info("a lost worker answers again: it rejoins at the next request")
                    self.rejoin.set()

        with self._lock:
            if self._watcher is None:
                self._watcher = threading.Thread(target=watch, name="rejoin", daemon=True)
                self._watcher.start()

    def statuses(self) -> List[NodeStatus]:
        """Every configured worker's status; one outside the ring shows no layers (what it
        last held is not where the layers live now), a spare as role ``spare``."""
        statuses = probe_all(self.clients, timeout=5.0)
        members = {c.node.name for c in self.members}
        for client, status in zip(self.clients, statuses):
            if client.node.name not in members and status.state != "down":
                status.layers = None
                if client.node.spare:
                    status.role = "spare"
        return statuses
