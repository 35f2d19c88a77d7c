"""Layer partitioning: which consecutive blocks each node of the ring runs. Pure arithmetic.

Node 0, the starter, holds the embedding, its first blocks, the final norm, the head and the
sampler; each worker holds one range; in ring order the ranges tile ``[0, n_layers)``.

The split follows MDI-LLM (Macario et al. 2024, arXiv:2505.18164): the starter counts its embedding
and head as ``starter_overhead`` block-equivalents (default 2) and the load is shared by declared
weight: with ``T = n_layers + starter_overhead``, node ``i`` ends at ``floor(T * (w_0+...+w_i) /
sum(w) - starter_overhead)``, giving the paper's splits (5/7 and 2/5/5 for 12-block NanoLlama, 10/12
and 6/8/8 for 22-block TinyLlama). Exact fractions keep ties such as ``14 * 1/2 - 2 = 5`` from
falling to 4.99999."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from fractions import Fraction
from typing import Container, List, Optional, Sequence, Tuple

from ..base.errors import PartitionError
from ..base.nodes import NodeSpec
from ..base.humanize import plural
from ..model.config import ModelConfig

__all__ = ["Placement", "split_layers", "check_ring_size", "partition", "format_bytes",
           "choose_members"]


@dataclass(frozen=True)
class Placement:

    name: str
    layers: Tuple[int, int]
    weight_bytes: int
    kv_bytes: int

    @property
    def n_blocks(self) -> int:
        return self.layers[1] - self.layers[0]

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes


# ------------------------------------------------------------------------------ helpers


def format_bytes(n: int) -> str:
    """1024-based: ``512 B``, ``1.50 KiB``, ``3.25 MiB``."""
    if abs(n) < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB"):
        value /= 1024.0
        if abs(value) < 1024.0:
            return f"{value:.2f} {unit}"
    return f"{value / 1024.0:.2f} GiB"


def _names(names: Sequence[str]) -> str:
    return ", ".join(repr(name) for name in names)


def _exact(what: str, value: object, positive: bool) -> Fraction:
    """PartitionError naming ``what`` unless finite and > 0 (``positive``) or >= 0."""
    if (isinstance(value, bool) or not isinstance(value, numbers.Real)
            or not math.isfinite(float(value)) or float(value) < 0
            or (positive and float(value) == 0)):
        expected = "a positive finite number" if positive else "a finite number >= 0"
        raise PartitionError(f"{what} must be {expected}, got {value!r}")
    return Fraction(float(value))


def _check_weight(label: str, weight: object) -> Fraction:
    return _exact(f"{label}: weight", weight, positive=True)


def _check_overhead(starter_overhead: object) -> Fraction:
    return _exact("starter_overhead", starter_overhead, positive=False)


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _split_counts(n_blocks: int, weights: Sequence[Fraction], overhead: Fraction,
                  starter_first: bool, labels: Sequence[str], where: str,
                  labels_named: bool = True) -> List[int]:
    """Floor-cumulative block counts. ``starter_first``: node 0 is the starter, may get none and
    carries ``overhead``; every other node gets one at least, from its larger neighbour able to
    spare it."""
    n_nodes = len(weights)
    minimum = [0 if (i == 0 and starter_first) else 1 for i in range(n_nodes)]
    needed = sum(minimum)
    if needed > n_blocks:
        workers = [label for label, least in zip(labels, minimum) if least]
        who = (f"{plural(needed, 'worker')} need at least one block each" if needed > 1 else
               "a worker needs at least one block")
        if labels_named:
            who += f" ({_names(workers)})"
        raise PartitionError(f"{where}: {who} but only {plural(n_blocks, 'block')} "
                             f"{'is' if n_blocks == 1 else 'are'} available")
    total_weight = sum(weights)
    total = n_blocks + overhead
    ends: List[int] = []
    cumulative = Fraction(0)
    for weight in weights:
        cumulative += weight
        ideal = total * cumulative / total_weight - overhead
        end = min(max(math.floor(ideal), 0), n_blocks)
        ends.append(max(end, ends[-1]) if ends else end)
    ends[-1] = n_blocks
    counts = [end - start for start, end in zip([0] + ends[:-1], ends)]

    def load(j: int) -> Fraction:  # block-equivalents of node j, the starter's overhead included
        return Fraction(counts[j]) + (overhead if j == 0 and starter_first else 0)

    while True:
        empty = [i for i in range(n_nodes) if counts[i] < minimum[i]]
        if not empty:
            return counts
        i = empty[0]
        left = next((j for j in range(i - 1, -1, -1) if counts[j] > minimum[j]), None)
        right = next((j for j in range(i + 1, n_nodes) if counts[j] > minimum[j]), None)
        # Prefer the side with the larger donor; a tie goes to the nearer, then to the right.
        if right is None or (left is not None and
                             (load(left), right - i) > (load(right), i - left)):
            donor = left
        else:
            donor = right
        assert donor is not None  # guaranteed by the needed <= n_blocks check above
        counts[donor] -= 1  # the nodes in between each pass one block along
        counts[i] += 1


def _ranges(start: int, counts: Sequence[int]) -> List[Tuple[int, int]]:
    out: List[Tuple[int, int]] = []
    for count in counts:
        out.append((start, start + count))
        start += count
    return out


# ------------------------------------------------------------------------------ public API


def split_layers(n_layers: int, weights: Sequence[float],
                 starter_overhead: float = 2.0) -> List[Tuple[int, int]]:
    """``(first, end)`` per node tiling ``[0, n_layers)`` by ``weights``."""
    if not _is_int(n_layers) or n_layers < 0:
        raise PartitionError(f"n_layers must be a non-negative integer, got {n_layers!r}")
    if len(weights) == 0:
        raise PartitionError("cannot split layers over an empty list of nodes")
    labels = [f"node {i}" for i in range(len(weights))]
    exact = [_check_weight(label, w) for label, w in zip(labels, weights)]
    overhead = _check_overhead(starter_overhead)
    counts = _split_counts(n_layers, exact, overhead, True, labels,
                           f"cannot split {plural(n_layers, 'block')} over {len(weights)} nodes",
                           labels_named=False)
    return _ranges(0, counts)


def check_ring_size(n_layers: int, n_nodes: int) -> None:
    """Every worker needs a block, the starter may have none; checked before any node process
    starts."""
    workers = n_nodes - 1
    if workers > n_layers:
        raise PartitionError(
            f"{plural(n_layers, 'block')} cannot be shared among {plural(workers, 'worker')} "
            f"(a ring of {n_nodes} nodes): every worker needs at least one block, so this "
            f"model runs on at most {n_layers + 1} nodes")


def _pinned_range(node: NodeSpec, index: int, n_layers: int) -> Optional[Tuple[int, int]]:
    if node.layers is None:
        return None
    try:
        first, end = node.layers
    except (TypeError, ValueError):
        raise PartitionError(
            f"node {node.name!r}: pinned layers must be a pair [first, end), got {node.layers!r}"
        ) from None
    if not (_is_int(first) and _is_int(end)):
        raise PartitionError(
            f"node {node.name!r}: pinned layers must be integers, got {node.layers!r}")
    first, end = int(first), int(end)
    if first > end:
        raise PartitionError(
            f"node {node.name!r}: pinned layers [{first}, {end}) end before they start")
    if not 0 <= first <= end <= n_layers:
        raise PartitionError(
            f"node {node.name!r}: pinned layers [{first}, {end}) are outside the model's "
            f"{plural(n_layers, 'block')} [0, {n_layers})")
    if index > 0 and first == end:
        raise PartitionError(
            f"node {node.name!r}: pinned layers [{first}, {end}) are empty; "
            f"a worker needs at least one block")
    return first, end


def _assign_layers(n_layers: int, nodes: Sequence[NodeSpec],
                   overhead: Fraction) -> List[Tuple[int, int]]:
    """Pinned ranges as given, the gaps split over their unpinned nodes by weight."""
    weights = [_check_weight(f"node {node.name!r}", node.weight) for node in nodes]
    pins = [_pinned_range(node, i, n_layers) for i, node in enumerate(nodes)]
    _check_pin_order(nodes, pins)
    result: List[Optional[Tuple[int, int]]] = list(pins)
    group: List[int] = []  # consecutive unpinned nodes since the last pin
    gap_start, after = 0, None  # after: index of the pinned node the gap follows
    for i in range(len(nodes) + 1):
        pin = pins[i] if i < len(nodes) else (n_layers, n_layers)
        if i < len(nodes) and pin is None:
            group.append(i)
            continue
        assert pin is not None
        gap_end = pin[0]
        assert gap_start <= gap_end  # pins were checked to be in order and within range
        where = _gap_name(nodes, after, i if i < len(nodes) else None, gap_start, gap_end)
        if not group and gap_end > gap_start:
            raise PartitionError(f"{where} have no node to take them; pin them to a node or "
                                 f"leave an unpinned node there")
        if group:
            starter_first = group[0] == 0
            counts = _split_counts(gap_end - gap_start, [weights[j] for j in group],
                                   overhead if starter_first else Fraction(0), starter_first,
                                   [nodes[j].name for j in group], where)
            for j, layers in zip(group, _ranges(gap_start, counts)):
                result[j] = layers
        group, gap_start, after = [], pin[1], i
    return [layers for layers in result if layers is not None]


def _check_pin_order(nodes: Sequence[NodeSpec], pins: Sequence[Optional[Tuple[int, int]]]
                     ) -> None:
    previous: Optional[int] = None
    for i, pin in enumerate(pins):
        if pin is None:
            continue
        before = pins[previous] if previous is not None else None
        if before is not None and pin[0] < before[1]:
            raise PartitionError(
                f"node {nodes[i].name!r} pins layers [{pin[0]}, {pin[1]}) which overlap or "
                f"precede node {nodes[previous].name!r}'s pinned [{before[0]}, {before[1]}); "
                f"pinned ranges must be disjoint and in ring order")
        previous = i


def _gap_name(nodes: Sequence[NodeSpec], after: Optional[int], before: Optional[int],
              first: int, end: int) -> str:
    text = f"blocks [{first}, {end})"
    if after is not None:
        text += f" after node {nodes[after].name!r}"
    if before is not None:
        text += f"{' and' if after is not None else ''} before node {nodes[before].name!r}"
    elif after is not None:
        text += " at the end of the ring"
    return text


def partition(cfg: ModelConfig, nodes: Sequence[NodeSpec], n_samples: int, context: int,
              itemsize: int = 4, starter_overhead: float = 2.0) -> List[Placement]:
    """Place blocks on ``nodes`` (ring order): pinned ones keep their ``layers``, the rest by
    weight. A node's memory is its weights (the starter's embedding and head too) and a KV cache of
    ``n_samples`` x ``context``; one declaring less fails the whole partition before anything loads.
    """
    if len(nodes) == 0:
        raise PartitionError("cannot partition a model over an empty list of nodes")
    for key, value, low in (("n_samples", n_samples, 0), ("context", context, 0),
                            ("itemsize", itemsize, 1)):
        if not _is_int(value) or value < low:
            raise PartitionError(f"{key} must be an integer >= {low}, got {value!r}")
    overhead = _check_overhead(starter_overhead)
    for node in nodes:
        if node.memory is not None and (not _is_int(node.memory) or node.memory < 0):
            raise PartitionError(
                f"node {node.name!r}: memory must be a non-negative number of bytes, "
                f"got {node.memory!r}")
    ranges = _assign_layers(cfg.n_layers, nodes, overhead)

    kv_per_block = n_samples * context * cfg.kv_bytes_per_token_per_layer(itemsize)
    placements: List[Placement] = []
    for i, (node, layers) in enumerate(zip(nodes, ranges)):
        blocks = layers[1] - layers[0]
        params = blocks * cfg.block_params()
        if i == 0:
            params += cfg.embedding_params() + cfg.head_params()
        placements.append(Placement(node.name, layers, itemsize * params, blocks * kv_per_block))

    refused = [_memory_message(p, node.memory, n_samples, context)
               for p, node in zip(placements, nodes)
               if node.memory is not None and p.total_bytes > node.memory]
    if refused:
        raise PartitionError("; ".join(refused))
    return placements


def _memory_message(p: Placement, memory: int, n_samples: int, context: int) -> str:
    return (f"node {p.name!r} needs {format_bytes(p.total_bytes)} "
            f"(weights {format_bytes(p.weight_bytes)} + KV {format_bytes(p.kv_bytes)} for "
            f"{plural(n_samples, 'sample')} x {plural(context, 'token')}) "
            f"but declares memory {format_bytes(memory)}")


def choose_members(nodes: Sequence[NodeSpec], lost: Container[str]) -> List[NodeSpec]:
    """Every configured worker not ``lost``, a lost one's place taken by the next spare not lost;
    other spares held back."""
    spares = [n for n in nodes if n.spare and n.name not in lost]
    members = []
    for node in nodes:
        if node.spare:
            continue
        if node.name not in lost:
            members.append(node)
        elif spares:
            members.append(spares.pop(0))
    return members


def balanced_weights(seconds_per_block: Sequence[float], margin: float) -> Optional[List[float]]:
    """Proportional to measured speed (mean speed: 1), or None when the slowest is within ``margin``
    of the mean, ``margin`` is 0, or a measurement is missing (Petals' balancing, from
    measurements)."""
    times = list(seconds_per_block)
    if margin <= 0 or len(times) < 2 or not all(t > 0 and math.isfinite(t) for t in times):
        return None
    mean = sum(times) / len(times)
    if max(times) <= mean * (1 + margin):
        return None
    return [mean / t for t in times]
