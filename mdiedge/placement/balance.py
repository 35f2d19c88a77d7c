"""Load balancing between requests, from measurements, in bounded steps; pure (the starter keeps the
``Evidence``).

Each check (at a request boundary, ``MIN_MESSAGES`` messages after the last) measures every node's
compute time per block. The ring is out of balance when the slowest node is more than a margin above
the mean (``partition.balanced_weights``); only after ``SUSTAINED_CHECKS`` such checks in a row do
layers move (one skewed measurement moves nothing), by each node's median speed over them. One step
moves at most ``MAX_MOVE_SHARE`` of the blocks (at least one), never empties a node holding blocks,
keeps pinned nodes (``bounded_split``); the next step needs fresh evidence."""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from .partition import balanced_weights
from ..runtime.protocol import NodeStatus

MIN_MESSAGES = 64  # messages a ring handles between two checks (a measurement's size)
SUSTAINED_CHECKS = 3  # checks in a row out of balance before the layers move (and the
#                       measurements a node's speed is the median of)
MAX_MOVE_SHARE = 0.25  # one step moves at most this share of the blocks (at least one)


@dataclass(frozen=True)
class Evidence:
    """Each node's counters at the last check, its last ``SUSTAINED_CHECKS`` seconds per block, and
    the out-of-balance checks in a row."""

    counters: Dict[str, Tuple[float, int]] = field(default_factory=dict)
    samples: Dict[str, Tuple[float, ...]] = field(default_factory=dict)
    streak: int = 0

    @property
    def seconds(self) -> Dict[str, float]:
        """Median over the kept measurements."""
        return {name: statistics.median(kept) for name, kept in self.samples.items()}


def seconds_per_block(statuses: Sequence[NodeStatus], before: Dict[str, Tuple[float, int]]
                      ) -> Optional[Dict[str, float]]:
    """Since ``before`` (nodes without blocks left out); None when a node is down, holds no layers,
    handled fewer than ``MIN_MESSAGES`` since, or its counters went back (a new ring)."""
    times = {}
    for status in statuses:
        seconds, messages = before.get(status.name, (0.0, 0))
        if status.state == "down" or status.layers is None or \
                status.messages - messages < MIN_MESSAGES or status.compute_s < seconds:
            return None
        blocks = status.layers[1] - status.layers[0]
        if blocks > 0:
            times[status.name] = (status.compute_s - seconds) / blocks
    return times


def observe(evidence: Evidence, statuses: Sequence[NodeStatus], margin: float) -> Evidence:
    """Unchanged when the check measured nothing."""
    times = seconds_per_block(statuses, evidence.counters)
    if not times:
        return evidence
    counters = {s.name: (s.compute_s, s.messages) for s in statuses}
    samples = {name: (evidence.samples.get(name, ()) + (t,))[-SUSTAINED_CHECKS:]
               for name, t in times.items()}
    out = balanced_weights(list(times.values()), margin) is not None
    return Evidence(counters, samples, evidence.streak + 1 if out else 0)


def measured_weights(evidence: Evidence, declared: Dict[str, float],
                     margin: float) -> Optional[Dict[str, float]]:
    """Once out of balance by more than ``margin`` for ``SUSTAINED_CHECKS`` checks in a row, on the
    declared weights' scale (their mean over measured nodes kept); else None."""
    if evidence.streak < SUSTAINED_CHECKS or not evidence.seconds:
        return None
    names: List[str] = list(evidence.seconds)
    weights = balanced_weights([evidence.seconds[n] for n in names], margin)
    if weights is None:
        return None
    scale = sum(declared[n] for n in names) / sum(weights)
    return {name: w * scale for name, w in zip(names, weights)}


def max_move(blocks: int) -> int:
    return max(1, math.floor(MAX_MOVE_SHARE * blocks))


def bounded_split(current: Sequence[int], target: Sequence[int], fixed: Sequence[bool],
                  limit: int) -> List[int]:
    """At most ``limit`` blocks move, one at a time from the node furthest above its target to the
    one furthest below, only within runs between ``fixed`` (pinned) nodes; a node holding blocks
    keeps one."""
    out = list(current)
    runs: List[List[int]] = [[]]
    for i, pinned in enumerate(fixed):
        if pinned:
            runs.append([])
        else:
            runs[-1].append(i)
    moved = 0
    for run in runs:
        while moved < limit:
            givers = [i for i in run if out[i] > target[i] and out[i] > 1]
            takers = [i for i in run if out[i] < target[i]]
            if not givers or not takers:
                break
            giver = max(givers, key=lambda i: out[i] - target[i])
            taker = max(takers, key=lambda i: target[i] - out[i])
            out[giver], out[taker], moved = out[giver] - 1, out[taker] + 1, moved + 1
    return out


def ranges(counts: Sequence[int]) -> List[Tuple[int, int]]:
    """[first, end) of ``counts`` blocks each, from block 0."""
    out, first = [], 0
    for count in counts:
        out.append((first, first + count))
        first += count
    return out
