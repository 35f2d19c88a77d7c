"""The one thread that runs a node's torch work: loading its weights, setting up its KV slots and
stepping its scheduler (or serving its ring links, on a worker).

torch's CPU kernels run their parallel regions on an OpenMP team, and libgomp keeps a team per
thread that starts one. Once one thread has run a parallel region, a parallel region on another
thread of the same process runs much slower (on a 2-core machine the decode step lost more than half
its speed). So a node keeps its compute on one thread: the engine (or the worker) owns a
``ComputeThread``, loads its model with ``call``, and runs its stepping loop with ``submit``; a
request thread only waits. ``bin/bench-threads`` measures it."""
from __future__ import annotations

import queue
import threading
import weakref
from concurrent.futures import Future
from typing import Any, Callable, Optional, Tuple

from ..base import defaults


class ComputeThread:
    """A daemon thread that runs what it is given, one at a time, in order; started at the first
    ``submit`` and kept until this object is collected (a new one starts after a fork)."""

    def __init__(self, name: str = "mdiedge-compute") -> None:
        self.name = name
        self._lock = threading.Lock()
        self._queue: "queue.SimpleQueue[Tuple[Future, Callable[..., Any], tuple, dict]]" = \
            queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        weakref.finalize(self, self._queue.put, None)  # the thread ends with its owner

    def here(self) -> bool:
        return threading.current_thread() is self._thread

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> "Future[Any]":
        """Run ``fn(*args, **kwargs)`` on the thread after what was given before; its
        future holds the result or the error."""
        future: "Future[Any]" = Future()
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=_serve, args=(self._queue,),
                                                name=self.name, daemon=True)
                self._thread.start()
            self._queue.put((future, fn, args, kwargs))
        return future

    def close(self, timeout: float = defaults.COMPUTE_CLOSE_S) -> None:
        """End the thread after what it was given (waiting up to ``timeout`` s for that), so that no
        torch work runs while the interpreter exits; a later ``submit`` starts another."""
        with self._lock:
            thread, self._thread = self._thread, None
            if thread is None:
                return
            self._queue.put(None)
        if thread is not threading.current_thread():
            thread.join(timeout)

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` run on the thread (at once when the caller is on it), its
        result returned or its error raised; the caller waits."""
        if self.here():
            return fn(*args, **kwargs)
        return self.submit(fn, *args, **kwargs).result()


def _serve(jobs: "queue.SimpleQueue[Any]") -> None:
    """Run each job of ``jobs`` until the None its ``ComputeThread``'s collection puts
    there (the thread holds no reference to that object)."""
    while True:
        job = jobs.get()
        if job is None:
            return
        future, fn, args, kwargs = job
        del job
        if not future.set_running_or_notify_cancel():
            continue
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as e:  # the caller's to raise
            future.set_exception(e)
        del future, fn, args, kwargs  # hold nothing while idle
