"""``mdiedge bench --early-exit CRITERION``: the same workload with and without early exit in
one run.

- Quality, teacher-forced over held-out text (the second half of the held-out tail; the first
  half calibrates, see ``calibrate``): every position is a real decode step through
  the model with its KV cache, the exit rule and the KV fill, so a token sees the cache that
  earlier exits left. Reported: top-1 agreement with the same steps without early exit, and
  the perplexity of both.
- Speed: greedy generations from a held-out prompt, in this process (1 node) and on a local
  ring (``nodes``), of 1 and ``samples`` samples: tokens/s without and with early exit (the
  median of ``repeats``), their ratio, blocks per token and exit rates.
"""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple


from ...model.checkpoint import content_hash, load_model
from ...model.earlyexit.files import ExitSettings, exit_policy, exit_settings
from ...model.sampling import SamplingParams
from ...base.defaults import RING_TIMEOUT_S
from ...engine.engine import Engine, TextModel
from ...engine.opening import EngineSpec, open_engine
from ...base.errors import ConfigError
from ...model.earlyexit.files import THRESHOLDS_FILE
from .calibrate import MIN_TOKENS, decode_forced, held_out_halves


def quality(path: Path, tokens: List[int], settings: ExitSettings, window: int = 256
            ) -> Dict[str, Any]:
    model = load_model(path)
    policy = exit_policy(settings, model.cfg, content_hash(path), model.head_logits)
    base_pred, base_nll, _ = decode_forced(model, tokens, None, window)
    pred, nll, depths = decode_forced(model, tokens, policy, window)
    return {"tokens": len(depths), "top1_agreement": round(float((pred == base_pred)
                                                                 .float().mean()), 5),
            "perplexity_none": round(math.exp(float(base_nll.mean())), 4),
            "perplexity": round(math.exp(float(nll.mean())), 4),
            "mean_layers": round(statistics.mean(depths), 3)}


def _timed(engine: Engine, prompt: str, new_tokens: int, samples: int, repeats: int
           ) -> Dict[str, Any]:
    greedy = SamplingParams(temperature=0)
    engine.generate(prompt, 4, samples, greedy)  # warm-up
    runs = [engine.generate(prompt, new_tokens, samples, greedy) for _ in range(repeats)]
    rates = [r.timing.tokens_per_s for r in runs]
    best = runs[rates.index(statistics.median(rates))] if repeats % 2 else runs[-1]
    return {"tokens_per_s": round(statistics.median(rates), 2), "early_exit": best.early_exit}


def speed(path: Path, nodes: int, samples: int, exits: Tuple[str, Optional[str]], prompt: str,
          new_tokens: int, repeats: int) -> Dict[str, Any]:
    """tokens/s of the same generations without and with early exit (``exits``: the
    criterion and threshold) on ``nodes``."""
    results = {}
    for name, (criterion, threshold) in (("none", (None, None)), ("exit", exits)):
        spec = EngineSpec(model=path, nodes=nodes, early_exit=criterion,
                          exit_threshold=threshold,
                          timeout_s=None if nodes == 1 else RING_TIMEOUT_S)
        with open_engine(spec) as engine:
            results[name] = _timed(engine, prompt, new_tokens, samples, repeats)
    ratio = results["exit"]["tokens_per_s"] / max(results["none"]["tokens_per_s"], 1e-9)
    return {"nodes": nodes, "samples": samples,
            "tokens_per_s_none": results["none"]["tokens_per_s"],
            "tokens_per_s_exit": results["exit"]["tokens_per_s"],
            "speedup": round(ratio, 3), "early_exit": results["exit"]["early_exit"]}


def calibrated_tokens(path: Path) -> int:
    """How many held-out tokens ``mdiedge calibrate-exit`` chose the thresholds on (0: none
    recorded)."""
    found = (path if path.is_dir() else path.parent) / THRESHOLDS_FILE
    try:
        return int(json.loads(found.read_text())["calibrated_on"]["held_out_tokens_used"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def run(model: Optional[str], criterion: str, threshold: Optional[str], text: Path,
        nodes: int, samples: int, new_tokens: int = 128, prompt_tokens: int = 64,
        eval_tokens: int = 8192, held_out: float = 0.1, repeats: int = 3,
        shown: Optional[Callable[[Dict[str, Any]], None]] = None) -> Dict[str, Any]:
    """Every figure of the early-exit bench; ``shown`` sees each speed row as it is done."""
    text_model = TextModel(model, None)
    path, cfg = text_model.path, text_model.cfg
    settings = exit_settings(path, cfg, content_hash(path), criterion, threshold)
    raw = text.read_text(encoding="utf-8")
    held = text_model.tokenizer.encode(raw[int(len(raw) * (1 - held_out)):])
    used = calibrated_tokens(path)  # measured after what the thresholds were chosen on
    if used:
        measured = held[used:used + eval_tokens // 2]
    else:
        _, measured = held_out_halves(held[:eval_tokens], str(text))
    if len(measured) < MIN_TOKENS:
        raise ConfigError(f"{text}: only {len(measured)} held-out tokens left after the "
                          f"{used} calibrated on")
    prompt = text_model.tokenizer.decode(measured[:prompt_tokens])
    result: Dict[str, Any] = {"model": str(path), "criterion": criterion,
                              "thresholds": settings.to_json()["thresholds"],
                              "quality": quality(path, measured, settings), "runs": []}
    for n in sorted({1, nodes}):
        for s in sorted({1, samples}):
            row = speed(path, n, s, (criterion, threshold), prompt, new_tokens, repeats)
            result["runs"].append(row)
            if shown is not None:
                shown(row)
    return result
