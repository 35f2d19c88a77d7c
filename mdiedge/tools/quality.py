"""The quality guard of link compression (``mdiedge bench --compression CODEC``), a codec against
``none``: bytes per hop (a prefill and a decode frame, and a real 3-node ring's first link); top-1
agreement and perplexity teacher-forced over held-out text, the model split in this process at a
ring's block boundaries and every hop (the return one included) through the codec's encode and
decode (``CODEC.select()``), each of the prefill and decode codecs on every position, the worse
reported; tokens/s and time to first token on a real local ring. Held-out text: the last
``held_out`` of ``text`` (NanoLlama trained on Tiny Shakespeare's first 90%)."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from ..base.codecs import NONE, Compression, encoded_size
from ..base.nodes import NodeSpec, StarterOptions
from ..model.sampling import SamplingParams
from ..base.defaults import RING_TIMEOUT_S
from ..engine.engine import TextModel
from ..engine.opening import EngineSpec, open_engine
from ..roles.starter import Route
from ..runtime.framing import CODEC
from ..placement.partition import partition

FRAME_HEADER = 48 + 8  # fixed header and one sample's table entry


def round_trip(x: torch.Tensor, codec: int, impl: Any = None) -> torch.Tensor:
    if codec == NONE:
        return x
    impl = impl or CODEC.select()
    flat = x.detach().contiguous().reshape(-1)
    raw = np.empty(encoded_size(codec, flat.numel()), dtype=np.uint8)
    impl.encode(codec, flat.numpy(), raw)
    out = torch.empty_like(flat)
    impl.decode(codec, raw, out.numpy())
    return out.reshape(x.shape)


def stage_ranges(cfg: Any, nodes: int, context: int) -> List[Tuple[int, int]]:
    """Starter first."""
    shares = [StarterOptions().spec] + [NodeSpec(f"w{i}") for i in range(1, nodes)]
    return [p.layers for p in partition(cfg, shares, 1, context)]


def _run_range(model: Any, x: torch.Tensor, layers: Tuple[int, int]) -> torch.Tensor:
    from ..model.layers import rope_tables
    from ..model.transformer import NO_SLOTS

    cos, sin = rope_tables(model.cfg, x.shape[1])
    cos, sin = cos[None, None], sin[None, None]
    for i in range(*layers):
        x = model.layers[str(i)](x, cos, sin, None, NO_SLOTS, ())
    return x


@torch.no_grad()
def teacher_forced(model: Any, tokens: List[int], ranges: List[Tuple[int, int]], codec: int,
                   window: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Top-1 and next-token NLL at every position (``window``-token windows from 0), ``codec`` on
    every hop."""
    preds, nlls = [], []
    for start in range(0, len(tokens) - 1, window):
        chunk = torch.tensor(tokens[start:start + window + 1])[None]
        x = model.embed_tokens(chunk[:, :-1])
        for layers in ranges:  # each node's blocks, then the hop to the next (or back)
            x = round_trip(_run_range(model, x, layers), codec)
        logits = model.head_logits(x)[0]
        preds.append(logits.argmax(-1))
        nlls.append(torch.nn.functional.cross_entropy(logits, chunk[0, 1:], reduction="none"))
    return torch.cat(preds), torch.cat(nlls)


def held_out_tokens(text_model: TextModel, text: Path, held_out: float, limit: int) -> List[int]:
    raw = text.read_text(encoding="utf-8")
    return text_model.tokenizer.encode(raw[int(len(raw) * (1 - held_out)):])[:limit]


