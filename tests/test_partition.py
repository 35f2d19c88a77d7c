"""Layer partitioning over the ring (pure arithmetic: no torch, runs on the Python 3.8 CI)."""
from __future__ import annotations

import math
from typing import Any, Dict, List, Sequence, Tuple

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mdiedge.model.config import ModelConfig, preset
from mdiedge.base.errors import PartitionError
from mdiedge.base.nodes import NodeSpec
from mdiedge.placement.partition import Placement, format_bytes, partition, split_layers

Ranges = List[Tuple[int, int]]

# A small model whose byte counts are worked out by hand below.
#   head_dim = 16 / 4 = 4, q_dim = 16, kv_dim = 2 * 4 = 8
#   block = attention 16 * (16 + 2 * 8) + 16 * 16 = 768, MLP 3 * 16 * 32 = 1536, norms 2 * 16
#         = 2336 parameters
#   embedding = 100 * 16 = 1600, head = 16 (final norm) + 100 * 16 = 1616
#   KV per token per block at 4 bytes = 2 * 8 * 4 = 64 bytes
SMALL = ModelConfig(vocab_size=100, dim=16, n_layers=4, n_heads=4, n_kv_heads=2,
                    intermediate_size=32, max_seq_len=64)
BLOCK, EMBEDDING, HEAD, KV_TOKEN = 2336, 1600, 1616, 64


def nodes(n: int, **pins: Tuple[int, int]) -> List[NodeSpec]:
    """``n`` equal nodes named s, w1, w2, ...; keyword arguments pin layers by name."""
    names = ["s"] + [f"w{i}" for i in range(1, n)]
    return [NodeSpec(name, layers=pins.get(name)) for name in names]


def layers_of(placements: Sequence[Placement]) -> Ranges:
    return [p.layers for p in placements]


def assert_tiles(ranges: Sequence[Tuple[int, int]], n_layers: int) -> None:
    assert ranges[0][0] == 0 and ranges[-1][1] == n_layers
    for (_, end), (first, _) in zip(ranges, ranges[1:]):
        assert end == first
    assert all(first < end for first, end in ranges[1:]), "a worker got no block"
    assert ranges[0][0] <= ranges[0][1]


# ------------------------------------------------------------------------------ split_layers


@pytest.mark.parametrize("n_layers,weights,expected", [
    # The splits of MDI-LLM (Macario et al. 2024), equal nodes.
    (12, [1, 1], [(0, 5), (5, 12)]),
    (12, [1, 1, 1], [(0, 2), (2, 7), (7, 12)]),
    (22, [1, 1], [(0, 10), (10, 22)]),
    (22, [1, 1, 1], [(0, 6), (6, 14), (14, 22)]),
    # One node: everything.
    (12, [1], [(0, 12)]),
    (1, [3.5], [(0, 1)]),
    # Weights: a worker of weight 2 gets twice the blocks of a worker of weight 1
    # (T = 24: boundaries 24/4 - 2 = 4, 24/2 - 2 = 10).
    (22, [1, 1, 2], [(0, 4), (4, 10), (10, 22)]),
    (22, [0.5, 0.5, 1.0], [(0, 4), (4, 10), (10, 22)]),  # only relative weights matter
    # A heavy starter: 14 * 3/4 - 2 = 8.5 -> 8.
    (12, [3, 1], [(0, 8), (8, 12)]),
    # A light starter gets no block at all (14 * 0.1/10.1 - 2 < 0).
    (12, [0.1, 10], [(0, 0), (0, 12)]),
    # As many workers as blocks: the starter keeps none, each worker gets one.
    (3, [1, 1, 1, 1], [(0, 0), (0, 1), (1, 2), (2, 3)]),
    # Rounding leaves w1 empty (5.33 -> 5, 5.34 -> 5): it takes a block from its larger
    # neighbour, w2 (7 blocks) rather than the starter (5 blocks + 2).
    (12, [1.1, 0.001, 1], [(0, 5), (5, 6), (6, 12)]),
    # ... and from the starter when the starter is the larger one (8.35 -> 8, 8.38 -> 8:
    # the starter has 8 blocks + 2, w2 only 4).
    (12, [4, 0.01, 1.4], [(0, 7), (7, 8), (8, 12)]),
])
def test_split_layers(n_layers: int, weights: List[float], expected: Ranges) -> None:
    assert split_layers(n_layers, weights) == expected


@pytest.mark.parametrize("overhead,expected", [
    (0.0, [(0, 6), (6, 12)]),
    (2.0, [(0, 5), (5, 12)]),
    (4, [(0, 4), (4, 12)]),
    (20.0, [(0, 0), (0, 12)]),
])
def test_starter_overhead(overhead: float, expected: Ranges) -> None:
    assert split_layers(12, [1, 1], starter_overhead=overhead) == expected


