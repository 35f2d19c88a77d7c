"""The end of an ``mdiedge`` process, without the interpreter's teardown.

Once a command has stopped what it started (its workers collected, its sockets closed), what
is left of Python's exit is unloading its modules, torch's among them: 0.5-1.5 s on a small
board, during which a local ring's starter waits for each worker and a supervisor for the
service. :func:`leave` does the rest of the exit Python would do and ends the process then.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import NoReturn


def exit_status(code: object) -> int:
    """The status ``SystemExit(code)`` ends a process with: None 0, an int itself (its low
    byte, as the kernel keeps it), anything else 1 (Python prints it first)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    return 1


def leave(code: object) -> "NoReturn":
    """End the process as ``raise SystemExit(code)`` at the top would: what the interpreter
    does first on its way out (``threading._shutdown``: threading's exit callbacks, which
    end idle thread pools, then a wait for every thread that is not a daemon), the
    ``atexit`` functions (logging's flush among them), stdout and stderr flushed; then exit
    at once, without unloading modules."""
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()
    else:  # not CPython's threading
        for thread in threading.enumerate():
            if thread is not threading.main_thread() and not thread.daemon:
                thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader gone, or a stream closed
            pass
    os._exit(exit_status(code))
