"""A client that disconnects before its reply leaves one debug line in the node's log, no
traceback (the control plane of every worker and starter)."""
from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from typing import Any, Dict

import pytest

from mdiedge.runtime.control import ControlServer


@pytest.mark.parametrize("reset", [False, True], ids=["close", "reset"])
def test_client_gone_before_the_reply_is_no_traceback(reset: bool, caplog: pytest.LogCaptureFixture,
                                                      capfd: pytest.CaptureFixture) -> None:
    gone = threading.Event()
    done = threading.Event()

    def slow(body: Dict[str, Any], raw: bytes, query: Dict[str, str]) -> Dict[str, Any]:
        gone.wait(10)
        time.sleep(0.2)  # the peer's FIN (or RST) is in before the reply goes out
        done.set()
        return {"text": "x" * (4 << 20)}  # more than socket buffers hold: the write fails

    server = ControlServer("127.0.0.1", 0, {("GET", "/slow"): slow}).start()
    caplog.set_level(logging.DEBUG)
    try:
        client = socket.create_connection(("127.0.0.1", server.port))
        if reset:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        client.sendall(b"GET /slow HTTP/1.1\r\nHost: node\r\n\r\n")
        client.close()
        gone.set()
        assert done.wait(10)
        deadline = time.monotonic() + 10
        while "left before the reply" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        server.stop()
    assert "left before the reply to GET /slow" in caplog.text
    line = next(r for r in caplog.records if "left before the reply" in r.getMessage())
    assert line.levelno == logging.DEBUG and line.name == "mdiedge.control"
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.WARNING]
    assert "Traceback" not in caplog.text
    assert "Traceback" not in capfd.readouterr().err
