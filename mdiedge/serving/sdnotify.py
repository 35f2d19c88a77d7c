"""systemd's notify protocol with the standard library (sd_notify(3)): READY=1, WATCHDOG=1,
STOPPING=1, one datagram each to ``$NOTIFY_SOCKET`` (a path, or ``@`` an abstract name); the
watchdog interval is half of ``$WATCHDOG_USEC`` when ``$WATCHDOG_PID`` is unset or ours.

The ``Watchdog`` pings only while a ``Heartbeat`` fed by the compute loop says the node is healthy
(idle, or progress within its stall limit), so a loop stuck on one message stops the pings and
systemd restarts the node."""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator, NamedTuple, Optional, Tuple

log = logging.getLogger("mdiedge.watchdog")


def notify_address() -> Optional[str]:
    """``@name``: the abstract ``\\0name``."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return None
    return "\0" + address[1:] if address.startswith("@") else address


def notify(state: str) -> bool:
    """False when not started by systemd."""
    address = notify_address()
    if address is None:
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.sendto(state.encode(), address)
    return True


class Notifier:
    """One socket opened once and kept, so a process out of descriptors (a connection flood) still
    pings; unconnected, each send naming the address, so a socket systemd re-bound is found again.
    """

    def __init__(self) -> None:
        self.sock: Optional[socket.socket] = None
        self.lock = threading.Lock()  # the watchdog's thread and the main one share it
        try:
            self._open()
        except OSError:  # already out of descriptors: each send tries again
            pass

    def _open(self) -> socket.socket:
        if self.sock is None:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        return self.sock

    def send(self, state: str) -> bool:
        """False without ``$NOTIFY_SOCKET``; OSError when it cannot be sent."""
        address = notify_address()
        if address is None:
            return False
        with self.lock:  # unconnected: a failed send leaves it usable for the next
            self._open().sendto(state.encode(), address)
        return True

    def _close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def close(self) -> None:
        with self.lock:
            self._close()


def watchdog_interval() -> Optional[float]:
    """None when no watchdog is configured for us."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return max(0.01, int(usec) / 2e6)
    except ValueError:
        return None


def stalled_for(now: float, last_beat: float, work_started: Optional[float]) -> float:
    """0 when idle, else the time since the later of the last beat and the work's start."""
    if work_started is None:
        return 0.0
    return max(0.0, now - max(last_beat, work_started))


def is_healthy(now: float, last_beat: float, work_started: Optional[float],
               stall_limit: float) -> bool:
    """Idle, or progress (a beat, or taking the work) within ``stall_limit`` seconds."""
    return stalled_for(now, last_beat, work_started) <= stall_limit


class HeartbeatState(NamedTuple):

    last_beat: float
    work_started: Optional[float]  # when the pending count went from 0 to 1; None when idle
    pending: int
    beats: int


class Heartbeat:
    """Progress of a node's compute loop; thread-safe. Work may nest or overlap (counted); the stall
    clock runs from the later of the last beat and the moment the node went from idle to busy."""

    def __init__(self, stall_limit: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not stall_limit > 0:
            raise ValueError(f"stall_limit must be positive, not {stall_limit!r}")
        self.stall_limit = float(stall_limit)
        self._clock = clock
        self._lock = threading.Lock()
        self._last_beat = clock()
        self._work_started: Optional[float] = None
        self._pending = 0
        self._beats = 0

    def beat(self) -> None:
        """A message processed, or a step of a long one."""
        now = self._clock()
        with self._lock:
            self._last_beat = now
            self._beats += 1

    def start_work(self) -> None:
        """From now on, no progress for ``stall_limit`` seconds is a stall."""
        now = self._clock()
        with self._lock:
            if self._pending == 0:
                self._work_started = now
            self._pending += 1

    def end_work(self) -> None:
        """Finished or abandoned; counts as a beat."""
        now = self._clock()
        with self._lock:
            if self._pending == 0:
                raise RuntimeError("Heartbeat.end_work() without start_work()")
            self._pending -= 1
            if self._pending == 0:
                self._work_started = None
            self._last_beat = now
            self._beats += 1

    @contextmanager
    def busy(self) -> Iterator[None]:
        self.start_work()
        try:
            yield
        finally:
            self.end_work()

    def state(self) -> HeartbeatState:
        with self._lock:
            return HeartbeatState(self._last_beat, self._work_started, self._pending,
                                  self._beats)

    def healthy(self) -> bool:
        state = self.state()
        return is_healthy(self._clock(), state.last_beat, state.work_started, self.stall_limit)

    def reason(self) -> str:
        """For a log line."""
        state = self.state()
        stalled = stalled_for(self._clock(), state.last_beat, state.work_started)
        if state.work_started is None:
            return "compute idle"
        verdict = "stalled" if stalled > self.stall_limit else "busy"
        return (f"compute {verdict}: {state.pending} message(s) in progress, no progress for "
                f"{stalled:.1f} s (stall limit {self.stall_limit:g} s)")


def always_healthy() -> bool:
    return True


class Watchdog(threading.Thread):
    """Pings each interval while ``healthy()`` (false or raising stops them, so systemd restarts the
    service after ``WatchdogSec``); a warning once when it stops and once when it resumes."""

    def __init__(self, interval: float, stop: threading.Event,
                 healthy: Callable[[], bool] = always_healthy,
                 reason: Optional[Callable[[], str]] = None,
                 notifier: Optional[Notifier] = None) -> None:
        super().__init__(name="watchdog", daemon=True)
        self.interval, self.stop = interval, stop
        self.healthy, self.reason = healthy, reason
        self.pinging = True  # False while pings are withheld
        self.notifier = notifier or Notifier()  # one socket, opened now
        self.pings = 0

    def _check(self) -> Tuple[bool, str]:
        try:
            ok = bool(self.healthy())
        except Exception as e:  # a broken health check must not look healthy
            return False, f"health check failed: {type(e).__name__}: {e}"
        if ok:
            return True, ""
        why = "health check says unhealthy"
        if self.reason is not None:
            try:
                why = self.reason()
            except Exception as e:
                why = f"{why} (reason() failed: {type(e).__name__}: {e})"
        return False, why

    def run(self) -> None:
        """Nothing ends the thread: a failed ping is logged once per spell of failures and retried.
        """
        failing = ""
        while not self.stop.wait(self.interval):
            try:
                failing = self._tick(failing)
            except Exception as e:  # the thread must outlive anything: the next tick
                why = f"{type(e).__name__}: {e}"
                if why != failing:
                    log.warning("watchdog: cannot ping systemd (%s); trying again every "
                                "%.2f s", why, self.interval)
                failing = why

    def _tick(self, failing: str) -> str:
        """"" when the ping went out or was withheld on purpose."""
        ok, why = self._check()
        if not ok:
            if self.pinging:
                log.warning("watchdog: WATCHDOG=1 pings withheld (systemd restarts the service "
                            "if this lasts): %s", why)
                self.pinging = False
            return ""
        if not self.pinging:
            log.warning("watchdog: healthy again, WATCHDOG=1 pings resume")
            self.pinging = True
        self.notifier.send("WATCHDOG=1")
        if failing:
            log.warning("watchdog: pings reach systemd again")
        self.pings += 1
        return ""
