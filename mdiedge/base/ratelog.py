"""Rate-limited log lines for events a peer can repeat at will (refused requests, failed
handshakes, a full descriptor table): the first of a quiet spell is logged as it comes, the
rest are counted and logged as one summary, at most once per ``interval`` seconds::

    refused = Throttled(log, logging.WARNING, "refused control requests")
    refused("refused %s from %s: %s", path, peer, why)
    # -> the first line, then "refused control requests: 1999 more in the last 10 s
    #    (latest: refused ...)" once per interval while the flood lasts

A summary is due ``interval`` seconds after the first event it counts; a timer writes it
when no later event comes to do so, so the count of a flood that stopped is not lost.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Optional

from .defaults import LOG_SUMMARY_S


class Throttled:
    """One kind of event, logged at ``level`` on ``logger``: see the module's docstring."""

    def __init__(self, logger: logging.Logger, level: int, what: str,
                 interval: float = LOG_SUMMARY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger, self.level, self.what = logger, level, what
        self.interval, self._clock = float(interval), clock
        self._lock = threading.Lock()
        self._quiet_from = float("-inf")  # events before this are summarised, not logged
        self._counted = 0
        self._latest = ""
        self._timer: Optional[threading.Timer] = None
        self.total = 0  # every event, logged or counted

    def __call__(self, msg: str, *args: Any) -> None:
        if self.admit(msg, *args):
            self.logger.log(self.level, msg, *args)

    def admit(self, msg: str, *args: Any) -> bool:
        """Count an event: True when it is the first of a quiet spell, which the caller logs
        itself (a record of another logger passed on whole, its traceback included), False
        when it is counted for the summary."""
        now = self._clock()
        with self._lock:
            self.total += 1
            if now >= self._quiet_from and self._counted == 0:
                self._quiet_from = now + self.interval
                log_now = True
            else:
                log_now = False
                self._counted += 1
                self._latest = msg % args if args else msg
                if self._timer is None:
                    self._timer = threading.Timer(max(0.0, self._quiet_from - now), self.flush)
                    self._timer.daemon = True
                    self._timer.start()
        return log_now

    def flush(self) -> None:
        """Log the summary of the events counted so far (none: nothing)."""
        with self._lock:
            counted, latest = self._counted, self._latest
            self._counted, self._timer = 0, None
            if counted:
                self._quiet_from = self._clock() + self.interval
        if counted:
            self.logger.log(self.level, "%s: %d more in the last %.0f s (latest: %s)",
                            self.what, counted, self.interval, latest)

    def cancel(self) -> None:
        """Stop a pending summary's timer (its events stay counted)."""
        with self._lock:
            timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
