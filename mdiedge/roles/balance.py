"""Load balancing between requests: each node's measured time per block (its stage's compute
time over its block count, every node seeing the same messages) gives it a weight in
proportion to its speed, and the layers are split anew by those weights when the slowest
node is more than a margin above the mean (``runtime.partition.balanced_weights``)."""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from ..runtime.partition import balanced_weights
from ..runtime.protocol import NodeStatus

MIN_MESSAGES = 64  # messages a ring handles before its measurements are trusted


def seconds_per_block(statuses: Sequence[NodeStatus]) -> Optional[Dict[str, float]]:
    """Each node's compute seconds per block so far (nodes with no block left out), or None
    when a node is down, holds no layers or has handled too few messages."""
    times = {}
    for status in statuses:
        if status.state == "down" or status.layers is None or status.messages < MIN_MESSAGES:
            return None
        blocks = status.layers[1] - status.layers[0]
        if blocks > 0:
            times[status.name] = status.compute_s / blocks
    return times


def measured_weights(statuses: Sequence[NodeStatus], declared: Dict[str, float],
                     margin: float) -> Optional[Dict[str, float]]:
    """New weights by node name when the ring is out of balance by more than ``margin``, on
    the declared weights' scale (their mean over the measured nodes is kept); else None."""
    times = seconds_per_block(statuses)
    if not times:
        return None
    names: List[str] = list(times)
    weights = balanced_weights([times[n] for n in names], margin)
    if weights is None:
        return None
    scale = sum(declared[n] for n in names) / sum(weights)
    return {name: w * scale for name, w in zip(names, weights)}
