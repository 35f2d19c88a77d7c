"""The engine of a ring: this process is the starter (its stage, the head and sampling), the
workers are running nodes reached over links (``mdiedge.roles.starter`` sets the ring up)."""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence

from ..base.errors import RingError
from ..base.nodes import NodeSpec
from ..roles.starter import RingStarter, Route, StarterOptions, ring_message_rows
from ..runtime.ring import probe_all
from ..runtime.scheduler import Scheduler
from ..runtime.stages import LocalStage
from ..runtime.protocol import NodeStatus
from .engine import Engine, PathLike, TextModel

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ..model.earlyexit.files import ExitSettings


class RingEngine(Engine):
    """Generation over a ring: this process is the starter, ``workers`` are running nodes.
    ``changes`` are fields of ``StarterOptions`` (``timeout_s=30``, ``secret=...``); ``route``
    maps each ring link's data endpoint to the address it connects to (``Route``)."""

    def __init__(self, workers: Sequence[NodeSpec], model: Optional[PathLike] = None,
                 tokenizer: Optional[PathLike] = None,
                 options: StarterOptions = StarterOptions(),
                 early_exit: Optional[ExitSettings] = None, route: Optional[Route] = None,
                 text: Optional[TextModel] = None, **changes: Any) -> None:
        self._open(model, tokenizer, text)
        self.options = dataclasses.replace(options, **changes)
        ring_message_rows(self.options, self.cfg)  # a max_payload too small for the model: now
        self.early_exit = early_exit
        self.starter = RingStarter(self.path, self.cfg, workers, self.options, early_exit,
                                   route)
        self._setup_lock = self.starter.setup_lock
        self.compute = self.starter.compute

    @property
    def workers(self) -> List[NodeSpec]:
        return self.starter.workers

    def prepare(self, n_slots: int, context: int) -> Scheduler:
        return self.starter.ensure(n_slots, context)

    def unavailable(self, timeout: float) -> Optional[str]:
        """None when a request would find a ring: the current one's links are up, or a worker
        answers its control plane within ``timeout`` s (the next request sets up a ring of those
        that do); else why not, in one line (a set-up under way: what it waits for)."""
        starter = self.starter
        scheduler = starter.scheduler
        waiting = starter.watch.waiting()
        if waiting is not None:
            return f"setting up the ring: waiting for {waiting}"
        if scheduler is not None and scheduler.usable and starter.ring_alive():
            return None
        statuses = probe_all(starter.clients, timeout)
        if any(s.state != "down" for s in statuses):
            return None
        return "no worker of the ring answers: " + "; ".join(f"{s.name} ({s.error})"
                                                             for s in statuses)

    def setting_up(self) -> Optional[str]:
        return self.starter.watch.waiting()

    def kv_fill_s(self) -> float:
        """The starter's stage's and, with early exit on, every worker's (asked)."""
        scheduler = self.starter.scheduler
        if self.early_exit is None or scheduler is None:
            return 0.0
        own = sum(stage.counters.kv_fill_s for stage in scheduler.pipeline.stages)
        members = {n.name for n in self.starter.ring_workers}
        return own + sum(s.kv_fill_s for s in self.starter.node_status() if s.name in members)

    def status(self) -> List[NodeStatus]:
        """The starter's status, then each worker's (asked on its control port)."""
        return [self.starter.status()] + self.starter.node_status()

    def worker_status(self) -> List[NodeStatus]:
        return self.starter.node_status()

    def ping(self, count: int) -> List[float]:
        """Round-trip times (s) of ``count`` one-token pings around the ring set up (no
        compute; nothing else may be in flight)."""
        tail = self.starter.tail
        if tail is None:
            raise RingError("no ring is set up to ping")
        import numpy as np

        return tail.ping(np.random.default_rng().standard_normal((1, 1, self.cfg.dim),
                                                                 dtype=np.float32), count)

    def own_stage(self) -> Optional[LocalStage]:
        """This process's stage of the ring set up (None before one is)."""
        scheduler = self.starter.scheduler
        return scheduler.pipeline.stages[0] if scheduler is not None else None

    def link_stats(self) -> List[Dict[str, Any]]:
        return self.starter.link_stats()

    def ring_nodes(self) -> int:
        return len(self.starter.ring_workers) + 1

    def ring_id(self) -> object:
        return self.starter.tail

    def release(self) -> None:
        self.starter.close()