def test_split_matches_presets() -> None:
    assert split_layers(preset("nanollama").n_layers, [1, 1, 1]) == [(0, 2), (2, 7), (7, 12)]
    assert split_layers(preset("tinyllama-1.1b").n_layers, [1, 1]) == [(0, 10), (10, 22)]


@pytest.mark.parametrize("n_layers,weights,overhead,message", [
    (3, [1, 1, 1, 1, 1], 2.0,
     "cannot split 3 blocks over 5 nodes: 4 workers need at least one block each but only "
     "3 blocks are available"),
    (1, [1, 1, 1], 2.0,
     "cannot split 1 block over 3 nodes: 2 workers need at least one block each but only "
     "1 block is available"),
    (12, [1, 0], 2.0, "node 1: weight must be a positive finite number, got 0"),
    (12, [1, -2.5], 2.0, "node 1: weight must be a positive finite number, got -2.5"),
    (12, [float("nan"), 1], 2.0, "node 0: weight must be a positive finite number, got nan"),
    (12, [1, float("inf")], 2.0, "node 1: weight must be a positive finite number, got inf"),
    (12, [1, "2"], 2.0, "node 1: weight must be a positive finite number, got '2'"),
    (12, [1, True], 2.0, "node 1: weight must be a positive finite number, got True"),
    (12, [], 2.0, "cannot split layers over an empty list of nodes"),
    (12, [1, 1], -1.0, "starter_overhead must be a finite number >= 0, got -1.0"),
    (-1, [1], 2.0, "n_layers must be a non-negative integer, got -1"),
])
def test_split_layers_errors(n_layers: int, weights: List[float], overhead: float,
                             message: str) -> None:
    with pytest.raises(PartitionError) as e:
        split_layers(n_layers, weights, starter_overhead=overhead)
    assert str(e.value) == message


@settings(max_examples=300, deadline=None)
@given(n_layers=st.integers(0, 120),
       weights=st.lists(st.floats(1e-3, 1e3, allow_nan=False, allow_infinity=False),
                        min_size=1, max_size=12),
       overhead=st.floats(0, 8, allow_nan=False))
def test_split_layers_tiles(n_layers: int, weights: List[float], overhead: float) -> None:
    if len(weights) - 1 > n_layers:
        with pytest.raises(PartitionError):
            split_layers(n_layers, weights, overhead)
        return
    ranges = split_layers(n_layers, weights, overhead)
    assert len(ranges) == len(weights)
    assert_tiles(ranges, n_layers)


@settings(max_examples=200, deadline=None)
@given(n_layers=st.integers(1, 80),
       weights=st.lists(st.floats(0.05, 20, allow_nan=False), min_size=2, max_size=6))
def test_split_layers_near_ideal(n_layers: int, weights: List[float]) -> None:
    """Without a worker short of blocks, each end is the floor of the ideal boundary."""
    total, overhead = sum(weights), 2.0
    ideal = [(n_layers + overhead) * sum(weights[:i + 1]) / total - overhead
             for i in range(len(weights))]
    floors = [min(max(math.floor(c + 1e-9), 0), n_layers) for c in ideal]
    floors[-1] = n_layers
    counts = [b - a for a, b in zip([0] + floors[:-1], floors)]
    if any(c == 0 for c in counts[1:]) or any(abs(c - round(c)) < 1e-6 for c in ideal):
        return  # a repaired split, or a boundary too close to an integer for float checks
    assert [end for _, end in split_layers(n_layers, weights)] == floors


# ------------------------------------------------------------------------------ partition


def test_one_node_gets_everything() -> None:
    (only,) = partition(SMALL, [NodeSpec("s")], 2, 16)
    assert only.layers == (0, 4)
    assert only.weight_bytes == 4 * (4 * BLOCK + EMBEDDING + HEAD)
    assert only.kv_bytes == 2 * 16 * 4 * KV_TOKEN


