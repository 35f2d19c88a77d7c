"""Load balancing by measurement: the pure rules (tables), and a ring with a worker slowed
from outside (stopped and continued in a fast cycle) that moves layers away from it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence

import pytest

from conftest import make_hf_llama, write_tiny_tokenizer
from mdiedge.model.sampling import SamplingParams
from mdiedge.placement import balance
from mdiedge.roles.local_ring import LocalRing
from mdiedge.engine.ring import RingEngine
from mdiedge.placement.partition import balanced_weights
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
    assert balance.seconds_per_block(nodes, {}) == {"w1": 1.0, "w2": 0.5}  # no block: left out
    assert balance.seconds_per_block(nodes[:2] + [status("w2", [3, 6], 1.5, messages=10)],
                                     {}) is None
    assert balance.seconds_per_block(nodes[:2] + [status("w2", None, 0.0, state="down")],
                                     {}) is None
    since = {"starter": (0.1, 50), "w1": (1.0, 30), "w2": (0.5, 20)}  # the last check's
    assert balance.seconds_per_block(nodes, since) is None  # w1: 70 messages since, w2 80;
    #                                                         the starter only 50
    since["starter"] = (0.1, 20)
    assert balance.seconds_per_block(nodes, since) == pytest.approx({"w1": 2 / 3, "w2": 1 / 3})
    assert balance.seconds_per_block(nodes, {"w1": (9.0, 0)}) is None  # counters went back


def checks(per_block: Sequence[Dict[str, float]], blocks: Dict[str, int],
           margin: float = 0.25) -> List[balance.Evidence]:
    """The evidence after each of a series of checks, each of 100 messages, in which node
    ``name`` spent ``per_block[k][name]`` s per block."""
    evidence, totals, out = balance.Evidence(), {n: 0.0 for n in blocks}, []
    for k, times in enumerate(per_block):
        for name, t in times.items():
            totals[name] += t * blocks[name]
        statuses = [status(n, [0, b], totals[n], messages=100 * (k + 1))
                    for n, b in blocks.items()]
        evidence = balance.observe(evidence, statuses, margin)
        out.append(evidence)
    return out


EVEN = {"starter": 1.0, "w1": 1.0, "w2": 1.0}
SKEWED = {"starter": 18.0, "w1": 1.0, "w2": 1.0}  # the starter's threads contend for a moment
BLOCKS = {"starter": 2, "w1": 2, "w2": 2}


@pytest.mark.parametrize("series, moves", [
    ([EVEN] * 5, [False] * 5),
    ([SKEWED], [False]),                                   # one skewed measurement: nothing
    ([SKEWED, EVEN, EVEN, EVEN], [False] * 4),             # and it passes: nothing
    ([SKEWED, SKEWED, EVEN, SKEWED], [False] * 4),         # broken streaks: nothing
    ([SKEWED] * 3, [False, False, True]),                  # sustained: a move
    ([EVEN, SKEWED, SKEWED, SKEWED, EVEN], [False, False, False, True, False]),
])
def test_layers_move_only_on_sustained_evidence(series: List[Dict[str, float]],
                                                moves: List[bool]) -> None:
    declared = {n: 1.0 for n in BLOCKS}
    got = [balance.measured_weights(e, declared, 0.25) is not None
           for e in checks(series, BLOCKS)]
    assert got == moves


def test_speeds_are_medians_and_keep_the_declared_scale() -> None:
    series = [{"w1": 3.0, "w2": 1.0}, {"w1": 12.0, "w2": 1.0}, {"w1": 3.0, "w2": 1.0}]
    evidence = checks(series, {"w1": 3, "w2": 3})
    assert [e.streak for e in evidence] == [1, 2, 3]
    assert evidence[2].seconds == pytest.approx({"w1": 3.0, "w2": 1.0})  # the 12 is an outlier
    weights = balance.measured_weights(evidence[2], {"w1": 2.0, "w2": 2.0}, 0.25)
    assert weights == pytest.approx({"w1": 1.0, "w2": 3.0})  # mean 2 kept, ratio 1:3
    assert balance.measured_weights(evidence[2], {"w1": 1, "w2": 1}, 0.0) is None
    kept = checks(series + [{"w1": 4.0, "w2": 2.0}], {"w1": 3, "w2": 3})[-1]
    assert kept.samples["w1"] == (12.0, 3.0, 4.0)  # the last three


@pytest.mark.parametrize("current, target, fixed, limit, expected", [
    ([2, 2, 2], [0, 3, 3], [False] * 3, 1, [1, 3, 2]),     # one block, starter not emptied
    ([2, 2, 2], [0, 3, 3], [False] * 3, 4, [1, 3, 2]),     # ... however far the target
    ([1, 3, 2], [0, 3, 3], [False] * 3, 1, [1, 3, 2]),     # a node with one block keeps it
    ([4, 4, 4], [1, 5, 6], [False] * 3, 1, [3, 4, 5]),     # the furthest below gains first
    ([4, 4, 4], [1, 5, 6], [False] * 3, 2, [2, 5, 5]),     # (a tie: in ring order)
    ([4, 4, 4], [1, 5, 6], [False] * 3, 3, [1, 5, 6]),
    ([0, 3, 3], [2, 2, 2], [False] * 3, 1, [1, 2, 3]),     # a node with none may gain
    ([2, 2, 2], [2, 2, 2], [False] * 3, 3, [2, 2, 2]),     # balanced: nothing moves
    ([2, 2, 2, 2], [1, 3, 2, 2], [False, False, True, False], 3, [1, 3, 2, 2]),
    ([2, 2, 2, 2], [1, 2, 2, 3], [False, False, True, False], 3, [2, 2, 2, 2]),  # not across
    #                                                                   a pinned node
])
def test_bounded_split(current: List[int], target: List[int], fixed: List[bool], limit: int,
                       expected: List[int]) -> None:
    assert balance.bounded_split(current, target, fixed, limit) == expected
    assert sum(expected) == sum(current)


@pytest.mark.parametrize("blocks, limit", [(1, 1), (4, 1), (6, 1), (8, 2), (30, 7), (80, 20)])
def test_one_step_moves_at_most_a_quarter(blocks: int, limit: int) -> None:
    assert balance.max_move(blocks) == limit


def test_a_sustained_skew_moves_one_bounded_step(ring_model: Path) -> None:
    """The co-located ring of finding 12: the starter measured 18x slower per block. The
    split by measured weights alone would leave it no block; one step moves one of the six
    blocks, and the starter keeps one."""
    from mdiedge.base.nodes import NodeSpec
    from mdiedge.model.checkpoint import load_config
    from mdiedge.placement.partition import partition

    cfg = load_config(ring_model)
    evidence = checks([SKEWED] * 3, BLOCKS)[-1]
    weights = balance.measured_weights(evidence, {n: 1.0 for n in BLOCKS}, 0.25)
    assert weights is not None
    nodes = [NodeSpec(n, weight=weights[n]) for n in BLOCKS]
    target = [p.n_blocks for p in partition(cfg, nodes, 1, 64)]
    assert target[0] == 0  # unbounded, the starter would hold nothing
    step = balance.bounded_split([2, 2, 2], target, [False] * 3, balance.max_move(cfg.n_layers))
    assert step[0] == 1 and sum(abs(a - b) for a, b in zip(step, [2, 2, 2])) == 2
    assert balance.ranges(step) == [(0, 1), (1, 3 if step[1] == 2 else 4), (step[0] + step[1], 6)]


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
    """A worker slowed for good: the ``SUSTAINED_CHECKS``-th check (one at each request after
    the first) moves one block away from it, one bounded step, and the text is the same."""
    greedy = SamplingParams(temperature=0)
    first = slowed_ring.generate("hello ring", 40, 4, greedy, micro_batch=1)
    before = {p.name: p.n_blocks for p in slowed_ring.starter.placements}
    for _ in range(balance.SUSTAINED_CHECKS - 1):
        again = slowed_ring.generate("hello ring", 40, 4, greedy, micro_batch=1)
        assert {p.name: p.n_blocks for p in slowed_ring.starter.placements} == before
    again = slowed_ring.generate("hello ring", 40, 4, greedy, micro_batch=1)
    after = {p.name: p.n_blocks for p in slowed_ring.starter.placements}
    assert after["w1"] == before["w1"] - 1 and after["w2"] == before["w2"] + 1, (before, after)
    assert slowed_ring.starter.measured["w1"] < slowed_ring.starter.measured["w2"]
    assert [s["token_ids"] for s in again.samples] == [s["token_ids"] for s in first.samples]
