"""The end of an ``mdiedge`` process, without the interpreter's teardown.

Once a command has stopped what it started (its workers collected, its sockets closed), what is left
of Python's exit is unloading its modules, torch's among them: 0.5-1.5 s on a small board, during
which a local ring's starter waits for each worker and a supervisor for the service. :func:`leave`
does the rest of the exit Python would do and ends the process then."""
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
    at once, without unloading modules. A Ctrl-C meanwhile ends it with status 130; stdout
    that cannot be written (a full disk) turns a status 0 into Python's 120."""
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
    status = exit_status(code)
    try:
        _wait_for_threads()
        atexit._run_exitfuncs()
    except KeyboardInterrupt:
        status = 130
    if not _flushed(sys.stdout) and status == 0:
        status = 120
    _flushed(sys.stderr)
    os._exit(status)


def _wait_for_threads() -> None:
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()
        return
    for thread in threading.enumerate():  # not CPython's threading
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()


def _flushed(stream: object) -> bool:
    """Whether ``stream`` is flushed, or its reader is gone (EPIPE), or it is closed."""
    try:
        stream.flush()  # type: ignore[attr-defined]
    except BrokenPipeError:
        return True
    except OSError:
        return False
    except (ValueError, AttributeError):  # closed, or replaced by something without flush
        return True
    return True
