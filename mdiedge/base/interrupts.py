"""Ctrl-C held back while Python code loads, then acted on.

A KeyboardInterrupt raised while ``exec`` or ``eval`` runs a string (``dataclasses`` and ``typing``
do, while modules load) marks the process in CPython as ended by an unhandled Ctrl-C: however the
program then handles it, the interpreter kills itself with SIGINT on the way out instead of exiting
with the program's status. torch's C start-up clears any error it meets while importing numpy, a
KeyboardInterrupt included, so a Ctrl-C then would be lost. So the command line notes a Ctrl-C while
it loads and raises it once loading is done."""
from __future__ import annotations

import signal

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing isn't loaded yet when the command line starts holding Ctrl-C
    from types import FrameType
    from typing import List, Optional

_pressed: "List[int]" = []


def _note(signum: int, frame: "Optional[FrameType]") -> None:
    _pressed.append(signum)


def hold() -> bool:
    """Note Ctrl-C instead of raising it, from now until :func:`release`. Only on the main
    thread, and only where Python's own handler is in place (a command that installed its
    own keeps it). Returns whether Ctrl-C is held now."""
    current = signal.getsignal(signal.SIGINT)
    if current is not signal.default_int_handler:
        return current is _note
    try:
        signal.signal(signal.SIGINT, _note)
    except ValueError:  # not the main thread
        return False
    return True


def release() -> None:
    """Put Python's handler back and raise KeyboardInterrupt if Ctrl-C was pressed meanwhile."""
    if signal.getsignal(signal.SIGINT) is _note:
        try:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        except ValueError:  # not the main thread: its hold stays
            return
    if _pressed:
        _pressed.clear()
        raise KeyboardInterrupt


class held:
    """``with held():`` Ctrl-C held back for the block (see :func:`hold`), then raised if
    it was pressed. Inside an outer hold, the outer one stays in place and acts."""

    def __enter__(self) -> None:
        self.mine = signal.getsignal(signal.SIGINT) is not _note and hold()

    def __exit__(self, *exc: object) -> None:
        if self.mine:
            release()
