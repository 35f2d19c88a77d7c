"""systemd's notify protocol against a fake ``$NOTIFY_SOCKET``: notify(), watchdog_interval(),
the Watchdog thread, and a real ``mdiedge worker`` going READY=1 -> WATCHDOG=1... -> STOPPING=1."""
from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator, List, Optional, Tuple

import pytest

from mdiedge.serving import sdnotify
from commands import MDIEDGE

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


# -- health: the pure decision, the Heartbeat, and a Watchdog that pings only while healthy

@pytest.mark.parametrize("now, last_beat, work_started, limit, stalled, healthy", [
    (100.0, 0.0, None, 1.0, 0.0, True),      # idle for long: healthy
    (100.0, 99.5, None, 1.0, 0.0, True),     # idle, recent beat
    (100.0, 99.5, 99.0, 1.0, 0.5, True),     # busy, beat 0.5 s ago
    (100.0, 0.0, 99.5, 1.0, 0.5, True),      # just took work after a long idle spell
    (100.0, 99.0, 98.0, 1.0, 1.0, True),     # exactly at the limit
    (100.0, 98.0, 99.0, 1.0, 1.0, True),     # the work's start counts as progress
    (100.0, 98.5, 98.0, 1.0, 1.5, False),    # work taken, no beat for 1.5 s: stalled
    (100.0, 50.0, 60.0, 30.0, 40.0, False),  # stalled since the work was taken
    (100.0, 101.0, 99.0, 1.0, 0.0, True),    # a beat "after" now (clock read race): not negative
])
def test_health_decision(now: float, last_beat: float, work_started: Optional[float],
                         limit: float, stalled: float, healthy: bool) -> None:
    assert sdnotify.stalled_for(now, last_beat, work_started) == pytest.approx(stalled)
    assert sdnotify.is_healthy(now, last_beat, work_started, limit) is healthy


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_heartbeat_tracks_work_and_progress() -> None:
    clock = FakeClock()
    beat = sdnotify.Heartbeat(stall_limit=2.0, clock=clock)
    clock.now = 100.0
    assert beat.healthy() and beat.reason() == "compute idle"  # idle, however long
    beat.start_work()
    assert beat.state() == sdnotify.HeartbeatState(0.0, 100.0, 1, 0)
    clock.now = 101.5
    beat.beat()
    clock.now = 103.5
    assert beat.healthy()  # 2.0 s since the beat: at the limit
    clock.now = 103.6
    assert not beat.healthy()
    assert "stalled" in beat.reason() and "stall limit 2 s" in beat.reason()
    beat.start_work()  # overlapping work does not reset the stall clock
    assert not beat.healthy() and beat.state().pending == 2
    beat.end_work()  # finishing one is progress
    assert beat.healthy() and beat.state().pending == 1
    beat.end_work()
    clock.now = 1000.0
    assert beat.healthy() and beat.state() == sdnotify.HeartbeatState(103.6, None, 0, 3)
    with pytest.raises(RuntimeError):
        beat.end_work()
    with pytest.raises(ValueError):
        sdnotify.Heartbeat(stall_limit=0)


def test_heartbeat_busy_ends_work_on_error() -> None:
    clock = FakeClock()
    beat = sdnotify.Heartbeat(stall_limit=1.0, clock=clock)
    with beat.busy():
        assert beat.state().work_started == 0.0
    with pytest.raises(KeyError):
        with beat.busy():
            raise KeyError("bad message")
    clock.now = 10.0
    assert beat.state().pending == 0 and beat.healthy()


