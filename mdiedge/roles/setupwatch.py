"""Setting up a ring under the stall rule: each step of a set-up (a worker's ``/reset``,
``/assign``, ``/weights``, ``/connect``, the ring's links) runs on its own thread while the workers
it waits for are asked for their status every third of ``stall_s``, as a running ring's are
(``mdiedge.runtime.ring``). A worker that does not answer twice in a row (killed, frozen,
unreachable) is a ``NodeLost`` within ``stall_s``, however long the step itself may take while the
worker answers (loading weights takes minutes on a board). The step left behind is abandoned: what
it returns late is handed to ``abandon`` (links are closed), and ``cancel`` is set for a step that
can stop early.

``waiting`` says what the set-up waits for now, for ``/health`` and the starter's status."""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, TypeVar

from ..base.errors import NodeLost
from ..runtime.control import ControlClient
from ..runtime.ring import probe_all

T = TypeVar("T")


def _silent(clients: Sequence[ControlClient], timeout: float) -> List[Tuple[ControlClient, str]]:
    """The ``clients`` whose node does not answer its status within ``timeout``, with why."""
    return [(c, str(s.error)) for c, s in zip(clients, probe_all(list(clients), timeout))
            if s.state == "down"]


class SetupWatch:
    """The stall rule over set-up steps; ``waiting()``: the step under way, if any."""

    def __init__(self, stall_s: float) -> None:
        self.stall_s = stall_s
        self._step: Optional[Tuple[str, float]] = None  # what, since (monotonic)

    def waiting(self) -> Optional[str]:
        """What the set-up waits for now and for how long, in one line; None when no set-up
        step is under way."""
        step = self._step
        if step is None:
            return None
        return f"{step[0]} for {time.monotonic() - step[1]:.1f} s"

    def run(self, what: str, clients: Sequence[ControlClient], work: Callable[[], T],
            abandon: Optional[Callable[[T], None]] = None,
            cancel: Optional[threading.Event] = None) -> T:
        """``work()``'s result (or its error), unless a node of ``clients`` stops answering
        first: then ``NodeLost`` naming it, within ``stall_s``."""
        box: Dict[str, Any] = {}
        done, lock = threading.Event(), threading.Lock()

        def target() -> None:
            try:
                box["result"] = work()
            except BaseException as e:  # handed to the waiting thread
                box["error"] = e
            with lock:
                done.set()
                late = box.get("abandoned", False)
            if late and "result" in box and abandon is not None:
                abandon(box["result"])

        threading.Thread(target=target, name=f"setup: {what}"[:60], daemon=True).start()
        self._step = (what, time.monotonic())
        try:
            self._watch(what, clients, done, lock, box, cancel)
        finally:
            self._step = None
        if "error" in box:
            raise box["error"]
        return box["result"]

    def _watch(self, what: str, clients: Sequence[ControlClient], done: threading.Event,
               lock: threading.Lock, box: Dict[str, Any],
               cancel: Optional[threading.Event]) -> None:
        """Until ``done``: every third of ``stall_s`` ask ``clients``; one silent twice in a
        row (asked again at once: a busy control port gets a second chance) is lost."""
        third = self.stall_s / 3
        while not done.wait(third):
            silent = _silent(clients, third)
            if silent:
                silent = _silent([c for c, _ in silent], third)
            if not silent:
                continue
            with lock:
                if done.is_set():  # it finished meanwhile: its result stands
                    return
                box["abandoned"] = True
            if cancel is not None:
                cancel.set()
            text = "; ".join(f"worker {c.node.name!r} at {c.node.address} does not answer "
                             f"({why})" for c, why in silent)
            raise NodeLost(f"{text}; set-up was waiting for {what}",
                           tuple(c.node.name for c, _ in silent))
