"""Load balancing by measurement: the pure rules (tables), and a ring with a worker slowed
from outside (stopped and continued in a fast cycle) that moves layers away from it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Iterator, List, Optional

import pytest

from conftest import make_hf_llama, write_tiny_tokenizer
from mdiedge.model.sampling import SamplingParams
from mdiedge.roles import balance
from mdiedge.roles.local_ring import LocalRing
from mdiedge.roles.starter import RingEngine
from mdiedge.runtime.partition import balanced_weights
from mdiedge.runtime.protocol import NodeStatus


@pytest.mark.parametrize("times, margin, expected", [
    ([1.0, 1.0, 1.0], 0.25, None),          # balanced
    ([1.0, 1.2], 0.25, None),               # slowest 9% above the mean: within the margin
    ([1.0, 3.0], 0.25, [2.0, 2 / 3]),       # mean 2: the fast node weighs 2, the slow 2/3
    ([1.0, 3.0], 0.0, None),                # margin 0: balancing off
    ([1.0, 0.0], 0.25, None),               # a missing measurement
    ([2.0], 0.25, None),                    # one node: nothing to balance
])
def test_balanced_weights(times: List[float], margin: float,
                          expected: Optional[List[float]]) -> None:
    got = balanced_weights(times, margin)
    assert got == (None if expected is None else pytest.approx(expected))


def status(name: str, layers: Optional[List[int]], compute_s: float, messages: int = 100,
           state: str = "busy") -> NodeStatus:
    return NodeStatus("worker", name, state, layers=layers, compute_s=compute_s,
                      messages=messages)


def test_seconds_per_block_needs_every_node_measured() -> None:
    nodes = [status("starter", [0, 0], 0.5), status("w1", [0, 3], 3.0), status("w2", [3, 6], 1.5)]
    assert balance.seconds_per_block(nodes) == {"w1": 1.0, "w2": 0.5}  # no block: left out
    assert balance.seconds_per_block(nodes[:2] + [status("w2", [3, 6], 1.5, messages=10)]) is None
    assert balance.seconds_per_block(nodes[:2] + [status("w2", None, 0.0, state="down")]) is None


def test_measured_weights_keep_the_declared_scale() -> None:
    nodes = [status("w1", [0, 3], 3.0), status("w2", [3, 6], 1.0)]  # w1 is 3x slower per block
    weights = balance.measured_weights(nodes, {"w1": 2.0, "w2": 2.0}, 0.25)
    assert weights == pytest.approx({"w1": 1.0, "w2": 3.0})  # mean 2 kept, ratio 1:3
    assert balance.measured_weights(nodes, {"w1": 1, "w2": 1}, 0.0) is None


class Throttle:
    """Slows process ``pid`` from outside: stopped ``share`` of every ``period`` seconds, by a
    process of its own (a thread here would wait for this process's GIL, which the starter
    holds most of the time, and stop the worker less often than asked)."""

    CODE = ("import os, signal, sys, time\n"
            "pid, share, period = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])\n"
            "parent = os.getppid()\n"
            "while os.getppid() == parent:  # ends with the test's process\n"
            "    os.kill(pid, signal.SIGSTOP)\n"
            "    time.sleep(period * share)\n"
            "    os.kill(pid, signal.SIGCONT)\n"
            "    time.sleep(period * (1 - share))\n")

    def __init__(self, pid: int, share: float = 0.9, period: float = 0.01) -> None:
        self.pid, self.share, self.period = pid, share, period
        self.proc: Optional[subprocess.Popen] = None

    def __enter__(self) -> "Throttle":
        self.proc = subprocess.Popen([sys.executable, "-c", self.CODE, str(self.pid),
                                      str(self.share), str(self.period)])
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()
        os.kill(self.pid, signal.SIGCONT)  # the throttle may have ended between the two


@pytest.fixture(scope="module")
def wide_ring_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Six blocks wide enough that a worker's message takes longer than the throttle lets it
    run at once, so that every message it computes is stopped at least once: its measured
    time per block is then several times the other worker's, not only when a stop happens
    to fall inside a short computation."""
    path = make_hf_llama(tmp_path_factory.mktemp("wide-ring"), seed=5, num_hidden_layers=6,
                         max_position_embeddings=256, hidden_size=384, intermediate_size=1024)
    write_tiny_tokenizer(path)
    return path


@pytest.fixture
def slowed_ring(wide_ring_model: Path) -> Iterator[RingEngine]:
    local = LocalRing(2)
    with local as workers:
        engine = RingEngine(workers, wide_ring_model, secret=local.secret, timeout_s=30,
                            stall_s=5.0, rebalance_margin=0.25)
        with Throttle(local.processes[0].pid):
            yield engine
        engine.close()


def test_layers_move_away_from_a_slow_worker(slowed_ring: RingEngine) -> None:
    greedy = SamplingParams(temperature=0)
    first = slowed_ring.generate("hello ring", 40, 4, greedy, micro_batch=1)
    before = {p.name: p.n_blocks for p in slowed_ring.starter.placements}
    again = slowed_ring.generate("hello ring", 40, 4, greedy, micro_batch=1)
    after = {p.name: p.n_blocks for p in slowed_ring.starter.placements}
    assert after["w1"] < before["w1"] and after["w2"] > before["w2"], (before, after)
    assert slowed_ring.starter.measured["w1"] < slowed_ring.starter.measured["w2"]
    assert [s["token_ids"] for s in again.samples] == [s["token_ids"] for s in first.samples]
