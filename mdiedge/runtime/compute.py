"""The one thread that runs a node's torch work: loading, KV set-up, stepping.

libgomp keeps an OpenMP team per thread that starts one; once one thread has run a parallel region,
one on another thread runs much slower (a 2-core decode lost over half its speed). So a node keeps
its compute on one ``ComputeThread`` (``call`` to load, ``submit`` to step); a request thread only
waits. ``bin/bench-threads`` measures it."""
from __future__ import annotations

import queue
import threading
import weakref
from concurrent.futures import Future
from typing import Any, Callable, Optional, Tuple

from ..base import defaults


class ComputeThread:
    """Runs what it is given in order, one at a time; started at the first ``submit``, kept until
    this object is collected (a new one after a fork)."""

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
        """After what was given before; the future holds the result or the error."""
        future: "Future[Any]" = Future()
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=_serve, args=(self._queue,),
                                                name=self.name, daemon=True)
                self._thread.start()
            self._queue.put((future, fn, args, kwargs))
        return future

    def close(self, timeout: float = defaults.COMPUTE_CLOSE_S) -> None:
        """After what it was given (up to ``timeout`` s), so no torch work runs while the
        interpreter exits; a later ``submit`` starts another."""
        with self._lock:
            thread, self._thread = self._thread, None
            if thread is None:
                return
            self._queue.put(None)
        if thread is not threading.current_thread():
            thread.join(timeout)

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """On the thread (at once when the caller is on it); the caller waits."""
        if self.here():
            return fn(*args, **kwargs)
        return self.submit(fn, *args, **kwargs).result()


def _serve(jobs: "queue.SimpleQueue[Any]") -> None:
    """Until the None the ``ComputeThread``'s collection puts there (the thread holds no reference
    to it)."""
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
