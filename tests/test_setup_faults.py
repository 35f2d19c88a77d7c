"""Set-up is part of recovery: a worker frozen (SIGSTOP) or killed (SIGKILL) while the ring is
being set up (inside its ``/assign``, inside its ``/connect``) is named within the stall time
and the ring is set up without it, as a loss while decoding is handled; the generation gives
the undisturbed text. A worker that is slow but answers is waited for, and ``/health`` says
what the set-up waits for. Real worker processes on loopback; the worker's test-only pause
(``MDIEDGE_TEST_PAUSE``) holds it at a known step while the test strikes."""
from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor, TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any, Dict, List

import pytest

from mdiedge.engine.local import LocalEngine
from mdiedge.roles.local_ring import LocalRing
from mdiedge.roles.worker import TEST_PAUSE_ENV
from test_recovery import GREEDY, PROMPT, STALL_S, ring_engine

HOLD_S = 30.0  # the pause a struck worker is held in (far past the stall time)
DETECT_MARGIN_S = 1.5  # as test_recovery's frozen-worker case: half the stall waiting, half asking


@pytest.fixture(scope="module")
def reference(ring_model: Path) -> LocalEngine:
    return LocalEngine(ring_model)


def pid_of(local: LocalRing, name: str) -> int:
    return local.processes[[w.name for w in local.workers].index(name)].pid


def strike_when_waiting(engine: Any, step: str, pid: int, sig: int,
                        seen: Dict[str, Any]) -> threading.Thread:
    """A thread that sends ``sig`` to ``pid`` once the starter's set-up has waited 0.5 s for
    ``step``, then notes in ``seen`` how long the starter took to count the worker lost."""
    def run() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            waiting = engine.starter.watch.waiting() or ""
            if step in waiting:
                break
            time.sleep(0.02)
        else:
            return
        time.sleep(0.5)
        seen["health"] = engine.unavailable(1.0)
        os.kill(pid, sig)
        struck = time.monotonic()
        while time.monotonic() < struck + 60:
            if "w2" in engine.starter.membership.lost:
                seen["detect_s"] = time.monotonic() - struck
                return
            time.sleep(0.02)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def generate_within(engine: Any, seconds: float) -> Any:
    pool = ThreadPoolExecutor(1)
    future = pool.submit(engine.generate, PROMPT, 40, 2, GREEDY)
    try:
        return future.result(timeout=seconds)
    except FutureTimeout:
        pytest.fail(f"the generation did not complete within {seconds:.0f} s")
    finally:
        pool.shutdown(wait=False)


@pytest.mark.parametrize("step, sig, spares, ring", [
    ("w2's POST /assign", signal.SIGSTOP, 0, ["w1", "w3"]),
    ("w2's POST /assign", signal.SIGKILL, 0, ["w1", "w3"]),
    ("w2's POST /connect", signal.SIGSTOP, 0, ["w1", "w3"]),
    ("the ring's links", signal.SIGSTOP, 0, ["w1", "w3"]),  # after its /connect answered
    ("w2's POST /assign", signal.SIGSTOP, 1, ["w1", "spare1", "w3"]),  # the spare steps in
], ids=["frozen-in-assign", "killed-in-assign", "frozen-in-connect", "frozen-linking",
        "frozen-with-a-spare"])
def test_a_worker_lost_during_set_up_is_named_and_left_out(
        reference: LocalEngine, ring_model: Path, monkeypatch: Any, step: str,
        sig: int, spares: int, ring: List[str]) -> None:
    want = [s["token_ids"] for s in reference.generate(PROMPT, 40, 2, GREEDY).samples]
    point = step.rsplit(" ", 1)[1]  # /assign, /connect, links
    monkeypatch.setenv(TEST_PAUSE_ENV, f"w2:{point}:{HOLD_S}")
    local = LocalRing(3, spares=spares)
    seen: Dict[str, Any] = {}
    with local as workers:
        engine = ring_engine(local, workers, ring_model)
        pid = pid_of(local, "w2")
        striker = strike_when_waiting(engine, step, pid, sig, seen)
        try:
            out = generate_within(engine, 60)
            striker.join(10)
            assert [w.name for w in engine.starter.ring_workers] == ring
            assert engine.starter.recoveries == 1
            assert "does not answer" in engine.starter.membership.lost["w2"] or \
                sig == signal.SIGKILL
        finally:
            if sig == signal.SIGSTOP:
                os.kill(pid, signal.SIGCONT)
            engine.close()
    assert [s["token_ids"] for s in out.samples] == want
    assert seen["detect_s"] < STALL_S + DETECT_MARGIN_S, seen
    assert seen["health"].startswith(f"setting up the ring: waiting for {step}"), seen


def test_a_slow_load_that_answers_is_waited_for(reference: LocalEngine, ring_model: Path,
                                                monkeypatch: Any) -> None:
    """A worker whose /assign takes three stall times, answering its status all along, is
    not lost; meanwhile the starter's status and /health say what the set-up waits for."""
    want = [s["token_ids"] for s in reference.generate(PROMPT, 40, 2, GREEDY).samples]
    monkeypatch.setenv(TEST_PAUSE_ENV, f"w2:/assign:{3 * STALL_S}")
    local = LocalRing(3)
    seen: List[Any] = []
    with local as workers:
        engine = ring_engine(local, workers, ring_model)

        def look() -> None:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not seen:
                status = engine.starter.status()
                if status.setup and "w2's POST /assign" in status.setup:
                    seen.append((status.setup, engine.unavailable(1.0)))
                time.sleep(0.05)

        looker = threading.Thread(target=look, daemon=True)
        looker.start()
        out = generate_within(engine, 60)
        looker.join(5)
        assert engine.starter.recoveries == 0 and not engine.starter.membership.lost
        assert [w.name for w in engine.starter.ring_workers] == ["w1", "w2", "w3"]
        assert engine.starter.status().setup is None and engine.unavailable(1.0) is None
        engine.close()
    assert [s["token_ids"] for s in out.samples] == want
    (setup, health), = seen
    assert setup.startswith("w2's POST /assign (blocks ")
    assert health.startswith("setting up the ring: waiting for w2's POST /assign (blocks ")


def test_status_says_what_the_set_up_waits_for(capsys: Any) -> None:
    from mdiedge.cli.console import print_status

    print_status([{"name": "starter", "role": "starter", "address": "starter:7600",
                   "state": "idle", "layers": None,
                   "setup": "w2's POST /assign (blocks [3, 5)) for 12.0 s"},
                  {"name": "w2", "role": "worker", "address": "w2:7700", "state": "loading",
                   "layers": None}])
    assert "starter: setting up the ring: waiting for w2's POST /assign (blocks [3, 5)) for " \
        "12.0 s" in capsys.readouterr().out