def agreement(model: Any, tokens: List[int], ranges: List[Tuple[int, int]],
              compression: Compression, window: int) -> Dict[str, Any]:
    """With ``none``, and both perplexities (the worse of prefill/decode)."""
    base_pred, base_nll = teacher_forced(model, tokens, ranges, NONE, window)
    worst: Optional[Dict[str, Any]] = None
    for name in dict.fromkeys((compression.prefill, compression.decode)):
        pred, nll = teacher_forced(model, tokens, ranges, Compression(name).code(True), window)
        found = {"codec": name, "top1_agreement": round(float((pred == base_pred).float()
                                                             .mean()), 5),
                 "perplexity": round(math.exp(float(nll.mean())), 4)}
        if worst is None or found["top1_agreement"] < worst["top1_agreement"]:
            worst = found
    assert worst is not None
    ppl_none = round(math.exp(float(base_nll.mean())), 4)
    return dict(worst, perplexity_none=ppl_none, tokens=len(tokens) - 1,
                perplexity_change=round(worst["perplexity"] / ppl_none - 1, 5))


def ring_run(model: Optional[str], compression: str, prompt: List[int], new_tokens: int,
             nodes: int, repeats: int = 3, route: Optional[Route] = None,
             **options: Any) -> Dict[str, Any]:
    """Medians of ``repeats`` timed greedy generations after a warm-up, and the links' counts over
    all; ``options``: more ``EngineSpec`` fields; ``route``: delaying relays."""
    timings = []
    spec = EngineSpec(model=model, nodes=nodes, route=route, timeout_s=RING_TIMEOUT_S,
                      compression=compression, **options)
    with open_engine(spec) as engine:
        text = engine.tokenizer.decode(prompt)
        engine.generate(text, 2, 1, SamplingParams(temperature=0))  # warm-up
        for _ in range(repeats):
            timings.append(engine.generate(text, new_tokens, 1,
                                           SamplingParams(temperature=0)).timing)
        links = engine.link_stats()

    def median(values: List[float]) -> float:
        return round(sorted(values)[len(values) // 2], 4)

    return {"ttft_s": median([t.prefill_s for t in timings]),
            "decode_tok_s": median([t.decode_tokens_per_s for t in timings]),
            "tokens_per_s": median([t.tokens_per_s for t in timings]),
            "generations": repeats + 1, "links": links}


def guard(model: Optional[str], compression: str, text: Path, held_out: float = 0.1,
          eval_tokens: int = 4096, window: int = 256, prompt_tokens: int = 512,
          new_tokens: int = 64, nodes: int = 3) -> Dict[str, Any]:
    from ..model.checkpoint import load_model

    codecs = Compression.parse(compression, "--compression")
    text_model = TextModel(model, None)
    cfg = text_model.cfg
    full = load_model(text_model.path)
    ranges = stage_ranges(cfg, nodes, min(cfg.max_seq_len, prompt_tokens + new_tokens))
    tokens = held_out_tokens(text_model, text, held_out, eval_tokens + 1)
    prompt = tokens[:min(prompt_tokens, cfg.max_seq_len - new_tokens)]
    hop = {}
    for name, codec_name in (("none", "none"), ("prefill", codecs.prefill),
                             ("decode", codecs.decode)):
        code = Compression(codec_name).code(True)
        hop[name] = {"prefill_frame": FRAME_HEADER + encoded_size(code, len(prompt) * cfg.dim),
                     "decode_frame": FRAME_HEADER + encoded_size(code, cfg.dim)}
    runs = {c: ring_run(model, c, prompt, new_tokens, nodes) for c in ("none", str(codecs))}
    return {"model": str(text_model.path), "compression": str(codecs), "nodes": nodes,
            "splits": [list(r) for r in ranges], "prompt_tokens": len(prompt),
            "bytes_per_hop": {
                "prefill": [hop["none"]["prefill_frame"], hop["prefill"]["prefill_frame"]],
                "decode": [hop["none"]["decode_frame"], hop["decode"]["decode_frame"]],
                "prefill_reduction": round(hop["none"]["prefill_frame"]
                                           / hop["prefill"]["prefill_frame"], 3),
                "decode_reduction": round(hop["none"]["decode_frame"]
                                          / hop["decode"]["decode_frame"], 3)},
            "quality": agreement(full, tokens, ranges, codecs, window), "runs": runs}
