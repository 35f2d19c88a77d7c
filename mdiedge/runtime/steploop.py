"""The scheduler's loop and its queue: ``StepLoop`` steps a scheduler on the node's compute
thread while there is work; ``Waiting`` holds the requests not yet admitted."""
from __future__ import annotations

import collections
import threading
from typing import Callable, Deque, List, Optional, Tuple

from .compute import ComputeThread
from .generation import Generation
from .plan import QueueView
from ..base.errors import QueueFull, RingError


class Waiting:
    """Requests not yet admitted, first come first served: any thread adds (as the queue's
    rule allows), the loop takes them in order."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._items: Deque[Tuple[Generation, int]] = collections.deque()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def add(self, item: Tuple[Generation, int], broken: Callable[[], Optional[BaseException]],
            view: Callable[[Tuple[int, ...]], QueueView], limit: Optional[int] = None) -> None:
        """Queue ``item`` unless the pipeline broke (checked under the lock ``take_all``
        holds, so nothing is queued after a failure drained the queue) or the queue's rule
        (``QueueView.takes``, at most ``limit`` waiting) refuses it."""
        with self._lock:
            error = broken()
            if error is not None:
                raise RingError(f"the pipeline failed before: {error}")
            now = view(self.sizes())
            if not now.takes(len(item[0].samples), self.limit if limit is None else limit):
                raise QueueFull(f"{now.waiting} requests are waiting for the {now.slots} KV "
                                f"slots already; try again later")
            self._items.append(item)

    def sizes(self) -> Tuple[int, ...]:
        return tuple(len(g.samples) for g, _ in list(self._items))

    def head(self) -> List[Tuple[Generation, int]]:
        with self._lock:
            return list(self._items)

    def pop(self) -> None:
        with self._lock:
            self._items.popleft()

    def take_all(self) -> List[Tuple[Generation, int]]:
        with self._lock:
            items = list(self._items)
            self._items.clear()
            return items


class StepLoop:
    """The loop that steps a scheduler, on the node's ``ComputeThread``: started when a request is
    waited for, it calls ``step`` while ``busy()`` (work in flight or waiting), then ends, and the
    next ``start`` runs it again. A step's failure is the step's to record."""

    def __init__(self, step: Callable[[], None], busy: Callable[[], bool],
                 compute: ComputeThread) -> None:
        self._step, self._busy, self.compute = step, busy, compute
        self._lock = threading.Condition()  # starting and ending a run
        self._running = False

    def start(self) -> None:
        """Run the loop on the compute thread; a caller on that thread runs it now."""
        with self._lock:
            if self._running:
                return
            self._running = True
            if not self.compute.here():
                self.compute.submit(self._run)
                return
        self._run()

    def join(self) -> None:
        with self._lock:
            while self._running:
                self._lock.wait()

    def _run(self) -> None:
        while True:
            with self._lock:  # work added before ``start`` is seen here, or a new run starts
                if not self._busy():
                    self._running = False
                    self._lock.notify_all()
                    return
            try:
                self._step()
            except BaseException:  # recorded by the step: its requests failed and were woken
                pass
