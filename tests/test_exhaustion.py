"""Nothing exhausts the process: a flood of idle connections on the API port of a real starter
under ``RLIMIT_NOFILE`` 1024 (systemd's default ``LimitNOFILE``) leaves its systemd watchdog
pinging a fake ``$NOTIFY_SOCKET`` and its control port answering, with a few log lines; the
watchdog pings on while the process has no descriptor left; a control port out of descriptors
backs off quietly and serves again once they come back; a flood of refused requests is a
summary in the log, not a line each."""
from __future__ import annotations

import json
import logging
import os
import re
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator, List, Tuple

import pytest

from mdiedge.base.ratelog import Throttled
from mdiedge.runtime.auth import Authenticator
from mdiedge.runtime.control import ControlServer
from commands import MDIEDGE

REPO = Path(__file__).resolve().parent.parent
STORIES = REPO / "tests" / "data" / "stories260k"
FLOOD = 1100
NOFILE = 1024


@pytest.fixture
def notify_socket() -> Iterator[Tuple[socket.socket, str]]:
    folder = tempfile.mkdtemp(prefix="sdx-")
    path = os.path.join(folder, "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    try:
        yield sock, path
    finally:
        sock.close()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def many_descriptors() -> Iterator[None]:
    """This process may open the flood's sockets (its soft limit raised for the test)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = FLOOD + 256
    if hard != resource.RLIM_INFINITY and hard < need:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < {need}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, need), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _limit_nofile() -> None:  # the child's, as systemd's default LimitNOFILE
    resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE))


def _pings(sock: socket.socket, seconds: float) -> int:
    """WATCHDOG=1 datagrams received within ``seconds``."""
    count, deadline = 0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            count += sock.recv(64) == b"WATCHDOG=1"
        except socket.timeout:
            break
    return count


def _drain(sock: socket.socket) -> None:
    sock.setblocking(False)
    try:
        while True:
            sock.recv(64)
    except BlockingIOError:
        pass
    sock.setblocking(True)


def _get(port: int, path: str) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        sock.settimeout(10)
        reply = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                return reply
            reply += chunk


@pytest.mark.slow
def test_a_starter_flooded_on_its_api_port_keeps_its_watchdog_and_control_port(
        notify_socket: Tuple[socket.socket, str], many_descriptors: None,
        tmp_path: Path) -> None:
    sock, path = notify_socket
    ring = tmp_path / "ring.toml"
    ring.write_text('[[workers]]\nname = "w1"\nhost = "127.0.0.1"\ncontrol_port = 1\n')
    env = dict(os.environ, NOTIFY_SOCKET=path, WATCHDOG_USEC="200000", OMP_NUM_THREADS="1")
    env.pop("WATCHDOG_PID", None)
    env.pop("MDIEDGE_API_KEY", None)
    log = (tmp_path / "stderr").open("w+")
    proc = subprocess.Popen(
        [*MDIEDGE, "starter", "--config", str(ring), "--control-port",
         "0", "--api-port", "0", "--log-level", "info", "--model",
         str(STORIES / "stories260K.bin"), "--tokenizer", str(STORIES / "tok512.model")],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=log, text=True,
        preexec_fn=_limit_nofile)
    flood: List[socket.socket] = []
    try:
        assert proc.stdout is not None
        ready = json.loads(proc.stdout.readline())
        api = int(ready["api_url"].rsplit(":", 1)[1].split("/")[0])
        assert _pings(sock, 1.0) >= 3
        log_before = os.path.getsize(log.name)
        for _ in range(FLOOD):
            flood.append(socket.create_connection(("127.0.0.1", api), timeout=10))
        time.sleep(1.0)
        _drain(sock)
        assert _pings(sock, 2.0) >= 6, "the watchdog stopped pinging during the flood"
        assert b'"pong": true' in _get(ready["control_port"], "/ping")
        assert _get(api, "/health").startswith(b"HTTP/1.1 503")  # the API answers (no worker)
        open_fds = len(os.listdir(f"/proc/{proc.pid}/fd"))
        assert open_fds < NOFILE - 128, open_fds
        for conn in flood:
            conn.close()
        flood.clear()
        _drain(sock)
        assert _pings(sock, 1.0) >= 3, "the watchdog stopped pinging after the flood"
        assert b'"pong": true' in _get(ready["control_port"], "/ping")
        grown = os.path.getsize(log.name) - log_before
        log.seek(0)
        text = log.read()
        assert grown < 4096 and "Traceback" not in text, text[-3000:]
    finally:
        for conn in flood:
            conn.close()
        proc.terminate()
        proc.wait(30)
        if proc.stdout is not None:
            proc.stdout.close()
        log.close()


_WATCHDOG_OUT_OF_FDS = """
import os, resource, socket, sys, threading, time
from mdiedge.serving.sdnotify import Watchdog
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
stop = threading.Event()
dog = Watchdog(0.05, stop)
dog.start()
held = []
try:
    while True:
        held.append(socket.socket())
except OSError as e:
    print("exhausted", e.errno, len(held), flush=True)
time.sleep(1.0)
print("alive", dog.is_alive(), "pings", dog.pings, flush=True)
"""


def test_the_watchdog_pings_while_the_process_has_no_descriptor_left(
        notify_socket: Tuple[socket.socket, str]) -> None:
    sock, path = notify_socket
    env = dict(os.environ, NOTIFY_SOCKET=path)
    out = subprocess.run([sys.executable, "-c", _WATCHDOG_OUT_OF_FDS], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "exhausted 24" in out.stdout, out.stdout
    assert "alive True" in out.stdout and "Traceback" not in out.stderr, out.stdout + out.stderr
    assert _pings(sock, 0.5) >= 10  # ~20 a second, every one after the table was full


_CONTROL_OUT_OF_FDS = """
import logging, resource, socket, sys, time, urllib.request
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(message)s")
from mdiedge.runtime.control import ControlServer
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
server = ControlServer("127.0.0.1", 0, {})
port = server.port
# connections waiting in the backlog, then a full descriptor table: accept() cannot take them
held = [socket.create_connection(("127.0.0.1", port)) for _ in range(5)]
try:
    while True:
        held.append(socket.socket())
except OSError:
    pass
server.start()
cpu = time.process_time()
time.sleep(3.0)
print("cpu", round(time.process_time() - cpu, 3), flush=True)
for s in held:
    s.close()
with urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=10) as r:
    print("ping", r.read().decode(), flush=True)
