"""systemd's notify protocol with the standard library: READY=1, WATCHDOG=1, STOPPING=1.

One datagram to ``$NOTIFY_SOCKET`` (a path, or an abstract name starting with ``@``); the
watchdog interval is half of ``$WATCHDOG_USEC`` when ``$WATCHDOG_PID`` is unset or ours.
See sd_notify(3).
"""
from __future__ import annotations

import os
import socket
import threading
from typing import Optional


def notify(state: str) -> bool:
    """Send one notification; False when not started by systemd (no ``$NOTIFY_SOCKET``)."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.connect(address)
        sock.sendall(state.encode())
    return True


def watchdog_interval() -> Optional[float]:
    """Seconds between WATCHDOG=1 pings, or None when no watchdog is configured for us."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return max(0.01, int(usec) / 2e6)
    except ValueError:
        return None


class Watchdog(threading.Thread):
    """Pings WATCHDOG=1 at the configured interval while ``healthy()`` says so."""

    def __init__(self, interval: float, stop: threading.Event) -> None:
        super().__init__(name="watchdog", daemon=True)
        self.interval, self.stop = interval, stop

    def run(self) -> None:
        while not self.stop.wait(self.interval):
            notify("WATCHDOG=1")
