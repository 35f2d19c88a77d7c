"""Accept loops that outlive a full descriptor table: an accept that fails for want of
descriptors or memory waits, doubling from ``ACCEPT_BACKOFF_S[0]`` up to ``[1]``, before it
tries again (not a busy loop), and says so in rate-limited lines (not a traceback a try)::

    backoff = AcceptBackoff(log, "control port 7600")
    try:
        sock, peer = listener.accept()
    except OSError as e:
        if not backoff.failed(e):  # not a shortage: the caller's error
            raise
        continue  # it waited
    backoff.ok()
"""
from __future__ import annotations

import errno
import logging
import time
from typing import Callable

from .defaults import ACCEPT_BACKOFF_S
from .ratelog import Throttled

SHORTAGES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


def is_shortage(error: BaseException) -> bool:
    """Out of descriptors or memory."""
    return isinstance(error, OSError) and error.errno in SHORTAGES


class AcceptBackoff:
    """``what`` names its port in the log."""

    def __init__(self, logger: logging.Logger, what: str,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.what, self._sleep = what, sleep
        self.delay = ACCEPT_BACKOFF_S[0]
        self.log = Throttled(logger, logging.WARNING, f"{what}: failed accepts")
        self.failures = 0

    def wait_s(self, error: BaseException) -> float:
        """Seconds before the next accept (0: not a shortage), logged rate-limited; the next wait
        doubled."""
        if not is_shortage(error):
            return 0.0
        self.failures += 1
        wait, self.delay = self.delay, min(2 * self.delay, ACCEPT_BACKOFF_S[1])
        self.log("%s: cannot accept a connection (%s); retrying in %.2f s", self.what,
                 getattr(error, "strerror", None) or error, wait)
        return wait

    def failed(self, error: BaseException) -> bool:
        """Sleep ``wait_s``; False when ``error`` is not a shortage."""
        wait = self.wait_s(error)
        if wait:
            self._sleep(wait)
        return wait > 0

    def ok(self) -> None:
        """The next shortage waits the shortest time again."""
        self.delay = ACCEPT_BACKOFF_S[0]
