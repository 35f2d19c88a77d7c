"""``mdiedge bench``: throughput, busy fraction per node, per-hop overhead and peak memory of local
rings of 1..N nodes, one sample per message against micro-batched messages. Each configuration runs
in a fresh process (peak RSS its own), its figures yielded as soon as it ends; a preset with random
weights is written once to a temporary directory."""
from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import tempfile
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Optional, Tuple

import torch

from ..base.errors import MdiedgeError
from ..base.selfcommand import mdiedge_command
from ..model import expertstats
from ..model.checkpoint import resolve_model_path, save_hf_checkpoint
from ..model.config import preset
from ..base.memory import max_rss_bytes
from ..model.sampling import SamplingParams
from ..base import defaults
from ..engine.opening import EngineSpec, open_engine
from ..engine.local import LocalEngine
from ..base.threads import available_cores, node_threads
from ..engine.ring import RingEngine
from .roofline import Roofline, mean_keys
from ..base.request import ids_request
from ..runtime.generation import Generation
from ..runtime.protocol import busy_fraction


def random_checkpoint(preset_name: str, out: Path, tokenizer: Path, seed: int = 0) -> Path:
    from ..model.transformer import Transformer

    cfg = preset(preset_name).replace(max_seq_len=2048)
    torch.manual_seed(seed)
    model = Transformer(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.02)
    save_hf_checkpoint(model, out, tokenizer=tokenizer)
    return out


def run_config(model: Path, nodes: int, samples: int, new_tokens: int, context: int,
               micro_batch: int, pings: int = 200) -> Dict[str, Any]:
    torch.manual_seed(0)
    if nodes == 1:
        return _run_local(model, samples, new_tokens, context, micro_batch)
    threads = node_threads(0, nodes, available_cores())
    with open_engine(_spec(model, nodes)) as engine:
        assert isinstance(engine, RingEngine)  # a ring answers pings
        scheduler = engine.prepare(samples, context)
        rtt = engine.ping(pings)
        before = engine.worker_status()
        timing = scheduler.run(_generation(engine.cfg, samples, new_tokens, context), micro_batch)
        scheduler.drain()
        after = engine.worker_status()
        stage = engine.own_stage()
        assert stage is not None  # the ring prepared above
        starter_load = stage.model.expert_load()  # a fresh model: all of it is this run's
        own_bytes = sum(stage.memory().values())
        own_read = read_per_message(stage.model)
        blocks = [stage.model.last - stage.model.first] + [a.layers[1] - a.layers[0] if a.layers else 0
                                              for a in after]
        kv_read = [kv_read_per_row(stage.model, engine.cfg, n, context, new_tokens)
                   for n in blocks]
    wall = timing.total_s
    busy = [busy_fraction(scheduler.stats.compute_s, wall)] + [
        busy_fraction(a.compute_s - b.compute_s, wall) for a, b in zip(after, before)]
    return {"nodes": nodes, "micro_batch": micro_batch, "tokens_per_s": timing.tokens_per_s,
            "decode_tokens_per_s": timing.decode_tokens_per_s, "busy_fraction": busy,
            "hop_overhead_us": statistics.median(rtt) / nodes * 1e6,
            "expert_load": expertstats.merge(
                [starter_load] + [expertstats.since(a.expert_load, b.expert_load)
                                  for a, b in zip(after, before)]),
            "peak_rss_bytes": [max_rss_bytes()] + [a.max_rss_bytes for a in after],
            "weight_kv_bytes": [own_bytes] + [a.weight_bytes + a.kv_bytes for a in after],
            "read_bytes": [own_read] + [a.weight_bytes for a in after], "kv_read_bytes": kv_read,
            "threads": threads}


def read_per_message(model: Any) -> int:
    """All but the embedding, of which one row per token (unless the head shares it)."""
    total = model.parameter_bytes()
    embed = getattr(model, "embed", None)
    head = getattr(model, "lm_head", None)
    if embed is not None and (head is None or head.weight is not embed.weight):
        total -= embed.weight.nbytes
    return total


def kv_read_per_row(model: Any, cfg: Any, blocks: int, context: int, new_tokens: int) -> float:
    """Mean over the bench's generation (a prompt of ``context - new_tokens``), at the model's
    dtype."""
    itemsize = 4 if getattr(model, "takes_numpy", False) \
        else next(model.parameters()).element_size()  # a CpuModel's caches are float32
    keys = mean_keys(context - new_tokens, new_tokens)
    return blocks * cfg.kv_bytes_per_token_per_layer(itemsize) * keys


def _generation(cfg: Any, samples: int, new_tokens: int, context: int) -> Generation:
    prompt = torch.randint(3, cfg.vocab_size, (context - new_tokens,)).tolist()
    return Generation(ids_request(prompt, new_tokens, samples, SamplingParams(temperature=0),
                                  context), ())


def _spec(model: Path, nodes: int) -> EngineSpec:
    """A ring file's patience for a ring (a large preset's message may take long)."""
    return EngineSpec(model=model, nodes=nodes, timeout_s=defaults.RING_TIMEOUT_S)


