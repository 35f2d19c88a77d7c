"""Expert load of mixture-of-experts blocks: how many tokens each expert received.

Nodes report ``{block index: [tokens per expert]}`` (``Transformer.expert_load``); these pure
functions merge the reports of a ring, subtract an earlier reading, and write one line per block for
``mdiedge status`` and ``mdiedge bench``. The imbalance (busiest expert over the mean) is the figure
an expert placement would act on (cf. the load-balancing loss of Switch Transformers, Fedus et al.
2022)."""
from __future__ import annotations

from typing import Dict, Iterable, List, Mapping, Sequence

ExpertLoad = Dict[str, List[int]]


def merge(reports: Iterable[Mapping[str, Sequence[int]]]) -> ExpertLoad:
    """One map over the whole ring, ordered by block index (nodes hold disjoint blocks)."""
    merged: ExpertLoad = {}
    for report in reports:
        for block, counts in report.items():
            merged[str(block)] = [int(c) for c in counts]
    return dict(sorted(merged.items(), key=lambda item: int(item[0])))


def since(after: Mapping[str, Sequence[int]], before: Mapping[str, Sequence[int]]) -> ExpertLoad:
    """The tokens routed between two readings of the same blocks."""
    out: ExpertLoad = {}
    for block, counts in after.items():
        earlier = before.get(block, [0] * len(counts))
        out[block] = [int(a) - int(b) for a, b in zip(counts, earlier)]
    return out


def imbalance(counts: Sequence[int]) -> float:
    """Busiest expert over the mean load: 1.0 is perfectly even; 0.0 when nothing was routed."""
    total = sum(counts)
    return max(counts) * len(counts) / total if total else 0.0


def lines(load: Mapping[str, Sequence[int]]) -> List[str]:
    """``block 3: 120 95 0 33 tokens per expert (busiest 1.94x the mean)`` for each block."""
    return [f"block {block}: {' '.join(str(c) for c in counts)} tokens per expert "
            f"(busiest {imbalance(counts):.2f}x the mean)" for block, counts in load.items()]
