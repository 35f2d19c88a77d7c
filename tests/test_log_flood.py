"""What a peer that holds no key can make a server write to its log is rate-limited: a flood
of garbage bytes on a real ``serve``'s API port is its first line and one summary per
``LOG_SUMMARY_S`` (uvicorn wrote "Invalid HTTP request received." once per request: 151 KB
for 14,695 of them), and requests to a control port whose body never comes are summarised."""
from __future__ import annotations

import json
import logging
import os
import re
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import List

import pytest

from mdiedge.base.defaults import LOG_SUMMARY_S
from mdiedge.runtime.control import ControlServer
from commands import MDIEDGE

FLOOD = 600
GARBAGE = b"\x16\x03\x01\x02\x00garbage \xff\xfe\r\n\r\n"


def _send(port: int, data: bytes) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(10)
        while sock.recv(65536):
            pass


def _collect(stream: object, into: List[str]) -> None:
    for line in iter(stream.readline, ""):  # type: ignore[attr-defined]
        into.append(line)


@pytest.mark.slow
def test_a_flood_of_garbage_on_the_api_port_is_a_line_and_a_summary(stories: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "MDIEDGE_API_KEY"}
    proc = subprocess.Popen(
        [*MDIEDGE, "serve", "--port", "0", "--nodes", "1", "--slots", "1", "--context", "128",
         "--model", str(stories / "stories260K.bin"), "--tokenizer", str(stories / "tok512.model")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines: List[str] = []
    try:
        assert proc.stdout is not None
        port = int(json.loads(proc.stdout.readline())["url"].rsplit(":", 1)[1].split("/")[0])
        threading.Thread(target=_collect, args=(proc.stderr, lines), daemon=True).start()
        time.sleep(0.5)
        before = len(lines)
        started = time.monotonic()
        for _ in range(FLOOD):
            _send(port, GARBAGE)
        seconds = time.monotonic() - started
        time.sleep(LOG_SUMMARY_S + 1.5)  # the summary of the flood's last spell is due
        _send(port, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    finally:
        proc.terminate()
        proc.wait(30)
    flood = lines[before:]
    size = sum(len(line) for line in flood)
    assert len(flood) <= 2 + int(seconds // LOG_SUMMARY_S) and size < 1000, "".join(flood)
    assert "Invalid HTTP request received." in flood[0], flood
    counts = [re.search(r"API port: refused requests: (\d+) more in the last 10 s \(latest: "
                        r"Invalid HTTP request received\.\)", line) for line in flood[1:]]
    assert all(counts) and 1 + sum(int(m.group(1)) for m in counts) == FLOOD, flood


def test_requests_whose_body_never_comes_are_summarised(caplog: pytest.LogCaptureFixture
                                                        ) -> None:
    """Headers promising a body, then the end of the stream, on a control port without a
    secret (a loopback ring with none: every peer is unauthenticated there), logged at info
    once per spell."""
    server = ControlServer("127.0.0.1", 0, {("POST", "/assign"): lambda b, r, q: {}}).start()
    try:
        with caplog.at_level(logging.INFO, logger="mdiedge.control"):
            for _ in range(200):
                _send(server.port, b"POST /assign HTTP/1.1\r\nHost: x\r\n"
                                   b"Content-Length: 100\r\n\r\nshort")
            deadline = time.monotonic() + 10
            while server.dropped.total < 200 and time.monotonic() < deadline:
                time.sleep(0.05)
            server.dropped.flush()
    finally:
        server.stop()
    lines = [r.getMessage() for r in caplog.records if r.name == "mdiedge.control"]
    assert lines[0].startswith("127.0.0.1 dropped: body of POST /assign not received"), lines
    summary = re.fullmatch(r"control port: requests whose body never came: (\d+) more in the "
                           r"last 10 s \(latest: 127\.0\.0\.1 dropped: .*\)", lines[1])
    assert len(lines) == 2 and summary and int(summary.group(1)) == 199, lines
