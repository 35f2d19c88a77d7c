"""systemd's notify protocol against a fake ``$NOTIFY_SOCKET``: notify(), watchdog_interval(),
the Watchdog thread, and a real ``mdiedge worker`` going READY=1 -> WATCHDOG=1... -> STOPPING=1."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

import pytest

from mdiedge.ops import sdnotify

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def notify_socket() -> Iterator[Tuple[socket.socket, str]]:
    """A bound AF_UNIX datagram socket in a short temporary folder (sun_path is ~108 bytes)."""
    folder = tempfile.mkdtemp(prefix="sdn-")
    path = os.path.join(folder, "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(5.0)
    try:
        yield sock, path
    finally:
        sock.close()
        shutil.rmtree(folder, ignore_errors=True)


def test_notify_without_socket_is_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sdnotify.notify("READY=1") is False


def test_notify_sends_one_datagram(notify_socket: Tuple[socket.socket, str],
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    sock, path = notify_socket
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    assert sdnotify.notify("READY=1\nSTATUS=listening") is True
    assert sdnotify.notify("WATCHDOG=1") is True
    assert sock.recv(4096) == b"READY=1\nSTATUS=listening"
    assert sock.recv(4096) == b"WATCHDOG=1"


def test_notify_abstract_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"mdiedge-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5.0)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert sdnotify.notify("STOPPING=1") is True
        assert sock.recv(4096) == b"STOPPING=1"


def test_notify_to_a_missing_socket_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", "@mdiedge-test-nobody-" + uuid.uuid4().hex)
    with pytest.raises(OSError):
        sdnotify.notify("READY=1")


@pytest.mark.parametrize("usec, pid, expected", [
    (None, None, None),                # no watchdog configured
    ("400000", None, 0.2),             # half of WATCHDOG_USEC
    ("400000", "self", 0.2),           # meant for us
    ("400000", "other", None),         # meant for another process (e.g. our parent)
    ("30000000", None, 15.0),
    ("1", None, 0.01),                 # clamped
    ("soon", None, None),              # malformed
    ("", None, None),
])
def test_watchdog_interval(monkeypatch: pytest.MonkeyPatch, usec: Optional[str],
                           pid: Optional[str], expected: Optional[float]) -> None:
    for key, value in (("WATCHDOG_USEC", usec), ("WATCHDOG_PID", pid)):
        if value is None:
            monkeypatch.delenv(key, raising=False)
        else:
            value = {"self": str(os.getpid()), "other": str(os.getpid() + 1)}.get(value, value)
            monkeypatch.setenv(key, value)
    assert sdnotify.watchdog_interval() == expected


def test_watchdog_thread_pings_until_stopped(notify_socket: Tuple[socket.socket, str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    sock, path = notify_socket
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    stop = threading.Event()
    dog = sdnotify.Watchdog(0.02, stop)
    dog.start()
    assert [sock.recv(64) for _ in range(3)] == [b"WATCHDOG=1"] * 3
    stop.set()
    dog.join(5.0)
    assert not dog.is_alive()


def _receive(sock: socket.socket, deadline: float) -> bytes:
    sock.settimeout(max(0.01, deadline - time.monotonic()))
    return sock.recv(4096)


@pytest.mark.slow
def test_worker_under_a_fake_systemd(notify_socket: Tuple[socket.socket, str],
                                     tmp_path: Path) -> None:
    sock, path = notify_socket
    env = dict(os.environ, NOTIFY_SOCKET=path, WATCHDOG_USEC="400000", OMP_NUM_THREADS="1")
    env.pop("WATCHDOG_PID", None)
    command = [sys.executable, "-m", "mdiedge", "worker", "--host", "127.0.0.1",
               "--control-port", "0", "--data-port", "0", "--log-level", "warning"]
    stderr = (tmp_path / "stderr").open("w+")
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=stderr,
                            text=True)
    try:
        try:
            first = _receive(sock, time.monotonic() + 120).decode()
        except socket.timeout:
            stderr.seek(0)
            pytest.fail(f"no READY=1 within 120 s; exit code {proc.poll()}; {stderr.read()}")
        assert first.split("\n")[0] == "READY=1", first
        assert f"MAINPID={proc.pid}" in first.split("\n")
        # the ready line is printed before READY=1 is sent: the port listens already
        assert proc.stdout is not None
        ready = json.loads(proc.stdout.readline())
        assert ready["event"] == "ready" and ready["pid"] == proc.pid
        with socket.create_connection(("127.0.0.1", ready["control_port"]), timeout=5.0):
            pass

        pings: List[bytes] = []
        deadline = time.monotonic() + 1.5
        while len(pings) < 3 and time.monotonic() < deadline:
            try:
                pings.append(_receive(sock, deadline))
            except socket.timeout:
                break
        assert pings == [b"WATCHDOG=1"] * 3, pings

        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        message = b"WATCHDOG=1"
        while message == b"WATCHDOG=1":  # pings may still be in flight
            message = _receive(sock, deadline)
        assert message == b"STOPPING=1"
        assert proc.wait(max(0.1, deadline - time.monotonic())) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()
        stderr.close()
