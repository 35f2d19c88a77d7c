"""The memory-bandwidth limit of decoding ("roofline", Williams et al. 2009), for ``mdiedge bench``.

A decode message reads each weight of a node once for all its rows, so a node's time per message is
at least its weight bytes over its read bandwidth. That is measured as a node decodes (one row by a
weight-sized matrix, ``layers.Linear``, the node's threads) in ``concurrent`` processes at once,
each reading its share of the ring's bytes (``probe_bytes``), so memory and last-level cache are
shared as in a local ring.

A round gives every sample one token: ``groups`` messages through every node. Node i reads ``W_i``
weight bytes per message and ``K_i`` KV bytes per row (``mean_keys`` positions on average). With ``c
= min(groups, nodes)`` nodes reading at once at ``b(c)`` each, a round of ``samples`` rows in
messages of ``m`` takes at least ``max(max_i (groups W_i + samples K_i), sum_i (W_i + m K_i)) /
b(c)`` seconds: the busiest node, or one message's trip round the ring."""
from __future__ import annotations

import math
import multiprocessing
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

_MIN_BYTES = 1 << 20
_MAX_BYTES = 1 << 30
_WIDTH = 1024  # the matrix's row length (a typical model width)


def mean_keys(prompt: int, new_tokens: int) -> float:
    """Keys attended per row, on average over ``new_tokens`` after ``prompt`` (positions prompt ..
    prompt + new_tokens - 2, each over position + 1)."""
    if prompt < 0 or new_tokens < 1:
        raise ValueError(f"no decode for a prompt of {prompt} and {new_tokens} new tokens")
    return prompt + new_tokens / 2


def round_limit_s(read_bytes: Sequence[int], samples: int, micro_batch: int, bandwidth: float,
                  kv_bytes: Optional[Sequence[float]] = None) -> float:
    """Least seconds for a round of ``samples`` tokens, ``micro_batch`` rows a message, nodes
    reading ``read_bytes`` per message and ``kv_bytes`` per row at ``bandwidth``."""
    kv = [0.0] * len(read_bytes) if kv_bytes is None else list(kv_bytes)
    if (not read_bytes or len(kv) != len(read_bytes) or samples < 1 or micro_batch < 1
            or bandwidth <= 0):
        raise ValueError(f"no limit for bytes {list(read_bytes)}, KV bytes {kv}, "
                         f"{samples} samples, {micro_batch} a message, bandwidth {bandwidth}")
    groups, rows = math.ceil(samples / micro_batch), min(micro_batch, samples)
    busiest = max(groups * w + samples * k for w, k in zip(read_bytes, kv))
    trip = sum(w + rows * k for w, k in zip(read_bytes, kv))
    return max(busiest, trip) / bandwidth


def limit_tokens_per_s(read_bytes: Sequence[int], samples: int, micro_batch: int,
                       bandwidth: float, kv_bytes: Optional[Sequence[float]] = None) -> float:
    return samples / round_limit_s(read_bytes, samples, micro_batch, bandwidth, kv_bytes)


def probe_bytes(read_bytes: Sequence[int], concurrent: int) -> int:
    """The largest node's bytes, and at least the ring's share per process, so the probe's working
    set is the ring's."""
    if not read_bytes or concurrent < 1:
        raise ValueError(f"no probe for bytes {list(read_bytes)} in {concurrent} processes")
    return max(max(read_bytes), -(-sum(read_bytes) // concurrent))


def concurrency(nodes: int, samples: int, micro_batch: int) -> int:
    """One per message in flight, at most every node."""
    return min(nodes, math.ceil(samples / micro_batch))


def _measure(nbytes: int, threads: int, seconds: float, start: Any) -> float:
    """Bytes/s of one-row products after ``start`` (a barrier, or None). Alone: the faster quartile
    (a limit, not a mean); beside others: bytes over the whole time, as one may run while others
    wait for a core."""
    import torch

    from ..model.layers import Linear

    torch.set_num_threads(threads)
    rows = max(1, nbytes // (4 * _WIDTH))
    layer = Linear(_WIDTH, rows)
    x = torch.randn(1, _WIDTH)
    with torch.inference_mode():
        layer.weight.normal_()
        layer(x)  # first touch and warm-up
        if start is not None:
            start.wait()
        times: List[float] = []
        began = time.perf_counter()
        while time.perf_counter() < began + seconds or len(times) < 3:
            t0 = time.perf_counter()
            layer(x)
            times.append(time.perf_counter() - t0)
        elapsed = time.perf_counter() - began
    if start is not None and start.parties > 1:
        return layer.weight.nbytes * len(times) / elapsed
    times.sort()
    return layer.weight.nbytes / times[len(times) // 4]


_BARRIER: Any = None


def _init(barrier: Any) -> None:
    global _BARRIER
    _BARRIER = barrier


def _child_at_barrier(args: Tuple[int, int, float]) -> float:
    return _measure(args[0], args[1], args[2], _BARRIER)


def read_bandwidth(nbytes: int, threads: int, concurrent: int = 1,
                   seconds: float = 1.0) -> float:
    """Mean bytes/s of ``concurrent`` processes reading at once; ``nbytes`` clamped to 1 MiB..1 GiB
    (cached weights read from cache)."""
    if threads < 1 or concurrent < 1:
        raise ValueError(f"threads {threads} and processes {concurrent} must be >= 1")
    nbytes = min(max(nbytes, _MIN_BYTES), _MAX_BYTES)
    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no torch state shared
    barrier = ctx.Barrier(concurrent)
    with ctx.Pool(concurrent, initializer=_init, initargs=(barrier,)) as pool:
        figures = pool.map(_child_at_barrier, [(nbytes, threads, seconds)] * concurrent)
    return statistics.mean(figures)


class Roofline:
    """Each (processes, threads, size) measured once."""

    def __init__(self, measure: Callable[[int, int, int], float] = read_bandwidth) -> None:
        self._measure = measure
        self._seen: Dict[Tuple[int, int, int], float] = {}

    def bandwidth(self, nbytes: int, threads: int, concurrent: int) -> float:
        key = (min(max(nbytes, _MIN_BYTES), _MAX_BYTES), threads, concurrent)
        if key not in self._seen:
            self._seen[key] = self._measure(key[0], threads, concurrent)
        return self._seen[key]

    def figures(self, result: Dict[str, Any], samples: int) -> Dict[str, Any]:
        """``roofline_tokens_per_s``, ``roofline_share`` (of decode tokens/s) and
        ``read_bytes_per_s`` of a bench result."""
        read, nodes, micro = result["read_bytes"], result["nodes"], result["micro_batch"]
        concurrent = concurrency(nodes, samples, micro)
        bandwidth = self.bandwidth(probe_bytes(read, concurrent), result["threads"], concurrent)
        limit = limit_tokens_per_s(read, samples, micro, bandwidth, result.get("kv_read_bytes"))
        return {"roofline_tokens_per_s": limit,
                "roofline_share": result["decode_tokens_per_s"] / limit,
                "read_bytes_per_s": bandwidth}