def test_heartbeat_from_many_threads() -> None:
    beat = sdnotify.Heartbeat(stall_limit=60.0)

    def compute() -> None:
        for _ in range(500):
            with beat.busy():
                beat.beat()

    threads = [threading.Thread(target=compute) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    state = beat.state()
    assert state.pending == 0 and state.work_started is None and state.beats == 4 * 500 * 2


INTERVAL = 0.02


def _wait_for(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(INTERVAL / 4)


def _drain(sock: socket.socket) -> List[bytes]:
    sock.setblocking(False)
    got = []
    try:
        while True:
            got.append(sock.recv(64))
    except BlockingIOError:
        return got
    finally:
        sock.setblocking(True)


def _silent(sock: socket.socket, seconds: float) -> bool:
    sock.settimeout(seconds)
    try:
        sock.recv(64)
    except socket.timeout:
        return True
    finally:
        sock.settimeout(5.0)
    return False


@pytest.fixture
def watched(notify_socket: Tuple[socket.socket, str], monkeypatch: pytest.MonkeyPatch
            ) -> Iterator[Callable[..., sdnotify.Watchdog]]:
    """Starts Watchdogs that ping the fake socket every INTERVAL; stops them afterwards."""
    monkeypatch.setenv("NOTIFY_SOCKET", notify_socket[1])
    stop, dogs = threading.Event(), []

    def start(*args: Any) -> sdnotify.Watchdog:
        dog = sdnotify.Watchdog(INTERVAL, stop, *args)
        dog.start()
        dogs.append(dog)
        return dog

    yield start
    stop.set()
    for dog in dogs:
        dog.join(5.0)
        assert not dog.is_alive()


def test_watchdog_withholds_pings_while_compute_is_stalled(
        notify_socket: Tuple[socket.socket, str], watched: Callable[..., sdnotify.Watchdog],
        caplog: pytest.LogCaptureFixture) -> None:
    sock = notify_socket[0]
    clock = FakeClock()
    beat = sdnotify.Heartbeat(stall_limit=1.0, clock=clock)
    beat.start_work()  # a message taken
    dog = watched(beat.healthy, beat.reason)
    assert [sock.recv(64) for _ in range(3)] == [b"WATCHDOG=1"] * 3  # within the limit
    with caplog.at_level(logging.WARNING, logger="mdiedge.watchdog"):
        clock.now = 1.5  # no beat for longer than the stall limit
        _wait_for(lambda: not dog.pinging)
        _drain(sock)  # a ping decided just before the stall may still arrive
        assert _silent(sock, 10 * INTERVAL)
        beat.beat()  # progress: pings resume
        assert sock.recv(64) == b"WATCHDOG=1"
        assert dog.pinging
        clock.now = 3.0  # stalled again, then the message is done: idle is healthy
        _wait_for(lambda: not dog.pinging)
        beat.end_work()
        _drain(sock)
        assert [sock.recv(64) for _ in range(3)] == [b"WATCHDOG=1"] * 3
    records = [r for r in caplog.records if r.name == "mdiedge.watchdog"]
    warnings = [r.getMessage() for r in records]
    assert len(warnings) == 4, warnings  # withheld, resumed, withheld, resumed: once each
    assert all(r.levelno == logging.WARNING for r in records)
    assert "withheld" in warnings[0] and "no progress for 1.5 s (stall limit 1 s)" in warnings[0]
    assert "resume" in warnings[1]


def test_watchdog_with_a_real_clock(notify_socket: Tuple[socket.socket, str],
                                    watched: Callable[..., sdnotify.Watchdog]) -> None:
    sock = notify_socket[0]
    beat = sdnotify.Heartbeat(stall_limit=3 * INTERVAL)
    dog = watched(beat.healthy, beat.reason)
    started = time.monotonic()
    assert [sock.recv(64) for _ in range(8)] == [b"WATCHDOG=1"] * 8  # idle keeps pinging ...
    assert time.monotonic() - started > beat.stall_limit  # ... for longer than the limit
    beat.start_work()  # ... and never beats: stuck on one message
    _wait_for(lambda: not dog.pinging)
    _drain(sock)
    assert _silent(sock, 10 * INTERVAL)
    beat.end_work()
    assert sock.recv(64) == b"WATCHDOG=1"


def test_watchdog_treats_a_failing_health_check_as_unhealthy(
        notify_socket: Tuple[socket.socket, str], watched: Callable[..., sdnotify.Watchdog],
        caplog: pytest.LogCaptureFixture) -> None:
    sock = notify_socket[0]
    state = {"fail": True}

    def healthy() -> bool:
        if state["fail"]:
            raise OSError("no such file")
        return True

    with caplog.at_level(logging.WARNING, logger="mdiedge.watchdog"):
        dog = watched(healthy)
        _wait_for(lambda: not dog.pinging)
        assert _silent(sock, 5 * INTERVAL)
        state["fail"] = False
        assert sock.recv(64) == b"WATCHDOG=1"
    warnings = [r.getMessage() for r in caplog.records if r.name == "mdiedge.watchdog"]
    assert "health check failed: OSError: no such file" in warnings[0], warnings


def _receive(sock: socket.socket, deadline: float) -> bytes:
    sock.settimeout(max(0.01, deadline - time.monotonic()))
    return sock.recv(4096)


@pytest.mark.slow
def test_worker_under_a_fake_systemd(notify_socket: Tuple[socket.socket, str],
                                     tmp_path: Path) -> None:
    sock, path = notify_socket
    env = dict(os.environ, NOTIFY_SOCKET=path, WATCHDOG_USEC="400000", OMP_NUM_THREADS="1")
    env.pop("WATCHDOG_PID", None)
    command = [*MDIEDGE, "worker", "--host", "127.0.0.1",
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