"""


def test_a_control_port_out_of_descriptors_backs_off_quietly_and_serves_again() -> None:
    out = subprocess.run([sys.executable, "-c", _CONTROL_OUT_OF_FDS], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert '"pong": true' in out.stdout, out.stdout
    cpu = float(out.stdout.split("cpu ")[1].split()[0])
    assert cpu < 0.5, f"the accept loop spun: {cpu} s of CPU in 3 s"
    lines = out.stderr.strip().splitlines()
    assert len(lines) <= 3 and "Traceback" not in out.stderr, out.stderr


def test_a_flood_of_refused_control_requests_is_summarised_in_the_log(
        caplog: pytest.LogCaptureFixture) -> None:
    server = ControlServer("127.0.0.1", 0, {("GET", "/status"): lambda b, r, q: {}},
                           auth=Authenticator(b"flood-secret-0123456789abcdef")).start()
    try:
        started = time.monotonic()
        with caplog.at_level(logging.INFO, logger="mdiedge.control"):
            for _ in range(300):
                reply = _get(server.port, "/status")
                assert reply.startswith(b"HTTP/1.1 401"), reply[:80]
            server.refusals.flush()
        seconds = time.monotonic() - started
    finally:
        server.stop()
    lines = [r.getMessage() for r in caplog.records if r.name == "mdiedge.control"]
    assert lines[0].startswith("refused GET /status from 127.0.0.1 (401)"), lines
    summaries = [re.fullmatch(r"control port: refused requests: (\d+) more in the last 10 s "
                              r"\(latest: refused GET /status .*\)", line) for line in lines[1:]]
    assert all(summaries) and 1 + sum(int(m.group(1)) for m in summaries) == 300, lines
    assert len(lines) <= 2 + int(seconds // 10), lines  # one summary per 10 s at most


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_throttled_logs_the_first_then_one_summary_per_interval(
        caplog: pytest.LogCaptureFixture) -> None:
    clock = _Clock()
    throttled = Throttled(logging.getLogger("test.throttled"), logging.WARNING, "refusals",
                          interval=10.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="test.throttled"):
        for i in range(1000):  # 100 a second for 10 s
            throttled("refused %d", i)
            clock.now += 0.01
        throttled.flush()  # the timer's work, now
        clock.now += 30.0  # a quiet spell: the next is logged as it comes
        throttled("refused %d", 1000)
    throttled.cancel()
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["refused 0", "refusals: 999 more in the last 10 s (latest: refused 999)",
                     "refused 1000"], lines


def test_the_watchdog_outlives_a_lost_notify_socket_and_finds_it_again(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """systemd re-executed (its socket re-bound): the pings that fail meanwhile are one
    warning, the thread lives on, and the pings reach the new socket."""
    import threading

    from mdiedge.serving.sdnotify import Watchdog

    folder = tempfile.mkdtemp(prefix="sdx-")
    path = os.path.join(folder, "notify")
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    first = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    first.bind(path)
    stop = threading.Event()
    with caplog.at_level(logging.WARNING, logger="mdiedge.watchdog"):
        dog = Watchdog(0.02, stop)
        dog.start()
        try:
            assert _pings(first, 0.3) >= 3
            first.close()
            os.unlink(path)
            time.sleep(0.5)  # ~25 pings that cannot be sent
            assert dog.is_alive()
            second = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            second.bind(path)
            try:
                assert _pings(second, 0.5) >= 5
            finally:
                second.close()
        finally:
            stop.set()
            dog.join(5)
            shutil.rmtree(folder, ignore_errors=True)
    warnings = [r.getMessage() for r in caplog.records if r.name == "mdiedge.watchdog"]
    assert len(warnings) == 2, warnings
    assert warnings[0].startswith("watchdog: cannot ping systemd (FileNotFoundError"), warnings
    assert warnings[1] == "watchdog: pings reach systemd again", warnings
