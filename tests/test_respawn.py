"""``mdiedge serve --nodes 3`` starts its workers as its own child processes: when they all
die it starts them again on their control ports (with a bounded backoff) and serves again,
instead of answering 503 until it is restarted. The backoff rule is a pure function, tested
as a table."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Optional

import httpx
import pytest

from mdiedge.base.defaults import RESPAWN_FIRST_S, RESPAWN_MAX_S, RESPAWN_STABLE_S
from mdiedge.roles.local_ring import RESPAWN_TRIES, restart_pause
from test_ring import workers_of
from commands import MDIEDGE

BACK_WITHIN_S = 30.0


@pytest.mark.parametrize("tries, lived_s, want", [
    (0, 0.5, (0, RESPAWN_FIRST_S)),                     # the first death: the first pause
    (1, 0.5, (1, 2 * RESPAWN_FIRST_S)),                 # died again at once: twice as long
    (3, 5.0, (3, 8 * RESPAWN_FIRST_S)),
    (4, 0.5, (4, min(RESPAWN_MAX_S, 16 * RESPAWN_FIRST_S))),
    (RESPAWN_TRIES, 0.5, (RESPAWN_TRIES, None)),        # given up
    (RESPAWN_TRIES, RESPAWN_STABLE_S, (0, RESPAWN_FIRST_S)),  # it had lived: counted anew
    (2, RESPAWN_STABLE_S + 1, (0, RESPAWN_FIRST_S)),
])
def test_restart_pause(tries: int, lived_s: float, want: tuple) -> None:
    assert restart_pause(tries, lived_s) == want


def test_restart_pauses_are_bounded() -> None:
    pauses = [restart_pause(t, 0.0)[1] for t in range(RESPAWN_TRIES)]
    assert all(p is not None and 0 < p <= RESPAWN_MAX_S for p in pauses)
    assert sum(p for p in pauses if p is not None) < 2 * 60  # gives up within two minutes


def completion(base: str) -> Optional[str]:
    reply = httpx.post(base + "/v1/completions", timeout=60, json={
        "model": "stories260K", "prompt": "Once", "max_tokens": 16, "temperature": 0})
    return reply.json()["choices"][0]["text"] if reply.status_code == 200 else None


def test_serve_starts_its_dead_workers_again_and_serves(stories: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "MDIEDGE_API_KEY"}
    proc = subprocess.Popen(
        [*MDIEDGE, "serve", "--port", "0", "--nodes", "3", "--slots", "2",
         "--context", "256", "--stall-timeout", "2", "--model", str(stories / "stories260K.bin"),
         "--tokenizer", str(stories / "tok512.model")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        base = json.loads(proc.stdout.readline())["url"].rsplit("/v1", 1)[0]
        want = completion(base)
        assert want
        first = workers_of(proc.pid)
        assert len(first) == 2
        for pid in first:
            os.kill(pid, signal.SIGKILL)
        assert completion(base) is None  # the ring is gone: 503
        deadline = time.monotonic() + BACK_WITHIN_S
        while time.monotonic() < deadline and \
                httpx.get(base + "/health", timeout=10).status_code != 200:
            time.sleep(0.3)
        assert httpx.get(base + "/health", timeout=10).json() == {"status": "ok"}
        assert completion(base) == want
        again = workers_of(proc.pid)
        assert len(again) == 2 and not set(again) & set(first)
    finally:
        proc.terminate()
        proc.wait(20)
        err = proc.stderr.read() if proc.stderr else ""
    assert "started again on control port" in err, err[-2000:]