@pytest.mark.parametrize("n_layers,n_nodes,pins,expected", [
    # No pins: the same as split_layers.
    (12, 3, {}, [(0, 2), (2, 7), (7, 12)]),
    # All pinned, the starter with no block.
    (12, 3, {"s": (0, 0), "w1": (0, 3), "w2": (3, 12)}, [(0, 0), (0, 3), (3, 12)]),
    (12, 3, {"s": (0, 6), "w1": (6, 7), "w2": (7, 12)}, [(0, 6), (6, 7), (7, 12)]),
    # A pinned worker in the middle: the starter alone fills [0, 4); w2 and w3 share [6, 12)
    # by the same rule with no starter overhead (6 * 1/2 = 3).
    (12, 4, {"w1": (4, 6)}, [(0, 4), (4, 6), (6, 9), (9, 12)]),
    # A pinned last worker: starter and w1 share [0, 8) with the overhead (10 * 1/2 - 2 = 3).
    (12, 3, {"w2": (8, 12)}, [(0, 3), (3, 8), (8, 12)]),
    # A pinned starter: the workers share the rest equally (floor(7 * 1/2) = 3).
    (12, 3, {"s": (0, 5)}, [(0, 5), (5, 8), (8, 12)]),
    # The starter alone before a pin that starts at 0 keeps no block.
    (12, 2, {"w1": (0, 12)}, [(0, 0), (0, 12)]),
    # The 22 blocks of TinyLlama with the first worker pinned to the paper's range.
    (22, 3, {"w1": (6, 14)}, [(0, 6), (6, 14), (14, 22)]),
])
def test_pins(n_layers: int, n_nodes: int, pins: Dict[str, Tuple[int, int]],
              expected: Ranges) -> None:
    cfg = SMALL.replace(n_layers=n_layers)
    assert layers_of(partition(cfg, nodes(n_nodes, **pins), 1, 8)) == expected


def test_weights_in_a_gap() -> None:
    ring = [NodeSpec("s", layers=(0, 4)), NodeSpec("w1", weight=1.0), NodeSpec("w2", weight=3.0)]
    # [4, 12): 8 * 1/4 = 2 for w1, the rest for w2.
    assert layers_of(partition(SMALL.replace(n_layers=12), ring, 1, 8)) == [
        (0, 4), (4, 6), (6, 12)]


@pytest.mark.parametrize("n_layers,n_nodes,pins,message", [
    (12, 3, {"w1": (0, 5), "w2": (4, 12)},
     "node 'w2' pins layers [4, 12) which overlap or precede node 'w1''s pinned [0, 5); "
     "pinned ranges must be disjoint and in ring order"),
    (12, 3, {"w1": (6, 12), "w2": (0, 6)},
     "node 'w2' pins layers [0, 6) which overlap or precede node 'w1''s pinned [6, 12); "
     "pinned ranges must be disjoint and in ring order"),
    (12, 2, {"w1": (5, 13)},
     "node 'w1': pinned layers [5, 13) are outside the model's 12 blocks [0, 12)"),
    (12, 2, {"w1": (-1, 12)},
     "node 'w1': pinned layers [-1, 12) are outside the model's 12 blocks [0, 12)"),
    (12, 2, {"w1": (7, 5)},
     "node 'w1': pinned layers [7, 5) end before they start"),
    (12, 2, {"w1": (5, 5)},
     "node 'w1': pinned layers [5, 5) are empty; a worker needs at least one block"),
    (12, 2, {"w1": (5, 6.5)}, "node 'w1': pinned layers must be integers, got (5, 6.5)"),
    (12, 2, {"w1": (5,)}, "node 'w1': pinned layers must be a pair [first, end), got (5,)"),
    # Gaps with no node to take them.
    (12, 2, {"s": (0, 4), "w1": (6, 12)},
     "blocks [4, 6) after node 's' and before node 'w1' have no node to take them; "
     "pin them to a node or leave an unpinned node there"),
    (12, 2, {"w1": (4, 10)},
     "blocks [10, 12) after node 'w1' at the end of the ring have no node to take them; "
     "pin them to a node or leave an unpinned node there"),
    (12, 2, {"s": (2, 4), "w1": (4, 12)},
     "blocks [0, 2) before node 's' have no node to take them; "
     "pin them to a node or leave an unpinned node there"),
    # Unpinned workers with nothing left to take.
    (12, 3, {"s": (0, 4), "w2": (4, 12)},
     "blocks [4, 4) after node 's' and before node 'w2': a worker needs at least one block "
     "('w1') but only 0 blocks are available"),
    (12, 4, {"s": (0, 4), "w3": (5, 12)},
     "blocks [4, 5) after node 's' and before node 'w3': 2 workers need at least one block "
     "each ('w1', 'w2') but only 1 block is available"),
    (2, 4, {},
     "blocks [0, 2): 3 workers need at least one block each ('w1', 'w2', 'w3') but only "
     "2 blocks are available"),
])
def test_pin_errors(n_layers: int, n_nodes: int, pins: Dict[str, Tuple[int, int]],
                    message: str) -> None:
    cfg = SMALL.replace(n_layers=n_layers)
    with pytest.raises(PartitionError) as e:
        partition(cfg, nodes(n_nodes, **pins), 1, 8)
    assert str(e.value) == message