def _run_local(model: Path, samples: int, new_tokens: int, context: int,
               micro_batch: int) -> Dict[str, Any]:
    engine = open_engine(_spec(model, 1))
    assert isinstance(engine, LocalEngine)  # its one model's figures
    timing = engine.run(_generation(engine.cfg, samples, new_tokens, context), micro_batch)
    assert engine.scheduler is not None  # set up by the run
    busy = busy_fraction(engine.scheduler.stats.compute_s, timing.total_s)
    return {"nodes": 1, "micro_batch": micro_batch, "tokens_per_s": timing.tokens_per_s,
            "decode_tokens_per_s": timing.decode_tokens_per_s, "busy_fraction": [busy],
            "hop_overhead_us": None,
            "expert_load": engine.model.expert_load(),
            "peak_rss_bytes": [max_rss_bytes()],
            "weight_kv_bytes": [engine.model.parameter_bytes() + engine.model.kv_cache_bytes()],
            "read_bytes": [read_per_message(engine.model)],
            "kv_read_bytes": [kv_read_per_row(engine.model, engine.cfg, engine.model.last - engine.model.first,
                                              context, new_tokens)],
            "threads": torch.get_num_threads()}


def configurations(max_nodes: int, samples: int) -> List[Tuple[int, int]]:
    """Per ring size: one sample per message, the starter's own choice, all samples in one message.
    """
    return [(nodes, micro_batch) for nodes in range(1, max_nodes + 1)
            for micro_batch in sorted({1, math.ceil(samples / nodes), samples})]


Runner = Callable[[Path, int, int, int, int, int], Dict[str, Any]]


def run_subprocess(path: Path, nodes: int, samples: int, new_tokens: int, context: int,
                   micro_batch: int) -> Dict[str, Any]:
    """In a fresh ``mdiedge bench --one`` process of this package (``selfcommand``)."""
    cmd = mdiedge_command(["bench", "--one", "--model", str(path),
           "--nodes", str(nodes), "--samples", str(samples), "--new-tokens", str(new_tokens),
           "--context", str(context), "--micro-batch", str(micro_batch)])
    out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
    if out.returncode != 0:
        lines = [line for line in out.stderr.splitlines() if line.strip()]
        why = lines[-1].replace("mdiedge: error: ", "", 1)[-300:] if lines else \
            f"exit status {out.returncode}"
        raise MdiedgeError(f"bench configuration of {nodes} node(s), {micro_batch} sample(s) per "
                           f"message failed: {why}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# a run's speed figures, kept for each run of a repeated configuration
RUN_FIGURES = ("tokens_per_s", "decode_tokens_per_s", "roofline_tokens_per_s",
               "roofline_share", "read_bytes_per_s", "hop_overhead_us")


def median_run(runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The run of median decode tokens/s (the lower middle for an even count), every run's figures
    under ``runs``. Its bandwidth limit is the median of the runs' probes (one probe swings more
    than the decode it judges)."""
    if not runs:
        raise ValueError("no runs to choose from")
    ordered = sorted(runs, key=lambda r: r["decode_tokens_per_s"])
    chosen = dict(ordered[(len(ordered) - 1) // 2])
    chosen["runs"] = [{k: r[k] for k in RUN_FIGURES if k in r} for r in runs]
    if all("roofline_tokens_per_s" in r for r in runs):
        for key in ("roofline_tokens_per_s", "read_bytes_per_s"):
            chosen[key] = statistics.median(r[key] for r in runs)
        chosen["roofline_share"] = chosen["decode_tokens_per_s"] / chosen[
            "roofline_tokens_per_s"]
    return chosen


def run_all(model: Optional[str], preset_name: Optional[str], max_nodes: int, samples: int,
            new_tokens: int, context: int, runner: Optional[Runner] = None,
            measuring: Optional[Callable[[str], ContextManager[Any]]] = None,
            roofline: Optional[Roofline] = None, repeat: int = 1) -> Iterator[Dict[str, Any]]:
    """Each configuration's figures as soon as measured (``runner``, default ``run_subprocess``),
    with its bandwidth limit probed between configurations; ``repeat`` > 1: the median run's
    (``median_run``), a fresh probe after each run."""
    if repeat < 1:
        raise ValueError(f"repeat {repeat} is not >= 1")
    shown = measuring or (lambda what: nullcontext())
    probes = [roofline or Roofline() for _ in range(repeat)]  # fresh probes for each run
    with tempfile.TemporaryDirectory(prefix="mdiedge-bench-") as tmp:
        if preset_name:
            with shown(f"writing random weights shaped like {preset_name}"):
                path = random_checkpoint(preset_name, Path(tmp) / preset_name,
                                         resolve_model_path(None) / "tokenizer.model")
        else:
            path = resolve_model_path(model)
        configs = configurations(max_nodes, samples)
        for i, (nodes, micro_batch) in enumerate(configs, 1):
            runs = []
            for run, limits in enumerate(probes, 1):
                what = (f"{nodes} node{'s' if nodes > 1 else ''}, {micro_batch} "
                        f"sample{'s' if micro_batch > 1 else ''} per message"
                        + (f", run {run} of {repeat}" if repeat > 1 else ""))
                with shown(f"measuring {i} of {len(configs)}: {what}"):
                    result = (runner or run_subprocess)(path, nodes, samples, new_tokens,
                                                        context, micro_batch)
                with shown(f"measuring the read bandwidth of {nodes} node"
                           f"{'s' if nodes > 1 else ''}"):
                    result.update(limits.figures(result, samples))
                runs.append(result)
            yield median_run(runs) if repeat > 1 else runs[0]
