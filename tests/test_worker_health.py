"""A worker's health as its systemd watchdog sees it: the compute loop feeds a heartbeat, so a
compute thread stuck on one message stops the pings while an idle or working node keeps them;
and the starter ends a ring with SHUTDOWN, which every worker forwards before it stops."""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Tuple

import pytest

from conftest import make_hf_llama, write_tiny_tokenizer
from mdiedge.base.nodes import NodeSpec
from mdiedge.model.sampling import SamplingParams
from mdiedge.serving.sdnotify import Heartbeat
from mdiedge.engine.ring import RingEngine
from mdiedge.roles.worker import WorkerNode

GREEDY = SamplingParams(temperature=0)


@pytest.fixture()
def one_worker_ring(tmp_path: Path) -> Iterator[Tuple[RingEngine, WorkerNode, Heartbeat]]:
    model = make_hf_llama(tmp_path / "m", seed=3, num_hidden_layers=4)
    write_tiny_tokenizer(model)
    heartbeat = Heartbeat(stall_limit=0.3)
    node = WorkerNode(name="w1", cache_dir=tmp_path / "cache", heartbeat=heartbeat).start()
    engine = RingEngine([NodeSpec("w1", "127.0.0.1", node.control.port)], model, timeout_s=30)
    yield engine, node, heartbeat
    engine.close()
    node.close()


def test_a_stuck_compute_stops_the_heartbeat_and_progress_restores_it(
        one_worker_ring: Tuple[RingEngine, WorkerNode, Heartbeat]) -> None:
    engine, node, heartbeat = one_worker_ring
    engine.generate("hello ring", 4, 1, GREEDY)  # sets the ring up
    assert heartbeat.healthy()
    stage = node.stage
    assert stage is not None
    real = stage.forward
    gate, entered = threading.Event(), threading.Event()

    def stuck(message: Any) -> Any:
        entered.set()
        gate.wait(30)
        return real(message)

    stage.forward = stuck  # type: ignore[assignment]
    result: list = []
    runner = threading.Thread(target=lambda: result.append(engine.generate("hello ring", 4, 1, GREEDY)))
    runner.start()
    assert entered.wait(30)
    time.sleep(0.5)  # longer than the stall limit, with one message taken
    assert not heartbeat.healthy() and "stalled" in heartbeat.reason()
    stage.forward = real  # type: ignore[assignment]
    gate.set()
    runner.join(30)
    assert result and heartbeat.healthy()
    time.sleep(0.5)  # idle for longer than the stall limit is healthy
    assert heartbeat.healthy()


def test_the_starter_ends_the_ring_with_shutdown(
        one_worker_ring: Tuple[RingEngine, WorkerNode, Heartbeat], caplog: Any) -> None:
    caplog.set_level(logging.INFO, logger="mdiedge")
    engine, node, _ = one_worker_ring
    engine.generate("hello ring", 4, 1, GREEDY)
    assert node.state == "busy" and node.links is not None
    engine.starter.close_ring()
    deadline = time.monotonic() + 5
    while node.links is not None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert node.links is None and node.state == "ready"
    assert node.stage is not None and node.stage.counters.messages > 0
    assert "w1: the starter ended the ring" in caplog.text  # SHUTDOWN, not a dropped link
    assert "link down" not in caplog.text


def test_a_worker_never_started_closes_at_once() -> None:
    """A worker whose set-up failed after its ports opened is closed without ever serving:
    that must free its ports at once, not wait for a control loop that never ran."""
    node = WorkerNode(name="w", cache_dir=Path("/nonexistent"))
    done = threading.Event()
    closer = threading.Thread(target=lambda: (node.close(), done.set()), daemon=True)
    closer.start()
    assert done.wait(5.0), "WorkerNode.close() hung on a node that was never started"