@pytest.mark.parametrize("ring,kwargs,message", [
    ([NodeSpec("s"), NodeSpec("w1", weight=0.0)], {},
     "node 'w1': weight must be a positive finite number, got 0.0"),
    ([NodeSpec("s", weight=-1), NodeSpec("w1")], {},
     "node 's': weight must be a positive finite number, got -1"),
    ([NodeSpec("s"), NodeSpec("w1", weight=float("nan"))], {},
     "node 'w1': weight must be a positive finite number, got nan"),
    ([NodeSpec("s"), NodeSpec("w1", memory=-5)], {},
     "node 'w1': memory must be a non-negative number of bytes, got -5"),
    ([], {}, "cannot partition a model over an empty list of nodes"),
    ([NodeSpec("s")], {"n_samples": -1}, "n_samples must be an integer >= 0, got -1"),
    ([NodeSpec("s")], {"itemsize": 0}, "itemsize must be an integer >= 1, got 0"),
    ([NodeSpec("s")], {"starter_overhead": float("inf")},
     "starter_overhead must be a finite number >= 0, got inf"),
])
def test_partition_input_errors(ring: List[NodeSpec], kwargs: Dict[str, Any],
                                message: str) -> None:
    args: Dict[str, Any] = dict(n_samples=1, context=8)
    args.update(kwargs)
    with pytest.raises(PartitionError) as e:
        partition(SMALL, ring, **args)
    assert str(e.value) == message


# ------------------------------------------------------------------------------ memory


@pytest.mark.parametrize("itemsize,n_samples,context", [(4, 3, 10), (2, 1, 64), (1, 0, 0)])
def test_bytes_by_hand(itemsize: int, n_samples: int, context: int) -> None:
    # 4 blocks on 2 equal nodes: T = 6, 6/2 - 2 = 1 -> the starter runs [0, 1), w1 [1, 4).
    starter, worker = partition(SMALL, nodes(2), n_samples, context, itemsize)
    assert (starter.layers, worker.layers) == ((0, 1), (1, 4))
    kv_token = KV_TOKEN // 4 * itemsize  # 2 * kv_dim * itemsize
    assert starter.weight_bytes == itemsize * (1 * BLOCK + EMBEDDING + HEAD)
    assert starter.kv_bytes == n_samples * context * 1 * kv_token
    assert worker.weight_bytes == itemsize * 3 * BLOCK
    assert worker.kv_bytes == n_samples * context * 3 * kv_token
    assert worker.total_bytes == worker.weight_bytes + worker.kv_bytes


def test_bytes_by_hand_concrete() -> None:
    starter, worker = partition(SMALL, nodes(2), 3, 10)
    assert (starter.weight_bytes, starter.kv_bytes, starter.total_bytes) == (22208, 1920, 24128)
    assert (worker.weight_bytes, worker.kv_bytes, worker.total_bytes) == (28032, 5760, 33792)


def test_tied_embeddings_count_once() -> None:
    tied = SMALL.replace(tie_embeddings=True)
    starter, _ = partition(tied, nodes(2), 1, 1)
    assert starter.weight_bytes == 4 * (BLOCK + EMBEDDING + 16)  # head: final norm only


def test_memory_refused() -> None:
    # w1 needs 28032 + 5760 = 33792 bytes = 33.00 KiB (27.38 + 5.62 KiB, half-even rounding)
    ring = [NodeSpec("s"), NodeSpec("w1", memory=32 * 1024)]
    with pytest.raises(PartitionError) as e:
        partition(SMALL, ring, 3, 10)
    assert str(e.value) == ("node 'w1' needs 33.00 KiB (weights 27.38 KiB + KV 5.62 KiB for "
                            "3 samples x 10 tokens) but declares memory 32.00 KiB")


def test_memory_refused_names_every_node() -> None:
    ring = [NodeSpec("s", memory=1000), NodeSpec("w1", memory=28000)]
    with pytest.raises(PartitionError) as e:
        partition(SMALL, ring, 1, 1)
    assert str(e.value) == (
        "node 's' needs 21.75 KiB (weights 21.69 KiB + KV 64 B for 1 sample x 1 token) "
        "but declares memory 1000 B; "
        "node 'w1' needs 27.56 KiB (weights 27.38 KiB + KV 192 B for 1 sample x 1 token) "
        "but declares memory 27.34 KiB")


