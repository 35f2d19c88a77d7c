"""``mdiedge bench --profile``: where a decode step's time goes on each node of a ring.

Each node's chunk (the blocks the ring would give it, with the embedding, final norm, head and
sampling on the starter) is loaded in this process, one node after another, with the thread count a
local ring gives a node. After a prefill, decode steps of ``rows`` rows run with timers around each
kind of work: the compiled calls (a node's blocks; the final norm and head), the weight products
(``layers.project``), attention (scores, softmax and the KV cache), the norms, RoPE and sampling.
What no timer covers is Python and torch dispatch between them, the feed-forward's activation and
the residual adds ("other")."""
from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Tuple

import torch

from ..base.humanize import block_range

CATEGORIES = ("block step", "head step", "projections", "attention", "norms", "rope", "sampling",
              "other")


class _Timers:
    def __init__(self) -> None:
        self.seconds: Dict[str, float] = {name: 0.0 for name in CATEGORIES}

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - t0
        return timed


@contextmanager
def _timed(timers: _Timers) -> Iterator[None]:
    """Timers around the model's leaf operations (patched in for the profile, then restored)."""
    from ..model import block, layers, transformer

    step = transformer.step_code()
    patches: List[Tuple[Any, str, Any]] = [
        (layers, "project", "projections"),  # fused float products call it too
        (layers.RMSNorm, "forward", "norms"),
        (block, "apply_rope", "rope"), (block, "attention", "attention"),
        (block.KVCache, "update", "attention"), (step, "block", "block step"),
        (step, "blocks", "block step"), (step, "logits", "head step")]
    saved = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in patches]
    try:
        for owner, attr, name in patches:
            setattr(owner, attr, timers.wrap(name, getattr(owner, attr)))
        yield
    finally:
        for owner, attr, original in saved:
            setattr(owner, attr, original)


def profile_node(model: Any, rows: int, context: int, steps: int) -> Dict[str, float]:
    """Milliseconds per decode step of ``rows`` rows on one chunk, by category, and its total
    (``step_ms``, the median of steps run without timers)."""
    from ..model import sampling

    model.setup_cache(rows, context)
    steps = max(1, min(steps, (context - 3) // 2))  # untimed and timed steps fit the context
    prompt = max(1, context - 2 * steps - 2)
    with torch.inference_mode():
        model.run_blocks(torch.randn(rows, prompt, model.cfg.dim), torch.arange(rows),
                         [0] * rows)
        for _ in range(3):  # warm-up (the same position: it is overwritten)
            _decode_step(model, rows, prompt, sampling.sample_rows)
        plain = []
        for i in range(steps):
            t0 = time.perf_counter()
            _decode_step(model, rows, prompt + 1 + i, sampling.sample_rows)
            plain.append(time.perf_counter() - t0)
        timers = _Timers()
        sample = timers.wrap("sampling", sampling.sample_rows)
        with _timed(timers):
            t0 = time.perf_counter()
            for i in range(steps):
                _decode_step(model, rows, prompt + 1 + steps + i, sample)
            wall = time.perf_counter() - t0
    ms = {name: 1e3 * s / steps for name, s in timers.seconds.items()}
    ms["other"] = max(0.0, 1e3 * wall / steps - sum(ms.values()))
    ms["step_ms"] = 1e3 * statistics.median(plain)
    return ms


def _decode_step(model: Any, rows: int, position: int, sample: Callable[..., Any]) -> None:
    """One decode step of a chunk: embed (starter), its blocks, head and greedy sampling."""
    from ..model.sampling import SamplingParams

    cfg = model.cfg
    if model.has_embedding:
        x = model.embed_tokens(torch.randint(3, cfg.vocab_size, (rows, 1)))
    else:
        x = torch.randn(rows, 1, cfg.dim)
    x = model.run_blocks(x, torch.arange(rows), [position] * rows)
    if model.has_head:
        sample(model.head_logits(x[:, -1]), SamplingParams(temperature=0), [])


def profile_ring(model_path: Path, nodes: int, rows: int, context: int = 256,
                 steps: int = 16) -> List[Dict[str, Any]]:
    """Each node's profile (``profile_node``) with its blocks and thread count."""
    from ..model.checkpoint import load_config, load_model
    from ..base.threads import available_cores, node_threads
    from ..placement.partition import split_layers

    cfg = load_config(model_path)
    ranges = split_layers(cfg.n_layers, [1.0] * nodes) if nodes > 1 else [(0, cfg.n_layers)]
    threads = node_threads(0, nodes, available_cores()) if nodes > 1 else torch.get_num_threads()
    saved = torch.get_num_threads()
    out = []
    try:
        torch.set_num_threads(threads)
        for index, layers in enumerate(ranges):
            chunk = load_model(model_path, layers, embedding=index == 0, head=index == 0)
            figures: Dict[str, Any] = {"node": index, "blocks": list(layers), "rows": rows,
                                       "threads": threads}
            figures.update(profile_node(chunk, rows, context, steps))
            out.append(figures)
            del chunk
    finally:
        torch.set_num_threads(saved)
    return out


def table_lines(profiles: List[Dict[str, Any]]) -> List[str]:
    """One line per node: ms per step by category, and the share of the step each takes."""
    head = ["node", "blocks", "rows", "step ms"] + list(CATEGORIES)
    lines = ["  ".join(f"{h:>11}" for h in head)]
    for p in profiles:
        timed = sum(p[c] for c in CATEGORIES)
        cells = [str(p["node"]), block_range(p["blocks"]), str(p["rows"]),
                 f"{p['step_ms']:.2f}"]
        cells += [f"{p[c]:.2f} {100 * p[c] / timed:.0f}%" if timed else "-" for c in CATEGORIES]
        lines.append("  ".join(f"{c:>11}" for c in cells))
    return lines
