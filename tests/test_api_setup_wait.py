"""While the ring's set-up waits on a slow worker (its ``/assign`` held by
``MDIEDGE_TEST_PAUSE`` while its control port answers), an API request is a 503 with
``Retry-After`` within ``API_SETUP_WAIT_S`` (it blocked until the set-up ended, past 30 s on
a slow board), and ``mdiedge status`` exits non-zero (it exited 0); once the set-up is done
the server serves again."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Dict, List

import httpx
import pytest

from mdiedge.base.defaults import API_SETUP_WAIT_S
from test_ring import workers_of
from commands import MDIEDGE

PAUSE_S = 15.0  # the respawned w2 holds its /assign this long


def _worker(serve: int, name: str) -> Dict[str, Any]:
    for pid in workers_of(serve):
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if cmd[cmd.index(b"--name") + 1].decode() == name:
            return {"pid": pid, "port": int(cmd[cmd.index(b"--control-port") + 1])}
    return {}


def _timed_post(base: str, out: Dict[str, Any]) -> None:
    start = time.monotonic()
    out["reply"] = httpx.post(base + "/v1/completions", timeout=120, json={
        "prompt": "Once", "max_tokens": 8, "temperature": 0})
    out["s"] = time.monotonic() - start


def _wait_listening(port: int, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise AssertionError(f"nothing listens on {port}")


def _health_until(base: str, ok: Any, seconds: float) -> Dict[str, Any]:
    deadline, body = time.monotonic() + seconds, {}
    while time.monotonic() < deadline:
        body = httpx.get(base + "/health", timeout=10).json()
        if ok(body):
            return body
        time.sleep(0.05)
    raise AssertionError(f"/health never got there: {body}")


@pytest.mark.slow
def test_requests_get_a_prompt_503_while_set_up_waits_on_a_slow_worker(stories: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "MDIEDGE_API_KEY"}
    env["MDIEDGE_TEST_PAUSE"] = f"w2:/assign:{PAUSE_S}"
    proc = subprocess.Popen(
        [*MDIEDGE, "serve", "--port", "0", "--nodes", "3", "--slots", "2", "--context", "256",
         "--model", str(stories / "stories260K.bin"), "--tokenizer", str(stories / "tok512.model")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        base = json.loads(proc.stdout.readline())["url"].rsplit("/v1", 1)[0]
        before = _worker(proc.pid, "w2")
        os.kill(before["pid"], signal.SIGKILL)  # the ring is broken: the next request sets up
        deadline = time.monotonic() + 60
        while _worker(proc.pid, "w2").get("pid") in (None, before["pid"]):
            assert time.monotonic() < deadline, "w2 was not started again"
            time.sleep(0.05)
        _wait_listening(_worker(proc.pid, "w2")["port"])  # on its old port
        first: Dict[str, Any] = {}
        threading.Thread(target=_timed_post, args=(base, first), daemon=True).start()
        waiting = _health_until(base, lambda b: "w2's POST /assign" in b.get("error", ""), 30)
        assert waiting["status"] == "unavailable"

        second: Dict[str, Any] = {}
        _timed_post(base, second)
        status = subprocess.run([*MDIEDGE, "status", "--starter", base, "--json"], env=env,
                                capture_output=True, text=True, timeout=60)

        for reply in (first, second):
            assert reply.get("s", 99) < API_SETUP_WAIT_S + 3, reply
            assert reply["reply"].status_code == 503, reply["reply"].text
            assert reply["reply"].headers["Retry-After"] == str(int(API_SETUP_WAIT_S))
            error = reply["reply"].json()["error"]
            assert error["code"] == "setting_up" and "w2's POST /assign" in error["message"]
        assert status.returncode == 75, (status.returncode, status.stdout, status.stderr)
        starter = [n for n in json.loads(status.stdout)["nodes"] if n["role"] == "starter"][0]
        assert "w2's POST /assign" in starter["setup"]

        _health_until(base, lambda b: b.get("status") == "ok", PAUSE_S + 30)
        later: Dict[str, Any] = {}
        _timed_post(base, later)
        assert later["reply"].status_code == 200, later["reply"].text
    finally:
        proc.terminate()
        proc.wait(30)