def test_memory_just_sufficient() -> None:
    ring = [NodeSpec("s", memory=24128), NodeSpec("w1", memory=33792)]
    starter, worker = partition(SMALL, ring, 3, 10)
    assert (starter.total_bytes, worker.total_bytes) == (24128, 33792)
    with pytest.raises(PartitionError, match="node 's' needs"):
        partition(SMALL, [NodeSpec("s", memory=24127), NodeSpec("w1", memory=33792)], 3, 10)


@pytest.mark.parametrize("n,text", [
    (0, "0 B"), (1023, "1023 B"), (1024, "1.00 KiB"), (1536, "1.50 KiB"),
    (5 * 1024 ** 2, "5.00 MiB"), (int(1.1 * 1024 ** 3), "1.10 GiB"), (3 * 1024 ** 4, "3072.00 GiB"),
])
def test_format_bytes(n: int, text: str) -> None:
    assert format_bytes(n) == text


# ------------------------------------------------------------------------------ properties


@st.composite
def rings(draw: Any) -> Tuple[int, List[NodeSpec]]:
    """A model size and a ring whose nodes pin a random subset of a valid random tiling."""
    n_layers = draw(st.integers(1, 60))
    n_workers = draw(st.integers(0, min(n_layers, 8)))
    starter_end = n_layers if n_workers == 0 else draw(st.integers(0, n_layers - n_workers))
    k = max(n_workers - 1, 0)
    cuts = draw(st.lists(st.integers(starter_end + 1, n_layers - 1), min_size=k, max_size=k,
                         unique=True)) if k else []
    bounds = [0, starter_end] + sorted(cuts) + ([n_layers] if n_workers else [])
    ring = []
    for i, layers in enumerate(zip(bounds[:-1], bounds[1:])):
        pinned = draw(st.booleans())
        weight = draw(st.floats(0.01, 100, allow_nan=False))
        ring.append(NodeSpec(f"n{i}", weight=weight, layers=layers if pinned else None))
    return n_layers, ring


@settings(max_examples=300, deadline=None)
@given(rings())
def test_partition_tiles_and_keeps_pins(case: Tuple[int, List[NodeSpec]]) -> None:
    n_layers, ring = case
    cfg = SMALL.replace(n_layers=n_layers)
    placements = partition(cfg, ring, 2, 4)
    ranges = layers_of(placements)
    assert [p.name for p in placements] == [node.name for node in ring]
    assert_tiles(ranges, n_layers)
    for node, layers in zip(ring, ranges):
        if node.layers is not None:
            assert layers == node.layers
    assert sum(p.weight_bytes for p in placements) == 4 * cfg.n_params()


@settings(max_examples=200, deadline=None)
@given(n_layers=st.integers(1, 60),
       weights=st.lists(st.floats(0.01, 100, allow_nan=False), min_size=1, max_size=10))
def test_partition_without_pins_is_split_layers(n_layers: int, weights: List[float]) -> None:
    ring = [NodeSpec(f"n{i}", weight=w) for i, w in enumerate(weights)]
    if len(weights) - 1 > n_layers:
        with pytest.raises(PartitionError):
            partition(SMALL.replace(n_layers=n_layers), ring, 1, 1)
        return
    placements = partition(SMALL.replace(n_layers=n_layers), ring, 1, 1)
    assert layers_of(placements) == split_layers(n_layers, weights)


@pytest.mark.parametrize("n_layers, n_nodes, ok", [
    (12, 13, True), (12, 14, False), (12, 20, False), (1, 2, True), (1, 3, False),
    (5, 1, True), (0, 1, True), (0, 2, False)])
def test_check_ring_size(n_layers: int, n_nodes: int, ok: bool) -> None:
    from mdiedge.placement.partition import check_ring_size

    if ok:
        check_ring_size(n_layers, n_nodes)
        return
    with pytest.raises(PartitionError, match=f"{n_layers} blocks? cannot be shared among "
                                             f"{n_nodes - 1} workers? \\(a ring of {n_nodes} "
                                             f"nodes\\).* at most {n_layers + 1} nodes"):
        check_ring_size(n_layers, n_nodes)


@given(st.integers(0, 30), st.integers(1, 40))
@settings(max_examples=200, deadline=None)
def test_check_ring_size_agrees_with_split_layers(n_layers: int, n_nodes: int) -> None:
    """The check needs no weights: it passes exactly when an equal split exists."""
    from mdiedge.placement.partition import check_ring_size

    try:
        split_layers(n_layers, [1.0] * n_nodes)
        splits = True
    except PartitionError:
        splits = False
    try:
        check_ring_size(n_layers, n_nodes)
        checked = True
    except PartitionError:
        checked = False
    assert checked == splits
