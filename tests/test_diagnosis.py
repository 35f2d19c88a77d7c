"""Fault diagnosis with real worker processes and recovery off: a frozen (SIGSTOPped) worker
is named itself, not its neighbour, within the stall time plus a few seconds, from the
library and from ``mdiedge generate --stall-timeout --no-recover``."""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import List

from mdiedge.base import defaults
from mdiedge.base.errors import RingError
from mdiedge.model.sampling import SamplingParams
from mdiedge.roles.local_ring import LocalRing
from mdiedge.engine.ring import RingEngine
from test_ring import workers_of
from commands import MDIEDGE

GREEDY = SamplingParams(temperature=0)
STALL_S = 4.0
SLACK_S = 5.0  # the parallel probe (DIAGNOSE_TIMEOUT_S) and a loaded machine


def test_a_frozen_worker_is_named_itself_within_the_stall_time(ring_model: Path) -> None:
    local = LocalRing(3)
    with local as workers:
        engine = RingEngine(workers, ring_model, timeout_s=STALL_S, stall_s=STALL_S,
                            secret=local.secret, recover=False)
        errors: List[BaseException] = []
        started = threading.Event()

        def run() -> None:
            try:
                engine.generate("hello ring", 230, 4, GREEDY, micro_batch=1,
                                on_token=lambda i, t: started.set())
            except BaseException as e:  # noqa: BLE001 - the test inspects it
                errors.append(e)

        thread = threading.Thread(target=run)
        thread.start()
        middle = local.processes[1].pid  # w2
        try:
            assert started.wait(60)
            os.kill(middle, signal.SIGSTOP)
            t0 = time.monotonic()
            thread.join(STALL_S + SLACK_S + 10)
            elapsed = time.monotonic() - t0
        finally:
            os.kill(middle, signal.SIGCONT)  # so that the ring can be cleaned up
        assert not thread.is_alive()
        engine.close()
    assert errors and isinstance(errors[0], RingError), errors
    message = str(errors[0])
    assert message.startswith("worker 'w2'") and "'w1'" not in message, message
    assert elapsed < STALL_S + SLACK_S, (elapsed, message)


def test_the_local_ring_default_stall_time_is_short() -> None:
    assert defaults.LOCAL_RING_TIMEOUT_S <= 15 < defaults.RING_TIMEOUT_S
    assert defaults.STATUS_RTT_TIMEOUT_S < defaults.DIAGNOSE_TIMEOUT_S


def test_generate_stall_timeout_names_the_frozen_worker(stories: Path) -> None:
    cmd = [*MDIEDGE, "generate", "Once upon", "--model",
           str(stories / "stories260K.bin"), "--tokenizer", str(stories / "tok512.model"),
           "-n", "480", "--nodes", "4", "--stall-timeout", str(STALL_S), "--no-recover"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    streamed = proc.stdout.read(len("Once upon") + 20)  # the prompt, then generated text
    pids = workers_of(proc.pid)
    assert len(streamed) > len("Once upon") + 10 and len(pids) == 3 and proc.poll() is None
    os.kill(pids[1], signal.SIGSTOP)  # w2
    t0 = time.monotonic()
    try:
        _, err = proc.communicate(timeout=STALL_S + SLACK_S + 20)
        elapsed = time.monotonic() - t0
    finally:
        try:
            os.kill(pids[1], signal.SIGCONT)
        except ProcessLookupError:  # the command's own clean-up killed it already
            pass
    lines = err.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1, err
    assert lines[0].startswith("mdiedge: error: worker 'w2'"), err
    assert elapsed < STALL_S + SLACK_S + 5, (elapsed, err)  # + the ring's clean-up
